"""The SemiAnalysis study's sweep: its configurations, each one's deployment, and the run of
(configuration, concurrency) points in the steady state.

Apart from ``semianalysis`` so that the study and its SSD readings (``ssd_penalty``,
``ssd_floor``) import it at the top: none imports a module that imports it back.
"""

from __future__ import annotations

from collections.abc import Callable

from cachelab.errors import CachelabError
from cachelab.serving.calibration import batched_tokens
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Efficiency, LatencyModel
from cachelab.serving.model_spec import ModelSpec, load_model
from cachelab.serving.steady import Deployment, NoSteadyState, SteadyState, Workload

TARGET = 125.0  # tok/s/user, P90 interactivity
X = "p90_interactivity"
Y = "tokens_per_s_per_gpu"
CONCURRENCIES = (1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128, 192, 256, 384, 512)
OS_SHARE = 0.1  # ASSUMPTION: host DRAM kept for the OS, the server process and its buffers
CONFIGS = (("B200", 4, "dram-uva"), ("B200", 8, "dram-uva"), ("B200", 4, "ssd-mmap"), ("B200", 8, "ssd-mmap"),
           ("B300", 2, "dram-uva"), ("B300", 4, "dram-uva"), ("B300", 4, "hbm"), ("B300", 2, "hbm"))
MODEL = "deepseek-v4.1-flash"
TTFT = "p90_ttft_ms"


def deployment(hardware: str, tp: int, placement: str, eff: Efficiency, model: str = MODEL,
               spec: ModelSpec | None = None, page_cache_bytes: float | None = None,
               max_num_batched_tokens: int | None = None) -> Deployment:
    """One replica with its V4.1 vLLM arm's host-memory plan and token budget per step (16384,
    ``calibration.batched_tokens``; raises CachelabError if it does not fit); ``spec``,
    ``page_cache_bytes`` and ``max_num_batched_tokens`` replace the named model, the planned page
    cache and the budget (what-ifs).

    No KV offload pool: every V4.1 vLLM script the article's arms ran calls
    ``require_agentic_kv_offload_none`` (InferenceX benchmarks/single_node/agentic/
    dsv41flash_fp4_vllm_mtp.sh, the B200 DRAM-UVA arm; dsv41flash_fp4_b300_vllm_mtp.sh; and the SSD
    recipe dsv41flashssd_fp4_vllm_mtp.sh without a KV_OFFLOAD_BACKEND), so the prefix cache is the
    KV in HBM alone. (The study gave every arm the agentic matrix's 80% of host DRAM as a KV pool
    before; those scripts refuse one.)"""
    spec = spec or load_model(model)
    hw = load_profile(hardware)
    budget = max_num_batched_tokens or batched_tokens(model, "vllm")
    lat = LatencyModel(spec, hw, tp, placement, efficiency=eff, max_num_batched_tokens=budget)
    host = hw.host.dram_bytes * tp
    # The page cache belongs to the node, not the replica: every replica on it maps the same
    # table file, so a page one faults in serves all (8 / TP replicas per node).
    replicas = hw.gpu.nvlink_domain // tp
    page_cache = replicas * host * (1 - OS_SHARE) if placement == "ssd-mmap" else None
    if page_cache is not None and page_cache_bytes is not None:
        page_cache = page_cache_bytes
    return Deployment(lat, budget, page_cache_bytes=page_cache)


def decode_context(workload: Workload) -> float:
    """A decoding sequence's mean context: its prompt (new and cached) and half its output."""
    return float((workload.new_tokens + workload.cached_tokens).mean() + workload.output_tokens.mean() / 2)


def run_points(workload: Workload, eff: Efficiency, configs=CONFIGS, concurrencies=CONCURRENCIES,
               on_point: Callable[[dict], None] | None = None, **what_if) -> list[dict]:
    """Every (config, concurrency) point; ``on_point`` sees each as it finishes. A config that
    does not fit is one row with ``fits`` False and the reason; so is a point with no steady state
    (``NoSteadyState``), which no front or key then reads. ``what_if``: ``deployment``'s
    ``spec``, ``page_cache_bytes`` or ``max_num_batched_tokens``."""
    rows = []
    for hardware, tp, placement in configs:
        base = {"hardware": hardware, "tp": tp, "placement": placement}
        try:
            dep = deployment(hardware, tp, placement, eff, **what_if)
            model = SteadyState(dep, workload)
        except CachelabError as exc:
            row = {**base, "fits": False, "reason": str(exc)}
            rows.append(row)
            if on_point:
                on_point(row)
            continue
        for c in concurrencies:
            try:
                m = model.solve(int(c))
            except NoSteadyState as exc:  # a row with its reason, off every front, as a config that does not fit
                row = {**base, "concurrency": int(c), "fits": False, "reason": str(exc)}
            else:
                row = {**base, "fits": True, "reason": "", **m, "kv_tokens": dep.latency.plan.kv_tokens,
                       "kv_offload_gb": dep.kv_offload_bytes / 1e9,
                       "page_cache_gb": (dep.page_cache_bytes or 0.0) / 1e9}
            rows.append(row)
            if on_point:
                on_point(row)
    return rows
