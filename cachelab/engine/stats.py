"""Typed results of the engine: what a replay counted, per level and per link.

They cross layers (CLI, experiments, serving) as small frozen dataclasses; ``to_dict()``
gives the JSON shape the CLI prints and the experiment logs, key for key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


class _Flat:
    """A record of plain fields: its dict is its fields."""

    __slots__ = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TierStats:
    """One level of a hierarchy after the warm-up: rows and lookups it served, of those that reached it.

    ``policy`` and ``capacity_rows`` are set for a cache tier, not for a backing level;
    ``infinite`` when its capacity held every row it could see (``cachelab.policy.unbounded``).
    """

    location: str  # gpu / host / ssd
    served_unique: int  # distinct rows of a step it served
    served_lookups: int  # lookups of the rows it served
    requests_unique: int  # distinct rows that reached it
    requests_lookups: int  # lookups of the rows that reached it
    policy: str | None = None
    capacity_rows: int | None = None
    infinite: bool = False

    @property
    def hit_ratio_unique(self) -> float:
        return self.served_unique / self.requests_unique if self.requests_unique else 0.0

    @property
    def hit_ratio_lookup(self) -> float:
        return self.served_lookups / self.requests_lookups if self.requests_lookups else 0.0

    def to_dict(self) -> dict:
        out = {"location": self.location, "served_unique": self.served_unique, "served_lookups": self.served_lookups,
               "requests_unique": self.requests_unique, "requests_lookups": self.requests_lookups,
               "hit_ratio_unique": self.hit_ratio_unique, "hit_ratio_lookup": self.hit_ratio_lookup}
        if self.policy is not None:
            out.update(policy=self.policy, capacity_rows=self.capacity_rows, infinite=self.infinite)
        return out


@dataclass(frozen=True, slots=True)
class LinkBytes(_Flat):
    """Bytes moved per link (docs/engine.md, "Bytes per link")."""

    hbm_read: int
    host_to_gpu: int
    host_read: int
    ssd_to_host: int


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """Totals of a whole-stream replay after the warm-up."""

    steps: int
    warmup_steps: int
    warmup_lookups: int
    lookups: int
    unique_rows: int
    row_bytes: int
    levels: dict[str, TierStats]
    bytes: LinkBytes
    page_reads: int
    read_amplification: float

    def to_dict(self) -> dict:
        return {"steps": self.steps, "warmup_steps": self.warmup_steps, "warmup_lookups": self.warmup_lookups,
                "lookups": self.lookups, "unique_rows": self.unique_rows, "row_bytes": self.row_bytes,
                "levels": {name: level.to_dict() for name, level in self.levels.items()},
                "bytes": self.bytes.to_dict(), "page_reads": self.page_reads,
                "read_amplification": self.read_amplification}


@dataclass(frozen=True, slots=True)
class StepCounts:
    """One step of a stepped replay, per layer table (sampled counts)."""

    lookups: np.ndarray  # int64 [layers]
    served: np.ndarray  # int64 [layers, levels]: distinct rows served by each level
    page_reads: np.ndarray  # int64 [layers]


@dataclass(frozen=True, slots=True)
class SampledLevel(_Flat):
    """One level of a stepped replay, scaled to full size."""

    hit_ratio_unique: float
    served_rows: float
    served_bytes: float


@dataclass(frozen=True, slots=True)
class SampledStats:
    """Totals of a stepped (optionally sampled) replay, counts divided by the rate the sample
    keeps (``effective_sample_rate``, ``sampling.effective_rate``: the hash's threshold rounds
    ``sample_rate``, the rate asked for)."""

    sample_rate: float
    effective_sample_rate: float
    lookups: float
    unique_rows: float
    page_reads: float
    levels: dict[str, SampledLevel] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"sample_rate": self.sample_rate, "effective_sample_rate": self.effective_sample_rate,
                "lookups": self.lookups, "unique_rows": self.unique_rows,
                "levels": {name: level.to_dict() for name, level in self.levels.items()},
                "page_reads": self.page_reads}
