"""Entry points are cachelab's only registry: built-ins and third-party plug-ins alike.

``cachelab`` never imports ``policies``, ``predictors`` or ``traces`` by name; it loads the
``cachelab.*`` entry-point groups. A plug-in that fails to load is recorded with its reason
and skipped, so one broken package never breaks unrelated commands.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

from cachelab.errors import CachelabError

POLICIES = "cachelab.policies"
PREDICTORS = "cachelab.predictors"
WORKLOADS = "cachelab.workloads"
GROUPS = (POLICIES, PREDICTORS, WORKLOADS)


@dataclass(frozen=True, slots=True)
class Plugin:
    """One entry point: where it came from and what loading it gave."""

    group: str
    name: str
    value: str
    distribution: str
    version: str
    obj: object | None = None
    error: str | None = None


@lru_cache(maxsize=None)
def discover(group: str) -> tuple[Plugin, ...]:
    """Every entry point of ``group``, loaded; failures carry their reason instead of raising."""
    found = []
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        try:
            obj, error = ep.load(), None
        except Exception as exc:  # a plug-in's import error must not break the caller
            obj, error = None, f"{type(exc).__name__}: {exc}"
        found.append(Plugin(group, ep.name, ep.value, dist, version, obj, error))
    return tuple(found)


def get(group: str, name: str):
    """The loaded object registered as ``name`` in ``group``, or a clear error."""
    plugins = {p.name: p for p in discover(group)}
    plugin = plugins.get(name)
    if plugin is None:
        kind = group.split(".")[-1].removesuffix("s").replace("policie", "policy")
        raise CachelabError(f"unknown {kind} {name!r}; installed: {sorted(plugins) or 'none'}")
    if plugin.error is not None:
        raise CachelabError(f"plug-in {name!r} from {plugin.distribution} failed to load: {plugin.error}")
    return plugin.obj


def make_policy(name: str, **params):
    """A policy instance by registry name; unknown hyper-parameters are named in the error.

    ``name`` may carry an admission filter as ``policy+filter`` (``lru+tinylfu``), the
    derived-name convention for eviction x admission variants.
    """
    if "+" in name:
        name, admission = name.split("+", 1)
        params.setdefault("admission", admission)
    cls = get(POLICIES, name)
    sig = inspect.signature(cls)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    known = [p for p in sig.parameters if sig.parameters[p].kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(params) - set(known))
    if unknown and not takes_any:
        raise CachelabError(f"policy {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                            f"it takes {known or 'none'}")
    return cls(**params)
