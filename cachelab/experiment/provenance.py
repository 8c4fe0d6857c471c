"""What code made a run: cachelab's version and git commit, and the version of every distribution
that provides a plug-in. A point's hash deliberately leaves the code out (a rerun after an
upgrade reuses finished points), so these tags are how a result is traced back to the code."""

from __future__ import annotations

import json
import subprocess
from functools import lru_cache
from importlib.metadata import entry_points, version
from pathlib import Path

from cachelab.registry import GROUPS

SOURCE = Path(__file__).resolve().parents[1]  # the cachelab package's folder
GIT_TAGS = ("mlflow.source.git.commit", "cachelab.source_dirty")  # only where cachelab runs from its checkout


@lru_cache(maxsize=1)
def provenance_tags() -> dict[str, str]:
    """MLflow tags: ``cachelab.version``; ``mlflow.source.git.commit`` (MLflow's own key, shown in
    its UI) and ``cachelab.source_dirty`` where cachelab runs from a git checkout; and
    ``cachelab.plugins``, ``{distribution: version}`` of every entry point's distribution."""
    tags = {"cachelab.version": version("cachelab")}
    top = _git(["rev-parse", "--show-toplevel"])
    if top and Path(top).resolve() == SOURCE.parent:  # cachelab's own checkout, not a repository it is installed in
        tags[GIT_TAGS[0]] = _git(["rev-parse", "HEAD"])
        tags[GIT_TAGS[1]] = str(bool(_git(["status", "--porcelain", "--untracked-files=no"]))).lower()
    dists = {ep.dist.metadata["Name"]: ep.dist.version for group in GROUPS for ep in entry_points(group=group)
             if ep.dist is not None}
    tags["cachelab.plugins"] = json.dumps(dict(sorted(dists.items())), separators=(",", ":"))
    return tags


def _git(args: list[str]) -> str:
    """A git command's output in the folder cachelab is imported from; "" where there is no git or
    no repository (an installed wheel)."""
    try:
        out = subprocess.run(["git", *args], cwd=SOURCE, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
