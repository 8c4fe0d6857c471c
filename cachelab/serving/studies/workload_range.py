"""The issue's keys across the plausible range of the agentic workload's unsourced think time, and under
the input spread it assumed before a count gave one.

No primary source gives the replayed corpus's think time or the spread of its request inputs
(docs/serving.md, "What the sources give"); third parties' counts of its traces.jsonl give their
p50 and p90 (``agentic.THINK_COUNTED``, ``agentic.INPUT_P90_COUNTED``). The steady state reads
the think time through its mean only, so each reading is a mean: the lognormal through its p50 and
p90, cut at the replay's 300 s idle-gap cap (``agentic.capped_mean``). The model's input spread is the
count's (``agentic.INPUT_SIGMA``); the one assumed before it (``agentic.INPUT_SIGMA_ASSUMED`` about
``agentic.MEDIAN_INPUT``) runs with its think times scaled to the synthesized mean so that only the
spread changes. Each variant refits the SSD floor on the PR body's sweep (its throughput ratios
are of whole cycles, thinking included), then reads every key over the published concurrencies.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from cachelab.serving.agentic import (IDLE_GAP_CAP_S, INPUT_SIGMA_ASSUMED, MEDIAN_INPUT, THINK_COUNTED,
                                      agentic_workload, capped_mean)
from cachelab.serving.latency import Efficiency
from cachelab.serving.steady import Workload
from cachelab.serving.studies.semianalysis import KEY_CONCURRENCIES, analyse, with_fitted_piecewise
from cachelab.serving.studies.sweep import CONFIGS, run_points

KEYS = ("b200_dram_tokens_per_dollar", "b200_ssd_tokens_per_dollar", "b200_dram_over_ssd", "b200_ssd_points_dominated",
        "b200_dram_p90_interactivity_wins_every_pair", "b300_tp2_table_in_hbm_fits", "b300_tp2_dram_gain_max",
        "b300_tp2_dram_gain_at_p90_interactivity", "b300_tp4_hbm_vs_dram_max_diff")


# think-time means between the synthesized one (5.4 s) and the counted readings' (16.7 and 38.5 s): the SSD
# floor's fit, and with it DRAM over SSD, moves fastest there
THINK_GRID_S = (7.5, 10.0)


def variants(prefix_hit: float) -> dict[str, Workload]:
    """The synthesized workload, and it with think-time means from ``THINK_GRID_S`` and each counted
    reading's capped mean, and with the input spread assumed before the count's (its think times at the
    synthesized mean)."""
    base = agentic_workload(prefix_hit=prefix_hit)
    out = {"synthesized": base}
    for mean in THINK_GRID_S:
        out[f"think time: mean {mean:g} s"] = base.with_think_mean(mean)
    for reading, (p50, p90) in THINK_COUNTED.items():
        out[f"think time: {reading} (p50 {p50} s, p90 {p90} s)"] = base.with_think_mean(capped_mean(p50, p90))
    assumed = agentic_workload(prefix_hit=prefix_hit, median_input=MEDIAN_INPUT, input_sigma=INPUT_SIGMA_ASSUMED)
    out[f"input spread: sigma {INPUT_SIGMA_ASSUMED:g} about {MEDIAN_INPUT:,} (assumed until 2026-12-07)"] = (
        assumed.with_think_mean(float(base.think_s.mean())))
    return out


def keys_under(workload: Workload, eff: Efficiency, concurrencies=KEY_CONCURRENCIES) -> dict:
    """The issue's keys (``KEYS``) for this workload, the SSD floor refitted on it, with what the
    workload and the floor were."""
    refit = with_fitted_piecewise(eff, workload)
    keys = analyse(pl.DataFrame(run_points(workload, refit, CONFIGS, concurrencies), infer_schema_length=None))
    inputs = workload.new_tokens + workload.cached_tokens
    return {"mean_think_s": float(workload.think_s.mean()), "mean_input_tokens": float(inputs.mean()),
            "median_input_tokens": float(np.median(inputs)), "piecewise_layer_s": refit.piecewise_layer_s,
            **{k: keys[k] for k in KEYS}}


def workload_range(eff: Efficiency, prefix_hit: float, concurrencies=KEY_CONCURRENCIES) -> dict:
    """``keys_under`` for every variant (``variants``)."""
    return {"by_variant": {name: keys_under(wl, eff, concurrencies) for name, wl in variants(prefix_hit).items()},
            "idle_gap_cap_s": IDLE_GAP_CAP_S,
            "source": "third parties' counts of cc-traces-weka-062126's traces.jsonl (docs/serving.md)"}
