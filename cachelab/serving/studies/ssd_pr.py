"""The SSD patch's PR body, the one source of the SSD arm's host floor: its published agentic
sweep (each arm's throughput and P90 TTFT per concurrency) and its TPOT offset.

Apart from ``semianalysis`` for the reason ``sweep`` is.
"""

from __future__ import annotations

from cachelab.serving.studies.sweep import TTFT, Y

# The SSD patch's PR body (SemiAnalysisAI/InferenceX analysis/ssd_offload/VLLM-PR-BODY.md): B200 TP4,
# DeepSeek-V4.1-Flash, CUDA graphs; the agentic trace sweep with the tables on disk (mmap, PIECEWISE
# graphs) against the published pinned-DRAM UVA baseline of the same recipe, total tok/s per
# concurrency, and "Median TPOT carries a near-constant offset of about 2.6 ms per token that does
# not scale with batch size, so it dominates where steps are short and vanishes where they are not.
# The offset is the per-step host round trip rather than device I/O".
SSD_PR_SOURCE = "https://github.com/SemiAnalysisAI/InferenceX/blob/main/analysis/ssd_offload/VLLM-PR-BODY.md"
SSD_PR_TPOT_OFFSET_S = 2.6e-3
SSD_PR_SWEEP = {1: (19_338, 12_272), 2: (25_059, 14_587), 4: (34_897, 24_453), 8: (61_151, 47_598),
                16: (112_212, 101_218), 32: (226_006, 207_582), 64: (348_969, 330_709),
                96: (222_396, 301_346), 128: (76_717, 112_567)}  # concurrency: (UVA baseline, disk) tok/s
SSD_PR_P90_TTFT_MS = {1: (958, 1_205), 2: (558, 695), 4: (533, 548), 8: (477, 497), 16: (551, 598), 32: (784, 685),
                      64: (1_325, 1_092)}  # the same sweep's P90 TTFT, ms (its 96-128 clients: 5-291 s, not steady)
# past 64 clients both arms collapse (P90 TTFT 18-291 s: admission queues the steady state does not hold)
SSD_PR_STEADY = (1, 2, 4, 8, 16, 32, 64)
# where the PR body says the offset "dominates" (short steps): the floor is fitted on these, the rest held out
SSD_PR_FIT = (1, 2, 4, 8)
SSD_PR_PUBLISHED = {Y: SSD_PR_SWEEP, TTFT: SSD_PR_P90_TTFT_MS}  # metric: {concurrency: (UVA, disk)}
