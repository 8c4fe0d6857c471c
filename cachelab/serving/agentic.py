"""The agentic workload SemiAnalysis ran (InferenceX "AgentX" trace replay), synthesized.

The September V4.1 runs replayed semianalysisai/cc-traces-weka-062126 (coding-agent sessions
with subagents; InferenceX ``resolve_trace_source`` gives it to every ``dsv4*`` model since
#1970, 2026-07-02). It is not on this machine, so requests are drawn from published summaries
instead, and the study says so: median input about 142k tokens and median output 444 (issue
15, from the AgentX methodology), an infinite-prefix-cache token hit ratio of 85.8% (InferenceX
issue #1632, for the no-subagents corpus cc-traces-weka-no-subagents-051226; the older
cc-traces-weka-042026 gives 96.8% and, by that issue and InferenceX PR #1201, inflates hit
rates; no hit ratio of 062126 is published, so this is an ASSUMPTION and ``prefix_hit``
changes it), a 3,600 s window after warm-up (InferenceX agentic README: the matrix's default
duration). Spreads and think times are ASSUMPTIONS: input and output lognormal (sigma 0.8 and
1.0), think time (tool execution between turns) lognormal with a 3 s median. Each request's
cached tokens are the session's earlier context: the hit ratio of its input; the rest is new
(tool output, the last answer). Subagent fan-out (more requests in flight than clients) is
not modelled: each client holds one request.
"""

from __future__ import annotations

import numpy as np

from cachelab.serving.steady import Workload

MEDIAN_INPUT = 142_000  # issue 15: AgentX median request input
MEDIAN_OUTPUT = 444  # issue 15: AgentX median request output
PREFIX_HIT = 0.858  # InferenceX #1632: cc-traces-weka-no-subagents-051226, full theoretical token hit rate
PREFIX_HIT_V01 = 0.968  # InferenceX #1632: the older cc-traces-weka-042026
WINDOW_S = 3600.0  # InferenceX agentic README: 3,600 s default duration
MAX_CONTEXT = 1_048_576  # the V4.1 recipes' --max-model-len (InferenceX dsv41flashssd script)
# What AgentX does with requests longer than that window: it never sends one. The replay sets no
# client cap for agentic runs (InferenceX benchmark_lib.sh unsets MAX_MODEL_LEN "so neither the server
# nor AIPerf applies a cap"); the corpus is built without them: build_weka_hf_dataset.py --base-max-isl
# drops (never truncates) each request whose input exceeds the cap, main-agent turn or subagent request
# alike, and keeps the rest of its session and its timeline. Its help gives 990,016 (the 64-multiple
# nearest 990k) and says no real prompt of the corpus exceeds 1M. The card of 062126 was not read here;
# the DeepSeek-V4 GB300 TRT-LLM AgentX recipes (prefill max_seq_len 990016) and a reading of 062126
# ("contexts up to 990k") agree. Draws above it are dropped the same way (0.76% of the lognormal); an
# output is at most 32,768, so no kept request reaches MAX_CONTEXT and vLLM's length check refuses none.
BASE_MAX_ISL = 990_016
INPUT_SIGMA, OUTPUT_SIGMA, THINK_MEDIAN_S, THINK_SIGMA = 0.8, 1.0, 3.0, 1.0  # ASSUMPTIONS


def agentic_workload(samples: int = 4096, seed: int = 0, median_input: float = MEDIAN_INPUT,
                     median_output: float = MEDIAN_OUTPUT, prefix_hit: float = PREFIX_HIT) -> Workload:
    """``samples`` requests drawn from the published AgentX summaries, less those whose input exceeds
    ``BASE_MAX_ISL`` (dropped, as the corpus drops them); deterministic for a seed."""
    rng = np.random.default_rng(seed)
    inp = np.round(median_input * rng.lognormal(0.0, INPUT_SIGMA, samples))
    out = np.maximum(1.0, np.minimum(np.round(median_output * rng.lognormal(0.0, OUTPUT_SIGMA, samples)), 32_768))
    think = THINK_MEDIAN_S * rng.lognormal(0.0, THINK_SIGMA, samples)
    kept = inp <= BASE_MAX_ISL
    inp, out, think = inp[kept], out[kept], think[kept]
    cached = np.floor(inp * prefix_hit)
    return Workload("agentic (AgentX, synthesized)", inp - cached, cached, out, think,
                    "synthesized from AgentX's published medians and hit rate; the trace itself was not replayed")
