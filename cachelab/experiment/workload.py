"""A spec's workload, built once per experiment and shared by every point that replays it.

Text from a ``cachelab.workloads`` corpus is tokenized with the layout's tokenizer, addressed
(one prefill sequence per document) and cut into serving steps of ``tokens_per_step``
positions. The result is cached on disk under ``cache_dir()/workloads/<hash>.npz``, so
process-pool and Ray workers load it instead of re-tokenizing, and reruns start at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import Progress

from cachelab import registry
from cachelab.engram import Addresser, encode, get_preset
from cachelab.engram.stats import row_skew
from cachelab.experiment.spec import WorkloadSpec, resolve_data_path
from cachelab.experiment.sweep import config_hash
from cachelab.paths import cache_dir

ENCODE_BATCH = 256


@dataclass(frozen=True)
class Workload:
    """Engram rows of every token position, with step and document boundaries."""

    rows: np.ndarray  # int32 [tokens, layers, columns]
    step_offsets: np.ndarray  # int64 [steps + 1], token offsets of serving steps
    doc_offsets: np.ndarray  # int64 [documents + 1]
    domains: np.ndarray  # str [documents]
    preset: str

    @property
    def num_steps(self) -> int:
        return self.step_offsets.size - 1

    def stats(self) -> tuple[dict, list[dict]]:
        """Parent-run metrics and the per-layer, per-order skew table (addressing stats)."""
        cfg = get_preset(self.preset)
        skew = [s.to_dict() for s in row_skew(self.rows, cfg)]
        per_token = len(cfg.layers) * cfg.columns
        metrics = {"workload.documents": self.doc_offsets.size - 1, "workload.tokens": self.rows.shape[0],
                   "workload.lookups": int(self.rows.size), "workload.steps": self.num_steps,
                   "workload.bytes_per_token": per_token * cfg.row_bytes}
        for s in skew:
            tag = f"L{s['layer']}" + (f".o{s['order']}" if s["order"] else "")
            metrics[f"addressing.{tag}.unique_rows"] = s["unique_rows"]
            metrics[f"addressing.{tag}.top1pct_share"] = s["top1pct_share"]
        return metrics, skew


def workload_key(spec: WorkloadSpec | dict) -> str:
    data = spec.model_dump(mode="json") if isinstance(spec, WorkloadSpec) else dict(spec)
    return config_hash(data)


def workload_file(spec: WorkloadSpec) -> Path:
    return cache_dir() / "workloads" / f"{workload_key(spec)}.npz"


def build_workload(spec: WorkloadSpec, progress: Progress | None = None) -> Path:
    """Build (or find in the cache) the workload of ``spec``; returns its ``.npz`` path."""
    path = workload_file(spec)
    if path.exists():
        return path
    cls = registry.get(registry.WORKLOADS, spec.source)
    kwargs = dict(spec.params)
    if spec.path is not None:
        kwargs["path"] = str(resolve_data_path(spec.path))
    docs = list(cls(**kwargs).documents())
    addresser = Addresser(get_preset(spec.preset))
    chunks, lengths, budget = [], [], spec.max_tokens
    task = progress.add_task(f"address {spec.source}", total=len(docs)) if progress else None
    for i in range(0, len(docs), ENCODE_BATCH):
        ids = encode([d.text for d in docs[i:i + ENCODE_BATCH]], addresser.config.tokenizer, bos=True)
        if budget is not None:
            ids, budget = _clip(ids, budget)
        lengths += [x.size for x in ids]
        if ids:
            offsets = np.concatenate([[0], np.cumsum([x.size for x in ids])])
            chunks.append(addresser.rows(np.concatenate(ids), offsets))
        if progress:
            progress.advance(task, min(ENCODE_BATCH, len(docs) - i))
        if budget == 0:
            break
    docs = docs[:len(lengths)]
    rows = np.concatenate(chunks)
    tokens = rows.shape[0]
    step_offsets = np.append(np.arange(0, tokens, spec.tokens_per_step), tokens).astype(np.int64)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, rows=rows, step_offsets=step_offsets, doc_offsets=doc_offsets,
             domains=np.array([d.domain for d in docs]),
             meta=np.array(json.dumps({"preset": spec.preset})))
    tmp.replace(path)  # atomic: a killed build never leaves a half-written cache entry
    return path


def _clip(ids: list[np.ndarray], budget: int) -> tuple[list[np.ndarray], int]:
    out = []
    for x in ids:
        if budget <= 0:
            break
        out.append(x[:budget])
        budget -= out[-1].size
    return out, budget


def load_workload(path: str | Path) -> Workload:
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        return Workload(z["rows"], z["step_offsets"], z["doc_offsets"], z["domains"], meta["preset"])
