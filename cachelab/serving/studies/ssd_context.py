"""An SSD host cost that grows with the context a step holds, across its plausible range (a what-if).

The PR body's SSD arm pays 2.1-3.2 ms a token on the agentic trace at 16-64 clients and none on the
8k/1k pair (``ssd_penalty``); the model's SSD host terms (the floor, the fetch parts) are the same at
8k and 190k tokens of context, so they cannot give both. No source found names a host cost of the
SSD path that grows with context: the PR body calls its offset "the per-step host round trip" that
"does not scale with batch size", and the patch's comments add none. So the term is not in the model
(``Efficiency.piecewise_context_token_s`` and ``piecewise_step_context_s`` are 0) and this what-if shows
what it would move, in two forms: a piecewise step pays so much per token of context each of its
sequences holds (growing with the batch), or per token of its mean context (not growing with it),
serialized with the step. At each value the SSD floor is refitted on the PR body's sweep at 1-8 clients
(the term is in those steps too), and the B200 keys, the held-out penalty per output token and the
held-out 8k/1k pair's SSD arm are read under it. The B300 keys have no piecewise arm and do not move.
"""

from __future__ import annotations

from dataclasses import replace

import polars as pl

from cachelab.serving.calibration import predict, v41_script_points
from cachelab.serving.latency import Efficiency
from cachelab.serving.steady import Workload
from cachelab.serving.studies.semianalysis import KEY_CONCURRENCIES, analyse, with_fitted_piecewise
from cachelab.serving.studies.ssd_penalty import penalty_by_concurrency
from cachelab.serving.studies.sweep import CONFIGS, run_points

# Per form, the Efficiency field and its values (seconds of host time per token of context): per token each
# sequence holds (it grows with the batch too), up to past the ~6 ns at which the held-out agentic penalty is
# reached (9.1 ms a verify step over ~1.5 M tokens at 16 clients); per token of the step's mean context (it does
# not grow with the batch), up to past the ~48 ns at which 9.1 ms is reached at ~190k tokens.
FORMS = {"per_context_token": ("piecewise_context_token_s", (2e-9, 4e-9, 6e-9, 8e-9)),
         "per_mean_context_token": ("piecewise_step_context_s", (15e-9, 30e-9, 45e-9, 60e-9))}


def _ssd_arm_under(workload: Workload, ssd_eff: Efficiency, dram: list[dict], concurrencies) -> dict:
    """The SSD floor refitted with ``ssd_eff``'s context cost, then the B200 keys (the DRAM arm's ``dram``
    points beside it), the PR body's sweep and penalty per output token, and the 8k/1k pair's SSD arm."""
    ssd_eff = with_fitted_piecewise(ssd_eff, workload)
    ssd = [c for c in CONFIGS if c[0] == "B200" and c[2] == "ssd-mmap"]
    points = pl.DataFrame(dram + run_points(workload, ssd_eff, ssd, concurrencies), infer_schema_length=None)
    keys, penalty = analyse(points), penalty_by_concurrency(points)
    pair = {p.placement: p for p in v41_script_points()}["ssd-mmap"]
    v41 = predict(pair, ssd_eff)["tokens_per_s_per_gpu"]  # the pair's SSD arm runs its inline build
    return {"piecewise_layer_s": ssd_eff.piecewise_layer_s,
            **{k: keys[k] for k in ("b200_dram_tokens_per_dollar", "b200_ssd_tokens_per_dollar", "b200_dram_over_ssd",
                                    "b200_ssd_points_dominated", "b200_dram_p90_interactivity_wins_every_pair")},
            "b200_tp4_disk_over_uva_held_out_mape": keys["b200_tp4_disk_over_uva"]["held_out_mape"],
            "penalty_ms_per_output_token": {c: v["model"] for c, v in penalty["by_concurrency"].items()},
            "penalty_ms_per_output_token_published": {c: v["published"] for c, v in penalty["by_concurrency"].items()},
            "penalty_held_out_mean_ms": penalty["held_out_mean"]["model"],
            "v41_8k1k_ssd_tokens_per_s_per_gpu": v41, "v41_8k1k_ssd_error": v41 / pair.measured["tokens_per_s_per_gpu"] - 1}


def context_term_range(workload: Workload, eff: Efficiency, forms=FORMS, concurrencies=KEY_CONCURRENCIES) -> dict:
    """``_ssd_arm_under`` without the term (``none``), then per form and value (ns a token of context)."""
    dram = run_points(workload, eff, [c for c in CONFIGS if c[0] == "B200" and c[2] == "dram-uva"], concurrencies)
    out = {"none": _ssd_arm_under(workload, eff, dram, concurrencies)}
    for form, (name, values) in forms.items():
        out[form] = {"parameter": name, "by_ns": {f"{v * 1e9:g}": _ssd_arm_under(
            workload, replace(eff, **{name: v}), dram, concurrencies) for v in values}}
    return {**out, "note": "a what-if: no source names a host cost of the SSD path that grows with context"}
