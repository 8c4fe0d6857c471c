"""Serving metrics exactly as ``vllm bench serve`` and InferenceX define them.

vLLM (benchmarks/serve.py): TTFT = first token - request send; E2EL = last token - send;
TPOT = (E2EL - TTFT) / (output tokens - 1), over requests with more than one output token;
ITL = every gap between consecutive tokens (live: streamed chunks) of a request, pooled over
requests; percentiles by linear interpolation (NumPy's default); throughputs over the
benchmark duration (first send to last completion); failed requests are counted, never
averaged; goodput = requests per second that meet every SLO given. A statistic of no values
(only one-token answers: no TPOT, no ITL) is NaN under each of its keys, so a result always
has the same keys (vLLM prints 0 there). InferenceX
(utils/process_result.py): throughput per GPU = total (input + output) tokens/s / GPUs;
interactivity = 1000 / median TPOT_ms, P90 interactivity = 1000 / P90 TPOT_ms (never ITL: an
ITL is a gap between chunks, and an MTP chunk carries several tokens); cost per million tokens
= $/GPU-hour / (tok/s/GPU x 3600 / 1e6); tokens per dollar its inverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachelab.errors import CachelabError

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTimes:
    """Per request: send, first token and end times (s), token counts, and every token's time
    (CSR: ``token_times[token_offsets[i]:token_offsets[i+1]]``)."""

    send_s: np.ndarray
    first_token_s: np.ndarray
    end_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    token_times: np.ndarray
    token_offsets: np.ndarray


def stats_ms(name: str, values_ms: np.ndarray, percentiles=PERCENTILES) -> dict:
    """``vllm bench serve``'s keys for one metric in milliseconds: mean, median, std and each percentile."""
    if values_ms.size == 0:
        return {f"{stat}_{name}_ms": float("nan") for stat in ("mean", "median", "std", *(f"p{p}" for p in percentiles))}
    out = {f"mean_{name}_ms": float(values_ms.mean()), f"median_{name}_ms": float(np.median(values_ms)),
           f"std_{name}_ms": float(values_ms.std())}
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (SLOs in ms, as
    ``vllm bench serve --goodput`` takes them), with an error naming the bad item."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = str(item).partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise CachelabError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise CachelabError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0:
            raise CachelabError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def request_metrics(times: RequestTimes, *, failed: int = 0, duration: float | None = None,
                    goodput: dict[str, float] | None = None, percentiles=PERCENTILES) -> dict:
    """``vllm bench serve``'s result over the completed requests in ``times``, its key names.

    ``duration`` is the benchmark's wall time (vLLM: first send to the last answer, failures
    included); by default the span of the completed requests. ``goodput``: SLOs in ms by
    metric (``ttft``, ``tpot``, ``e2el``); a request is good when it meets every one (TPOT
    counts as 0 for a one-token answer, as vLLM does). ``request_goodput`` is None without SLOs.
    """
    n = times.send_s.size
    if duration is None:
        duration = float(times.end_s.max() - times.send_s.min()) if n else 0.0
    ttft = (times.first_token_s - times.send_s) * 1e3
    e2el = (times.end_s - times.send_s) * 1e3
    multi = times.output_tokens > 1
    all_tpot = np.zeros(n)
    all_tpot[multi] = (e2el[multi] - ttft[multi]) / (times.output_tokens[multi] - 1)
    owner = np.repeat(np.arange(n), np.diff(times.token_offsets))
    itl = np.diff(times.token_times)[owner[1:] == owner[:-1]] * 1e3  # gaps within a request only
    total_in, total_out = int(times.prompt_tokens.sum()), int(times.output_tokens.sum())
    rate = (lambda x: x / duration) if duration else (lambda x: 0.0)
    good = None
    if goodput:
        values = {"ttft": ttft, "tpot": all_tpot, "e2el": e2el}
        ok = np.ones(n, dtype=bool)
        for name, slo_ms in goodput.items():
            ok &= values[name] <= slo_ms
        good = rate(int(ok.sum()))
    out = {"duration": duration, "completed": n, "failed": int(failed), "total_input_tokens": total_in,
           "total_output_tokens": total_out, "request_throughput": rate(n), "request_goodput": good,
           "output_throughput": rate(total_out), "total_token_throughput": rate(total_in + total_out)}
    for name, values in (("ttft", ttft), ("tpot", all_tpot[multi]), ("itl", itl), ("e2el", e2el)):
        out.update(stats_ms(name, values, percentiles))
    return out


def peak_per_second(times: RequestTimes) -> dict:
    """``vllm bench serve``'s ``max_output_tokens_per_s`` and ``max_concurrent_requests``: in
    one-second buckets from the earliest send of a completed request, the most token arrivals
    (streamed chunks, as vLLM counts them) in one bucket, and the most requests active in one (a
    request is active in every bucket from its send's to its end's). 0 without a request."""
    if times.send_s.size == 0:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = times.send_s.min()
    n = int(np.ceil(times.end_s.max() - t0)) + 1
    tokens = np.bincount((times.token_times - t0).astype(np.int64), minlength=n)[:n]
    active = np.zeros(n + 1, dtype=np.int64)
    np.add.at(active, (times.send_s - t0).astype(np.int64), 1)
    np.add.at(active, (times.end_s - t0).astype(np.int64) + 1, -1)
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(np.cumsum(active).max())}


def summarize(times: RequestTimes, num_gpus: int, usd_per_gpu_hour: float | None,
              percentiles=PERCENTILES, goodput: dict[str, float] | None = None) -> dict:
    """The vLLM bench serve result dict (``goodput``: its SLOs, see ``request_metrics``) plus
    InferenceX's per-GPU and cost figures (NaN where the hardware has no price: the keys are
    always there)."""
    out = request_metrics(times, percentiles=percentiles, goodput=goodput)
    out["duration_s"] = out["duration"]
    per_gpu = out["total_token_throughput"] / num_gpus
    out["num_gpus"] = num_gpus
    out["tokens_per_s_per_gpu"] = per_gpu
    out["output_tokens_per_s_per_gpu"] = out["output_throughput"] / num_gpus
    for key, stat in (("interactivity", "median"), ("p90_interactivity", "p90")):
        tpot = out.get(f"{stat}_tpot_ms", float("nan"))
        out[key] = 1000.0 / tpot if tpot and np.isfinite(tpot) else float("nan")
    out["usd_per_gpu_hour"] = out["cost_per_million_tokens"] = out["tokens_per_dollar"] = float("nan")  # no price
    if usd_per_gpu_hour:
        out["usd_per_gpu_hour"] = usd_per_gpu_hour
        out["cost_per_million_tokens"] = usd_per_gpu_hour / (per_gpu * 3600 / 1e6) if per_gpu else float("inf")
        out["tokens_per_dollar"] = per_gpu * 3600 / usd_per_gpu_hour
    return out
