"""Results on local disk first: every finished point is written here before it is tracked.

``runs/<experiment>/outbox/<hash>/`` holds a point's ``record.json`` (label, params,
metrics, times) and its artifacts; a failed point's, its FAILED run with the error, sits in
``outbox/<hash>.failed`` (not its hash: a rerun runs it again); the parent run's record sits in
``outbox/_parent``.
A record leaves the outbox only once the tracking server has it, so a server that is down
or dies mid-sweep loses nothing: ``cachelab sync`` sends what is left. One ``run`` or
``sync`` at a time holds an experiment's folder (``runs/<experiment>/.lock``): two at once
would run, or send, the same points twice (sweeps from two folders or machines into one store
share the points through claims in the store: ``cachelab.experiment.claims``).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl

from cachelab.paths import held

PARENT = "_parent"


def failed_key(point_hash: str) -> str:
    """The outbox key of a failed point's record: never taken for a finished point's hash."""
    return f"{point_hash}.failed"


@dataclass
class Record:
    """One run to track: the parent (``hash`` = spec hash) or a point."""

    hash: str
    label: str
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, bytes] = field(default_factory=dict)  # relative path -> content
    start_ms: int = 0
    end_ms: int = 0
    status: str = "FINISHED"

    def add_table(self, name: str, table: pl.DataFrame) -> None:
        buf = io.BytesIO()
        table.write_parquet(buf)
        self.artifacts[f"{name}.parquet"] = buf.getvalue()


def now_ms() -> int:
    return int(time.time() * 1000)


class Outbox:
    """Records not yet confirmed by the tracking server, one folder each."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def write(self, record: Record, key: str | None = None) -> Path:
        """Write ``record`` whole beside the outbox, then move it in. One that replaces a waiting
        record (the parent's, rewritten as a sweep goes) moves the old one aside first, and
        ``keys`` puts it back if a kill comes before the new one is in: the old folder was deleted
        first, and a kill then left the outbox without the parent its points are sent under."""
        name = key or record.hash
        final, tmp, old = self.root / name, self.root / f".{name}.tmp", self.root / f".{name}.old"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "artifacts").mkdir(parents=True)
        meta = asdict(record)
        meta.pop("artifacts")
        (tmp / "record.json").write_text(json.dumps(meta, indent=1))
        for rel, data in record.artifacts.items():
            dst = tmp / "artifacts" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)  # a record is whole or absent
        shutil.rmtree(old, ignore_errors=True)
        return final

    def read(self, key: str) -> Record:
        folder = self.root / key
        meta = json.loads((folder / "record.json").read_text())
        arts = folder / "artifacts"
        meta["artifacts"] = {p.relative_to(arts).as_posix(): p.read_bytes()
                             for p in sorted(arts.rglob("*")) if p.is_file()}
        return Record(**meta)

    def keys(self, repair: bool = True) -> list[str]:
        """Point hashes waiting (the parent, if waiting, is ``PARENT`` and listed last). A
        ``.<hash>.tmp`` folder is a write a kill cut short: never a record; a ``.<hash>.old`` one
        without its ``<hash>`` is the record such a write was replacing, put back (``repair``: only
        by the holder of the folder; a reader beside a running sweep would break its write)."""
        if not self.root.is_dir():
            return []
        for old in self.root.glob(".*.old") if repair else []:  # a replacement a kill cut short
            final = self.root / old.name[1:-len(".old")]
            if not final.exists():
                old.rename(final)
        found = sorted(p.name for p in self.root.iterdir()
                       if not p.name.startswith(".") and (p / "record.json").is_file())
        return [k for k in found if k != PARENT] + ([PARENT] if PARENT in found else [])

    def remove(self, key: str) -> None:
        shutil.rmtree(self.root / key, ignore_errors=True)

    def held(self, what: str):
        """This experiment's folder for ``what`` alone, until the block ends (``paths.held``)."""
        return held(self.root.parent / ".lock", what, "running both would run or send the same points twice")
