"""The live engine's step log (``cachelab serve --step-log``), read and checked for the fit.

A run is a directory of ``steps-*.parquet`` parts, one row a step: its times (start, duration,
compute, Engram stall) and, per request it served, the positions it computed and the prompt's
length. ``find_runs`` loads every run under a folder; a part that cannot be read, a column that
is missing or not in seconds, a run with no steps or with two servers' parts (its step numbers
repeat), or a step the fit would read as NaN or nonsense is an error naming the run, the step,
the column and the value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from cachelab.errors import CachelabError

STEP_COLUMNS = ("step", "start_s", "step_s", "compute_s", "stall_s", "requests", "starts", "stops", "num_prompt")
# durations the fit reads where a log has them (the operator clock, the learned row cache's scorer, the
# engine thread's CPU); a step without one (null) is a log without it
OPTIONAL_TIMES = ("attention_s", "gemm_s", "scorer_s", "thread_cpu_s")


def load_run(directory: Path) -> pl.DataFrame:
    parts = sorted(Path(directory).glob("steps-*.parquet"))
    if not parts:
        raise CachelabError(f"{directory}: no steps-*.parquet (a `cachelab serve --step-log` directory)")
    frame = pl.concat([_read_part(p).with_columns(pl.lit(p.name).alias("_part")) for p in parts],
                      how="diagonal_relaxed").sort("start_s")
    missing = [c for c in STEP_COLUMNS if c not in frame.columns]
    if missing:
        raise CachelabError(f"{directory}: the step log lacks {missing} (written by an older `cachelab serve`)")
    if not frame.height:
        raise CachelabError(f"{directory}: the step log has no steps ({', '.join(p.name for p in parts)} empty)")
    _check_one_server(frame, directory)
    _check_steps(frame, directory)
    return frame.drop("_part")


def _check_one_server(frame: pl.DataFrame, directory: Path) -> None:
    """Refuse a directory two servers wrote (`cachelab serve --step-log` again on it appends
    parts): step numbers and request ids restart per server, and read as one run the two
    runs' requests merge (a TPOT spanning the gap between the runs)."""
    repeated = frame.filter(pl.col("step").is_duplicated())
    if repeated.height:
        step = repeated["step"][0]
        parts = sorted(set(repeated.filter(pl.col("step") == step)["_part"]))
        raise CachelabError(f"{directory}: step {step} is in {' and '.join(parts)}: the parts of more than one "
                            "`cachelab serve` run (step numbers and request ids restart per server); give each run "
                            "its own --step-log directory")


def _check_steps(frame: pl.DataFrame, directory: Path) -> None:
    """Refuse a step log the fit would read as NaN or nonsense, naming the step, column and value:
    times finite (durations >= 0, ``OPTIONAL_TIMES`` too where logged), one start, stop and prompt length per request of a step, and
    0 <= start <= stop, prompt >= 1."""
    def refuse(i: int, column: str, value, rule: str) -> CachelabError:
        return CachelabError(f"{directory}: step {frame['step'][i]} has {column} = {value!r}; {rule}")

    for col in ("start_s", "step_s", "compute_s", "stall_s", *(c for c in OPTIONAL_TIMES if c in frame.columns)):
        if not frame[col].dtype.is_numeric():
            raise CachelabError(f"{directory}: step-log column {col} holds {frame[col].dtype}, not seconds")
        values = frame[col].cast(pl.Float64).fill_null(0.0 if col in OPTIONAL_TIMES else float("nan")).to_numpy()
        bad = ~np.isfinite(values) | ((values < 0) if col != "start_s" else False)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise refuse(i, col, float(values[i]), "a step's times must be finite, its durations >= 0")
    lists = ("requests", "starts", "stops", "num_prompt")
    lengths = frame.select(pl.col(c).list.len() for c in lists).to_numpy()
    uneven = np.flatnonzero((lengths != lengths[:, :1]).any(axis=1))
    if uneven.size:
        i = int(uneven[0])
        raise refuse(i, "requests/starts/stops/num_prompt lengths", lengths[i].tolist(), "one each per request")
    owner = np.repeat(np.arange(frame.height), lengths[:, 0])  # the step of each request's entry
    starts, stops, prompt = (frame[c].explode().drop_nulls().to_numpy() for c in ("starts", "stops", "num_prompt"))
    for col, bad in (("starts", starts < 0), ("stops", stops < starts), ("num_prompt", prompt < 1)):
        if bad.any():
            i = int(owner[np.flatnonzero(bad)[0]])
            raise refuse(i, col, frame[col][i].to_list(), "need 0 <= start <= stop and a prompt of >= 1 token")


def _read_part(path: Path) -> pl.DataFrame:
    try:
        return pl.read_parquet(path)
    except Exception as exc:  # polars raises several error types for a damaged file
        raise CachelabError(f"{path}: not a readable step-log part ({type(exc).__name__}: {str(exc)[:160]}); "
                            "remove it or rerun `cachelab serve --step-log`") from None


def find_runs(root: Path) -> dict[str, pl.DataFrame]:
    """Every step-log directory under ``root`` (``root`` itself if it is one), by name."""
    root = Path(root)
    if not root.is_dir():
        raise CachelabError(f"--step-log {root}: not a directory")
    dirs = sorted({p.parent for p in root.rglob("steps-*.parquet")})
    if not dirs:
        raise CachelabError(f"--step-log {root}: no steps-*.parquet under it")
    return {str(d.relative_to(root)) if d != root else root.name: load_run(d) for d in dirs}
