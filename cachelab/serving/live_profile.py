"""The profile ``cachelab calibrate --out`` writes, and what a live experiment reads back from it.

One TOML file: the probed host as a hardware profile (its CPU in the ``[gpu]`` section, as
``cpu_hardware`` makes it), the fitted efficiency (``[efficiency]``), how the fit charged
attention and the engine CPU share of its runs (``[calibration]``), and the held-out errors as
comments. A value a reader does not expect is named with its file and table, never taken.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, replace
from pathlib import Path

from cachelab.errors import CachelabError
from cachelab.live.config import ModelConfig
from cachelab.paths import replacing
from cachelab.serving.hardware import HardwareProfile, load_profile
from cachelab.serving.latency import Efficiency
from cachelab.serving.live_calibration import FITTED, LIVE_BASE, Calibration, cpu_hardware, model_spec, pearson_text
from cachelab.serving.model_spec import ModelSpec


def write_profile(result: Calibration, hardware: HardwareProfile, threads: int, path: Path) -> Path:
    """The fitted hardware as a TOML profile `load_profile` reads (the CPU in the [gpu] section)
    with the fitted efficiency in its [efficiency] table (``load_calibration`` reads both) and
    the held-out errors as comments above it."""
    hw = cpu_hardware(hardware, threads)
    lines = [f"# Fitted by `cachelab calibrate` on the live runs {result.fit_runs} ({threads} torch thread(s), "
             f"{result.warmup_requests} warm-up request(s) per run left out"
             + (f", steps under {result.fit_min_step_share} of a core left out" if result.fit_min_step_share else "")
             + f"); {result.fit_note}."]
    lines += [f"# held-out {m}: MAPE {e['mape']:.3f}, bias {e['bias']:+.3f}, {pearson_text(e)}"
              for m, e in result.summary.items()]
    lines += [f'name = "{hw.name}-calibrated"', "", "[efficiency]"]
    lines += [f"{k} = {float(getattr(result.efficiency, k))!r}" for k in FITTED]
    lines.append("")
    lines += ["[calibration]", f"masked_attention_block = {result.masked_attention_block}"]  # calibration_spec
    if result.fit_cpu_share is not None:  # what a share-adjusted prediction scales from (fit_cpu_share)
        lines.append(f"fit_engine_cpu_share = {result.fit_cpu_share!r}")
    lines.append("")
    for section, values in ((s, getattr(hw, s)) for s in ("gpu", "host", "cpu", "ssd") if getattr(hw, s) is not None):
        lines.append(f"[{section}]")
        lines += [f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}" for k, v in asdict(values).items()]
        lines.append("")
    with replacing(path) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    return Path(path)


def load_calibration(path: str | Path) -> tuple[HardwareProfile, Efficiency]:
    """A `cachelab calibrate --out` file: its hardware profile and its fitted efficiency."""
    hw = load_profile(path)
    if hw.gpu is None or hw.host is None:
        raise CachelabError(f"{path}: no [gpu] or [host] section; write the file with `cachelab calibrate --out`")
    table = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("efficiency")
    if not isinstance(table, dict):
        raise CachelabError(f"{path}: no [efficiency] table; write the file with `cachelab calibrate --out`")
    unknown = sorted(set(table) - set(FITTED))
    if unknown:
        raise CachelabError(f"{path}: [efficiency] unknown key(s) {unknown}; allowed: {list(FITTED)}")
    bad = [k for k, v in table.items() if isinstance(v, bool) or not isinstance(v, (int, float))
           or not 0 <= v < float("inf")]  # TOML spells nan and inf
    if bad:
        raise CachelabError(f"{path}: [efficiency] {bad[0]} must be a non-negative number, got {table[bad[0]]!r}")
    return hw, replace(LIVE_BASE, **{k: float(v) for k, v in table.items()})


def calibration_spec(path: str | Path, cfg: ModelConfig) -> ModelSpec:
    """The live spec a `cachelab calibrate --out` file's efficiency was fitted with: its attention
    charged as recorded in ``[calibration] masked_attention_block`` (a file written before that
    was recorded was fitted on the causal charging, 0)."""
    value = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("calibration", {}).get("masked_attention_block", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CachelabError(f"{path}: [calibration] masked_attention_block must be a block size in tokens (0: causal), "
                            f"got {value!r}")
    return model_spec(cfg, value)


def fit_cpu_share(path: str | Path) -> float | None:
    """The engine CPU share of the fit runs a `cachelab calibrate --out` file records (None in a
    file written before it was recorded)."""
    value = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("calibration", {}).get("fit_engine_cpu_share")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1.5):
        raise CachelabError(f"{path}: [calibration] fit_engine_cpu_share must be a share of a core, got {value!r}")
    return None if value is None else float(value)
