"""Pareto fronts over serving configurations: more interactivity and more tokens/s per GPU.

A point is on the front when no other point is at least as good on both axes and better on
one. ``throughput_at`` reads a front at a given interactivity (the best throughput any
configuration reaches while at least that interactive), the way InferenceX compares systems
at equal interactivity.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from cachelab.errors import CachelabError
from cachelab.paths import replacing


def pareto_front(points: pl.DataFrame, x: str = "interactivity", y: str = "tokens_per_s_per_gpu") -> pl.DataFrame:
    """The non-dominated rows of ``points`` (both columns: higher is better), by ``x``."""
    df = points.filter(pl.col(x).is_finite() & pl.col(y).is_finite()).sort([x, y], descending=[True, True])
    best = -np.inf
    keep = []
    for value in df[y].to_numpy():
        keep.append(value > best)
        best = max(best, value)
    return df.filter(pl.Series(keep, dtype=pl.Boolean)).sort(x)


def throughput_at(front: pl.DataFrame, interactivity: float, x: str = "interactivity",
                  y: str = "tokens_per_s_per_gpu") -> float:
    """Throughput on the front at ``interactivity``, interpolated linearly between its points;
    NaN beyond the most interactive point."""
    xs, ys = front[x].to_numpy(), front[y].to_numpy()
    if xs.size == 0 or interactivity > xs.max():
        return float("nan")
    if interactivity <= xs.min():
        return float(ys.max())
    return float(np.interp(interactivity, xs, ys))


def dominated(points: pl.DataFrame, by: pl.DataFrame, x: str = "interactivity", y: str = "tokens_per_s_per_gpu",
              rtol: float = 0.0) -> np.ndarray:
    """For each row of ``points``, whether some row of ``by`` is at least as good on both axes
    and strictly better on one; values within ``rtol`` of each other (relative) are a tie, so a
    model solved to a tolerance does not rank its own rounding."""
    px, py = points[x].to_numpy()[:, None], points[y].to_numpy()[:, None]
    bx, by_ = by[x].to_numpy()[None, :], by[y].to_numpy()[None, :]
    lo, hi = 1.0 - rtol, 1.0 + rtol
    return np.any((bx >= px * lo) & (by_ >= py * lo) & ((bx > px * hi) | (by_ > py * hi)), axis=1)


def plot_format(path, flag: str = "--plot") -> str:
    """The image format ``path``'s suffix names (matplotlib's default, PNG, without one); a
    suffix matplotlib cannot write is refused, so a caller can check it before the work."""
    from matplotlib import rcParams
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix[1:].lower() or rcParams["savefig.format"]
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        raise CachelabError(f"{flag} {path}: not an image format matplotlib writes ({fmt!r}); name it .png, or "
                            f"one of {sorted(supported)}")
    return fmt


def plot_fronts(points: pl.DataFrame, group: str, path, title: str, mark_interactivity: float | None = None,
                x: str = "interactivity", y: str = "tokens_per_s_per_gpu",
                xlabel: str = "interactivity (tok/s/user = 1000 / median TPOT ms)") -> None:
    """All points (faint) and each group's Pareto front (lines) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name in sorted(points[group].unique().to_list()):
        sub = points.filter(pl.col(group) == name)
        front = pareto_front(sub, x, y)
        line, = ax.plot(front[x], front[y], marker="o", label=f"{name} (front)")
        ax.scatter(sub[x], sub[y], s=12, alpha=0.35, color=line.get_color())
    if mark_interactivity is not None:
        ax.axvline(mark_interactivity, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("throughput (total tok/s per GPU)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with replacing(path) as tmp:  # the format from the name asked for, not the scratch file's
        fig.savefig(tmp, format=plot_format(path))
    plt.close(fig)
