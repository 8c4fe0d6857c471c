"""A spec's workload as a lookup stream, built once and shared by every point that replays it.

Text comes from a ``cachelab.workloads`` corpus (whole documents, prefilled in steps of
``tokens_per_step`` positions), or from a request trace built by ``cachelab.trace.build``
(real arrivals with corpus content: prompts prefilled in chunks, then one decode step per
output token). Either way the addresser turns tokens into Engram rows and the result is a
``LookupStream`` cached on disk under ``cache_dir()/workloads/<hash>.npz``, so pool and Ray
workers load it instead of re-tokenizing, and reruns start at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from rich.progress import Progress

from cachelab import registry
from cachelab.engram import Addresser, encode, get_preset
from cachelab.engram.stats import skew
from cachelab.errors import CachelabError
from cachelab.experiment.spec import WorkloadSpec
from cachelab.experiment.sweep import config_hash, data_digests
from cachelab.workload.lookups import LookupStream, first_tokens, split_key
from cachelab.paths import cache_dir, one_builder, replacing, resolve_data_path

ENCODE_BATCH = 256


BUILD_VERSION = 4  # bump when what a build stores changes, so stale cache entries are not reused


def workload_key(spec: WorkloadSpec | dict) -> str:
    """The build's cache key: its section, the build version and its data files' contents (a trace
    rewritten in place is built again)."""
    data = spec.model_dump(mode="json") if isinstance(spec, WorkloadSpec) else dict(spec)
    files = data_digests([data])
    return config_hash({**data, "build_version": BUILD_VERSION, **({"data": files} if files else {})})


def build_workload(spec: WorkloadSpec, progress: Progress | None = None) -> Path:
    """Build (or find in the cache) the lookup stream of ``spec``; returns its ``.npz`` path.
    One process builds it while any other wanting it waits: two points building a held-out
    workload at once wrote the same scratch files, and both failed."""
    path = cache_dir() / "workloads" / f"{workload_key(spec)}.npz"
    if path.exists() and path.with_suffix(".json").exists():
        return path
    with one_builder(path.with_suffix(".lock")):
        if not (path.exists() and path.with_suffix(".json").exists()):
            _build(spec, path, progress)
    return path


def _build(spec: WorkloadSpec, path: Path, progress: Progress | None) -> None:
    addresser = Addresser(get_preset(spec.preset))
    if spec.trace is not None:
        sequences, prompt_lengths, domains = _from_trace(spec, path.with_suffix(".trace.parquet"))
    else:
        sequences, prompt_lengths, domains = _from_corpus(spec, addresser, progress)
    if spec.max_tokens is not None:
        sequences, prompt_lengths, domains = _clip(sequences, prompt_lengths, domains, spec.max_tokens)
    if not sequences:
        raise CachelabError(f"workload {spec.source!r} yields no tokens (workload.domains = {spec.domains})")
    # with each lookup's compressed token: a saved stream then holds everything a predictor reads
    stream = LookupStream.from_sequences(addresser, sequences, spec.tokens_per_step, prompt_lengths,
                                         domains).with_tokens(addresser, sequences)
    with replacing(path.with_suffix(".json")) as tmp:  # whole or absent, as the .npz after it
        tmp.write_text(json.dumps({"distinct_rows": distinct_count(stream.keys)}))
    stream.save(path)  # atomic, and last: the .npz exists only once the build is whole


def corpus_texts(spec: WorkloadSpec) -> list[tuple[str, str]]:
    """The (domain, text) of each request a corpus workload replays, in order, as it is tokenized
    (before ``max_tokens``): what a held-out workload must not share with the training one."""
    kwargs = dict(spec.params)
    if spec.path is not None:
        kwargs["path"] = str(resolve_data_path(spec.path, key="workload.path"))
    docs = registry.get(registry.WORKLOADS, spec.source)(**kwargs).documents()
    return [(d.domain, "\n\n".join(d.user_turns)) for d in docs if spec.domains is None or d.domain in spec.domains]


def _from_corpus(spec: WorkloadSpec, addresser: Addresser, progress: Progress | None):
    docs = corpus_texts(spec)
    task = progress.add_task(f"tokenize {spec.source}", total=len(docs)) if progress else None
    sequences = []
    for i in range(0, len(docs), ENCODE_BATCH):
        texts = [text for _, text in docs[i:i + ENCODE_BATCH]]
        sequences += encode(texts, addresser.config.tokenizer, bos=True)
        if progress:
            progress.advance(task, len(texts))
    return sequences, None, [domain for domain, _ in docs]


def _from_trace(spec: WorkloadSpec, out: Path):
    from cachelab.trace import build as trace_workload
    from cachelab.trace.schema import check_tokenizer, read_trace

    trace_workload.build(trace_workload.parse_spec(spec.trace, "workload.trace"), out)
    check_tokenizer(out, get_preset(spec.preset))  # workload.trace's corpus.tokenizer against the layout's
    df = read_trace(out)
    if spec.domains is not None:
        df = df.filter(pl.col("domain").is_in(spec.domains))
    df = df.sort("arrival_s", maintain_order=True)
    sequences = [np.concatenate([p, o]).astype(np.int64) for p, o in
                 zip(df["prompt_ids"].to_numpy(), df["output_ids"].to_numpy())]
    return sequences, df["prompt_len"].to_numpy(), df["domain"].to_list()


def _clip(sequences, prompt_lengths, domains, budget: int):
    """The first ``budget`` tokens (``first_tokens``), with their prompt lengths and domains."""
    sequences = first_tokens(sequences, budget)
    keep = len(sequences)
    prompts = None if prompt_lengths is None else np.minimum(np.asarray(prompt_lengths[:keep]),
                                                             [len(s) for s in sequences])
    return sequences, prompts, list(domains[:keep])


@dataclass(frozen=True)
class Workload:
    """A built workload: its lookup stream, how many distinct rows it touches, and the
    request table it came from when it came from a trace (serving replays need it)."""

    stream: LookupStream
    distinct_rows: int
    requests: pl.DataFrame | None = None


def load_workload(path: str | Path) -> Workload:
    from cachelab.trace.schema import read_trace

    path = Path(path)
    info = json.loads(path.with_suffix(".json").read_text())
    trace = path.with_suffix(".trace.parquet")
    return Workload(LookupStream.load(path), int(info["distinct_rows"]),
                    read_trace(trace) if trace.exists() else None)


def distinct_count(keys: np.ndarray) -> int:
    """Distinct values by sorting (NumPy's hash-based ``unique`` is far slower on 10 M int64)."""
    if keys.size == 0:
        return 0
    ordered = np.sort(keys)
    return int(np.count_nonzero(ordered[1:] != ordered[:-1])) + 1


def workload_stats(workload: Workload, preset: str) -> tuple[dict, list[dict]]:
    """Parent-run metrics and the per-layer, per-order skew table (the addressing study)."""
    cfg = get_preset(preset)
    stream = workload.stream
    layer_idx, rows = split_key(stream.keys)
    order = stream.meta["column"] // cfg.heads + 2
    table = []
    for li, layer in enumerate(stream.layers):
        in_layer = layer_idx == li
        for o in [*range(2, cfg.max_ngram + 1), None]:
            mask = in_layer if o is None else in_layer & (order == o)
            lookups, unique, top = skew(rows[mask])
            table.append({"layer": layer, "order": o, "lookups": lookups, "unique_rows": unique,
                          "top1pct_share": top})
    tokens = stream.num_lookups // (len(stream.layers) * cfg.columns)
    metrics = {"workload.tokens": tokens, "workload.lookups": stream.num_lookups,
               "workload.steps": stream.num_steps, "workload.distinct_rows": workload.distinct_rows,
               "workload.bytes_per_token": len(stream.layers) * cfg.columns * cfg.row_bytes,
               "workload.row_bytes": stream.row_bytes}
    if "request" in stream.meta:
        metrics["workload.requests"] = int(stream.meta["request"].max()) + 1 if stream.num_lookups else 0
    for s in table:
        tag = f"L{s['layer']}" + (f".o{s['order']}" if s["order"] else "")
        metrics[f"addressing.{tag}.unique_rows"] = s["unique_rows"]
        metrics[f"addressing.{tag}.top1pct_share"] = s["top1pct_share"]
    return metrics, table
