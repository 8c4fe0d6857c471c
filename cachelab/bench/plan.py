"""What a benchmark sends and when: a trace's prompts, output lengths and send times.

The prompts are the trace's token ids (an OpenAI-compatible ``/v1/completions`` takes a list
of ids as ``prompt``), so the server sees exactly the tokens the simulator addresses. Send
times are the trace's own arrivals, or, with a request rate, ``vllm bench serve``'s rule:
gamma-distributed gaps of shape ``burstiness`` and mean ``1 / rate``, scaled so that the last
request goes out at ``num_requests / rate`` (vllm/benchmarks/serve.py ``get_request``),
drawn from NumPy's legacy generator seeded with ``seed`` as vLLM seeds it (``np.random.seed``),
so with the same ``--seed`` both tools send at the same times.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import polars as pl

from cachelab.errors import CachelabError
from cachelab.trace.schema import has_requests, read_trace


@dataclass(frozen=True)
class BenchPlan:
    """Per request: prompt token ids, output tokens asked for, and send time from the start (s)."""

    prompts: list[np.ndarray]
    output_lens: np.ndarray
    send_offsets: np.ndarray
    source: str = ""
    request_rate: float | None = None  # the rate the send times were drawn at (None: the trace's arrivals)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.array([p.size for p in self.prompts], dtype=np.int64)


MAX_SEED = 2**32 - 1  # NumPy's legacy seeding (np.random.seed, vLLM's) takes 0 .. 2**32 - 1


def check_options(num_prompts: int | None = None, request_rate: float | None = None, burstiness: float = 1.0,
                  seed: int = 0) -> None:
    """Refuse a bad ``--num-prompts``, ``--request-rate``, ``--burstiness`` or ``--seed`` (the
    latter two only with a rate), naming the flag: checked before a trace is read."""
    if num_prompts is not None and num_prompts < 1:
        raise CachelabError(f"--num-prompts must be >= 1, got {num_prompts}")
    if request_rate is None:
        return
    if not request_rate > 0:
        raise CachelabError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise CachelabError(f"--burstiness must be > 0, got {burstiness}")
    if not 0 <= seed <= MAX_SEED:
        raise CachelabError(f"--seed must be in 0..{MAX_SEED} (NumPy's legacy seed, as vLLM seeds it), got {seed}")


def send_offsets(arrival_s: np.ndarray, request_rate: float | None = None, burstiness: float = 1.0,
                 seed: int = 0) -> np.ndarray:
    """Send times from the benchmark's start: the trace's arrivals (``request_rate`` None),
    all at once (``inf``), or vLLM's gamma process at ``request_rate`` per second."""
    check_options(request_rate=request_rate, burstiness=burstiness, seed=seed)
    n = arrival_s.size
    if request_rate is None:
        return arrival_s - arrival_s[0] if n else arrival_s.copy()
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = np.random.RandomState(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if n and times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times


def plan_from_trace(path: str | os.PathLike, *, num_prompts: int | None = None, request_rate: float | None = None,
                    burstiness: float = 1.0, seed: int = 0) -> BenchPlan:
    """The first ``num_prompts`` requests of a cachelab trace (all by default), as a plan; the
    options are checked before the trace is read."""
    check_options(num_prompts, request_rate, burstiness, seed)
    return plan_from_frame(read_trace(path), str(path), num_prompts=num_prompts, request_rate=request_rate,
                           burstiness=burstiness, seed=seed)


def plan_from_frame(df: pl.DataFrame, path: str, *, num_prompts: int | None = None, request_rate: float | None = None,
                    burstiness: float = 1.0, seed: int = 0) -> BenchPlan:
    """The same from a trace already read (``path`` names it in errors)."""
    check_options(num_prompts, request_rate, burstiness, seed)
    if num_prompts is not None:
        if num_prompts > df.height:
            raise CachelabError(f"{path}: --num-prompts {num_prompts} but the trace holds {df.height} requests")
        df = df.head(num_prompts)
    has_requests(df, str(path))
    empty = df.select((pl.col("prompt_ids").list.len() == 0).arg_true().first()).item()
    if empty is not None:
        raise CachelabError(f"{path}: row {empty} has no prompt token ids (an arrival-only trace); give it "
                            "content first: `cachelab trace build --arrivals ... --corpus ...`")
    flat = df["prompt_ids"].explode().to_numpy().astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(df["prompt_ids"].list.len().to_numpy().astype(np.int64))])
    prompts = [flat[bounds[i]:bounds[i + 1]] for i in range(df.height)]
    output_lens = np.maximum(df["output_len"].to_numpy().astype(np.int64), 1)
    offsets = send_offsets(df["arrival_s"].to_numpy(), request_rate, burstiness, seed)
    return BenchPlan(prompts, output_lens, offsets, path, request_rate)
