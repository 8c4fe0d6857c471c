"""The agentic workload SemiAnalysis ran (InferenceX "AgentX" trace replay), synthesized.

The September V4.1 runs replayed semianalysisai/cc-traces-weka-062126 (coding-agent sessions
with subagents; InferenceX ``resolve_trace_source`` gives it to every ``dsv4*`` model since
#1970, 2026-07-02). It is not on this machine, so requests are drawn from published summaries
instead, and the study says so: median input about 142k tokens and median output 444 (issue
15; a third party's count of the corpus gives 142,016 and 444), a mean output of 1,077 (the corpus
card's token totals), an infinite-prefix-cache token hit ratio of 97% for 062126
itself (InferenceX #2279: "a ~0.97 theoretical ceiling" on the 1M-context corpus, which
``resolve_trace_source`` gave GLM-5.2 as it gives dsv4*; #2231: "96-98% cache hit" on the DSV4
B200 vLLM AgentX sweep with an LMCache store; the no-subagents corpus
cc-traces-weka-no-subagents-051226 gives 85.8%, InferenceX issue #1632; ``prefix_hit`` changes
it), a 3,600 s window after warm-up (InferenceX agentic README: the matrix's default
duration). Output is lognormal with the spread that gives the card's mean; the input is the lognormal
whose draws under the corpus cap have a third party's counted p50 and p90 (their mean lands within 0.8%
of the card's); the think time (tool execution between turns) is an ASSUMPTION: lognormal with a 3 s
median. A request over
AgentX's corpus cap is dropped and its gap joins the next kept request's, as the replay times it;
an output runs to the recorded length, at most the server's window less the prompt. Each request's
cached tokens are the session's earlier context: the hit ratio of its input; the rest is new
(tool output, the last answer). Subagent fan-out (more requests in flight than clients) is
not modelled: each client holds one request.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from cachelab.serving.steady import Workload

# Issue 15's medians, "from the AgentX methodology": no primary source states them (checked 2026-12-07). The
# corpus card's stats.txt holds counts and token totals only (InferenceX build_weka_hf_dataset.py
# _compute_stats); its plots mark the p50 of input, output and think_time over main-agent and subagent requests
# (plot_weka_distributions.py) but are images not read here. Third parties' counts of traces.jsonl (not
# primary) give them over all 98,827 requests: input p50 142,016, output p50 444 (and the 256k variant's input
# p50 88,768, issue 15's other figure); main-agent input p50 254,080, subagent 64,000 (docs/serving.md).
MEDIAN_INPUT = 142_000  # issue 15: AgentX median request input
MEDIAN_OUTPUT = 444  # issue 15: AgentX median request output
# The card of semianalysisai/cc-traces-weka-062126 (huggingface.co/datasets/semianalysisai/cc-traces-weka-062126,
# built 2026-06-21 by build_weka_hf_dataset.py), its "Stats": total_model_requests 98,827 (56,798 main turns,
# 42,029 subagent requests), total_input_tokens 21,635,381,376, total_output_tokens 106,474,498. The replay sends
# each request's recorded output (ignore_eos), so a request's mean output is the corpus's: 1,077.4 tokens.
CORPUS_REQUESTS, CORPUS_INPUT_TOKENS, CORPUS_OUTPUT_TOKENS = 98_827, 21_635_381_376, 106_474_498
# The corpus the V4.1 runs replayed, semianalysis_cc_traces_weka_062126: InferenceX #2279 (commit 78f72af3,
# 2026-07-19), GLM-5.2 B300 AgentX, whose resolve_trace_source gave glm5.2* that corpus as it gives dsv4*: "the
# radix hit rate collapsed from a ~0.97 theoretical ceiling" (aiperf's theoretical prefix-cache hit of the
# replay as sent); #2231 (commit 01e9e73a, 2026-07-21), the DSV4 FP4 B200 vLLM AgentX sweep with an LMCache
# store behind the prefix cache: "96-98% cache hit".
PREFIX_HIT = 0.97
# InferenceX #1632: cc-traces-weka-no-subagents-051226 (assumed until 2026-12-07; the older 042026 gives 0.968)
PREFIX_HIT_NO_SUBAGENTS = 0.858
WINDOW_S = 3600.0  # InferenceX agentic README: 3,600 s default duration
MAX_CONTEXT = 1_048_576  # the V4.1 recipes' --max-model-len (InferenceX dsv41flashssd script)
# What AgentX does with requests longer than that window: it never sends one. The replay sets no
# client cap for agentic runs (InferenceX benchmark_lib.sh unsets MAX_MODEL_LEN "so neither the server
# nor AIPerf applies a cap"); the corpus is built without them: build_weka_hf_dataset.py --base-max-isl
# drops (never truncates) each request whose input exceeds the cap, main-agent turn or subagent request
# alike, and keeps the rest of its session and its timeline. Its help gives 990,016 (the 64-multiple
# nearest 990k) and says no real prompt of the corpus exceeds 1M. The card of 062126 says the same ("no
# request's real prompt actually exceeds 1M"; the rows over the cap are block-count artifacts, dropped per
# request); the DeepSeek-V4 GB300 TRT-LLM AgentX recipes (prefill max_seq_len 990016) agree. Draws above it
# are dropped the same way (0.76% of the lognormal).
BASE_MAX_ISL = 990_016
# The timeline kept means a dropped request's time stays in its session: the filter keeps the survivors'
# recorded start times `t` (`_filter_trace`: "surviving timestamps retain their original relative
# offsets"), and the replay times each turn by the end-to-start delay from them (InferenceX
# benchmark_lib.sh build_replay_cmd: "Source end-to-start delays remain intact"; SemiAnalysisAI/aiperf
# src/aiperf/common/scenario/inferencex_agentx_mvp.py `require_use_end_to_start_delays=True`,
# src/aiperf/dataset/loader/weka_trace.py `_end_to_start_delay_ms`: t_k - (t_{k-1} + api_{k-1}) over
# consecutive surviving turns). So the gap before
# the next kept request is the dropped one's gap, its recorded duration and its own gap: the draws'
# gaps are carried the same way. The recorded duration (the capture's own server time) has no
# published distribution and is not added: those gaps are short by it.
# No output cap either: the scenario locks `ignore_eos` and sends the recorded output as max_tokens (no
# --synthesis-max-osl in build_replay_cmd), and vLLM 0.32 serves a prompt that fits its window with
# max_tokens cut to the window less the prompt (`get_max_tokens` in vllm.entrypoints.serve.utils.api_utils:
# min(max_model_len - input_length, max_tokens, ...)). (An uncited clamp at 32,768 stood here until
# 2026-12-06; it cut 8.5e-6 of the lognormal, no draw of seed 0.)
# The output's spread is the lognormal's whose mean (median x exp(sigma^2 / 2)) is the card's: 1.33 (the 256k
# variant's card and issue 15's median for it, 860 and 376 tokens, give 1.29). The input's cannot be had so: the
# card's mean input, 218,922, is above every lognormal with a 142k median once the draws over the cap are
# dropped (at most 204k, near sigma 1.3); the corpus is a mix of main-agent and subagent requests. The input's
# spread comes from a count instead (INPUT_SIGMA), and the card's mean is what checks it.
# The card's mean is the mean of what the replay sends: its Stats are computed on the corpus as built, after the
# cap's drop (build_weka_hf_dataset.py `_compute_stats` on the filtered traces); each request goes at its
# recorded length; the window takes each lane's requests in trace order from a start drawn over its trace, a
# sample of the corpus that does not select by length; and the window's cut of max_tokens binds on no draw.
OUTPUT_SIGMA = math.sqrt(2.0 * math.log(CORPUS_OUTPUT_TOKENS / CORPUS_REQUESTS / MEDIAN_OUTPUT))
# The think time is the corpus's recorded end-to-start gap; no published distribution of it was found (the
# card's think_time plot is an image; third parties give gaps between turns p50 4.9 s, p90 131.5 s, p99 3,257 s,
# and the recorded think_time field p50 2.3 s, p90 37.5 s, p99 1,392 s, both tails far heavier than this
# lognormal's). docs/serving.md, "The agentic workload", says where we looked.
THINK_MEDIAN_S, THINK_SIGMA = 3.0, 1.0  # ASSUMPTIONS
# The input spread assumed until 2026-12-07, about MEDIAN_INPUT: its kept draws' mean is 15% under the card's. Kept
# as a what-if (studies.workload_range), no longer the model's.
INPUT_SIGMA_ASSUMED = 0.8
# What the third-party counts of traces.jsonl give beyond the medians (docs/serving.md, "What the sources give";
# not primary): the input's p90 from the count whose p50 is MEDIAN_INPUT's (p50 142,016, p90 549,504, p99 863,424,
# over the corpus as built, so over what survives the cap; the model's input spread, INPUT_SIGMA below, is the
# lognormal through them), and the think time's p50 and p90 in two readings: the
# recorded think_time field (2.3 s, 37.5 s) and the gaps between turns (4.9 s, 131.5 s). The replay cuts a session
# tree's idle gap at 300 s (aiperf --trace-idle-gap-cap-seconds, build_replay_cmd's default since InferenceX #2457).
INPUT_P50_COUNTED, INPUT_P90_COUNTED = 142_016, 549_504
THINK_COUNTED = {"think_time field": (2.3, 37.5), "gaps between turns": (4.9, 131.5)}  # reading: (p50 s, p90 s)
IDLE_GAP_CAP_S = 300.0
_Z90 = NormalDist().inv_cdf(0.9)


def kept_quantile(median: float, sigma: float, q: float, cap: float = BASE_MAX_ISL) -> float:
    """The ``q`` quantile of a lognormal's draws that are at most ``cap`` (the others dropped)."""
    n = NormalDist()
    mu = math.log(median)
    return math.exp(mu + sigma * n.inv_cdf(q * n.cdf((math.log(cap) - mu) / sigma)))


def _bisect(f, lo: float, hi: float, rounds: int = 100) -> float:
    for _ in range(rounds):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def input_spread_through(p50: float = INPUT_P50_COUNTED, p90: float = INPUT_P90_COUNTED,
                         cap: float = BASE_MAX_ISL) -> tuple[float, float]:
    """(median, sigma) of the lognormal whose draws under ``cap`` have this p50 and p90: a count of the
    corpus as built counts only what the cap kept, so its percentiles are the kept draws'."""
    def median_for(sigma: float) -> float:
        return math.exp(_bisect(lambda mu: kept_quantile(math.exp(mu), sigma, 0.5, cap) - p50,
                                math.log(p50) - 3, math.log(p50) + 3))

    sigma = _bisect(lambda s: kept_quantile(median_for(s), s, 0.9, cap) - p90, 0.05, 4.0)
    return median_for(sigma), sigma


def capped_mean(p50: float, p90: float, cap: float = IDLE_GAP_CAP_S) -> float:
    """The mean of min(X, ``cap``) for the lognormal X through this p50 and p90: a think time as the replay
    sends it, its idle gap cut at ``cap``."""
    n = NormalDist()
    mu, sigma = math.log(p50), math.log(p90 / p50) / _Z90
    a = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * n.cdf(a - sigma) + cap * (1 - n.cdf(a))


# The model's input spread: the lognormal whose draws under the cap have the count's p50 and p90 (median 162,184,
# sigma 1.297; its kept draws' median is the count's 142,016, MEDIAN_INPUT's). Held out, their mean is 220,685
# against the card's 218,922 (+0.8%) and their p99 918k against the count's 863,424 (+6%). It puts 8.2% of its
# draws over the cap (dropped, their gaps carried), where the card says a small number of the corpus's rows were.
INPUT_MEDIAN_DRAWN, INPUT_SIGMA = input_spread_through()


def carried_gaps(gaps: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The gap before each kept request once the others are dropped: its own plus those of the dropped
    requests since the last kept one (a session's timeline keeps their time); dropped requests after
    the last kept one carry into none."""
    total = np.cumsum(gaps)[kept]
    return np.diff(total, prepend=0.0)


def agentic_workload(samples: int = 4096, seed: int = 0, median_input: float = INPUT_MEDIAN_DRAWN,
                     median_output: float = MEDIAN_OUTPUT, prefix_hit: float = PREFIX_HIT,
                     input_sigma: float = INPUT_SIGMA) -> Workload:
    """``samples`` requests drawn from the published AgentX summaries, less those whose input exceeds
    ``BASE_MAX_ISL`` (dropped, their gaps carried to the next kept request, as AgentX replays its
    corpus); deterministic for a seed."""
    rng = np.random.default_rng(seed)
    inp = np.round(median_input * rng.lognormal(0.0, input_sigma, samples))
    out = np.maximum(1.0, np.round(median_output * rng.lognormal(0.0, OUTPUT_SIGMA, samples)))
    think = THINK_MEDIAN_S * rng.lognormal(0.0, THINK_SIGMA, samples)
    kept = inp <= BASE_MAX_ISL
    inp, out, think = inp[kept], out[kept], carried_gaps(think, kept)
    out = np.minimum(out, MAX_CONTEXT - inp)
    cached = np.floor(inp * prefix_hit)
    return Workload("agentic (AgentX, synthesized)", inp - cached, cached, out, think,
                    "synthesized from AgentX's published medians and hit rate and a third party's count of its input "
                    "p50 and p90; the trace itself was not replayed")
