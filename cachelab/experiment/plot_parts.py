"""What the report's line plots share: series, their order and labels, and axis styling.

Apart from ``report_plots`` so that the per-kind plot modules (``report_live``) and it both
import it without importing each other.
"""

from __future__ import annotations

import polars as pl


def mean_over_seeds(df: pl.DataFrame, keys: list[str], values: list[str]) -> pl.DataFrame:
    return df.group_by(keys, maintain_order=True).agg([pl.col(v).mean() for v in values]).sort(keys)


def series_keys(data, exclude: set[str], results: pl.DataFrame) -> list[str]:
    """The axes that vary in ``results``, other than ``exclude`` and the seed: one line each."""
    out = []
    for c in data.axes():
        if c in exclude or c == "axis.seed" or c not in results.columns:
            continue
        if results[c].cast(pl.Utf8).n_unique() > 1:
            out.append(c)
    return out


def numeric_capacity_order(df: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """``df`` sorted by ``keys`` with capacity axes ("0.1%", "5%", "512MiB", 1000) compared as
    sizes, not as text (where "5%" sorts after "20%")."""
    from cachelab.capacity import parse_capacity

    def size(value) -> float:
        try:
            cap = parse_capacity(value)
        except Exception:  # not a capacity: keep it last
            return float("inf")
        return cap.amount / 100 if cap.kind == "percent" else cap.amount

    caps = [k for k in keys if k.endswith("capacity")]
    if not caps:
        return df
    order = [f"_size_{k}" if k in caps else k for k in keys]
    sized = df.with_columns([pl.col(k).map_elements(size, return_dtype=pl.Float64).alias(f"_size_{k}") for k in caps])
    return sized.sort(order).drop([f"_size_{k}" for k in caps])


def label(row: dict, keys: list[str]) -> str:
    return " ".join(f"{k.removeprefix('axis.')}={row[k]}" for k in keys) or "all points"


def style(ax, xlabel: str, ylabel: str, legend_size: int | None = 8) -> None:
    """What the line plots share: axis labels, a light grid and a legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend_size:
        ax.legend(fontsize=legend_size)
