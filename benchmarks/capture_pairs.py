"""The paired estimator of bench_capture's overhead verdict (``--pairs``): request-level pairs instead of
rounds, so that the A/A noise can fall under the 1 ms allowance on a shared machine.

Rounds of hundreds of streams per path leave a handful of units to resample, and a load that drifts
between rounds is as large as the allowance (session 30: +/-3.4 ms TTFT at concurrency 1). Here a unit
is a pair: ``c`` streams on one path, then ``c`` streams of the same shape on the other, back to back,
so both meet the same load. Units run in cycles of four, (direct, X), (X, X), (X, direct), (direct,
direct): in the compared pairs each path goes first in half and follows each path in half (a path's work
left over from a stream, the proxy's record, falls on whichever stream comes next), and half the pairs
are A/A pairs run the same way. The P99 of each arm is taken over all its units' samples, and the
interval of the P99 difference is a paired bootstrap: the same units for both arms, drawn in blocks of
consecutive cycles (a load burst spans several pairs). The A/A pairs, direct-direct and X-X pooled, are
as many as the compared ones and give the noise under the same estimator; their interval covers zero
when the noise claimed is the noise there is. A P99 over n samples rests on about n / 100 samples beyond
it (``tail_samples``), which come from ``tail_units`` units: fewer where one stall delays a unit's streams
together.
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import numpy as np

CYCLE = 4  # units per cycle: (direct, X), (X, X), (X, direct), (direct, direct)
MIN_BLOCKS = 10  # fewer blocks to draw from give a bootstrap spread too coarse to call a noise (one gives none)


def schedule(pairs: int, name: str) -> list[tuple[str, str]]:
    """The order of ``pairs`` compared pairs and as many A/A pairs, in cycles of four: (first path,
    second path) per unit. Each path's compared streams follow a direct stream in half the pairs and one of X
    in the other half: in the order (direct, X), (direct, direct), (X, direct), (X, X) every compared direct
    stream followed one of X, and work the proxy leaves after a stream (its record) fell on direct."""
    if pairs < 2 or pairs % 2:
        raise ValueError(f"--pairs {pairs}: expected an even number of pairs, 2 or more (two per cycle)")
    cycle = [("direct", name), (name, name), (name, "direct"), ("direct", "direct")]
    return cycle * (pairs // 2)


def arms(units: list[tuple[str, str, np.ndarray, np.ndarray]], name: str) -> dict[str, tuple[list, list]]:
    """Units (first path, second path, first's samples, second's) as arms per comparison: ``compare``
    (direct, X) whichever went first; ``aa_direct`` and ``aa_proxy`` (arm A, arm B), arm A the first of the
    pair in even cycles and the second in odd ones, so that order falls on both arms alike as in
    ``compare``; ``aa`` the two A/A kinds pooled, unit for unit, as many pairs as ``compare``."""
    out = {"compare": ([], []), "aa_direct": ([], []), "aa_proxy": ([], [])}
    for k, (first, second, a, b) in enumerate(units):
        if first != second:
            out["compare"][0].append(a if first == "direct" else b)
            out["compare"][1].append(b if first == "direct" else a)
            continue
        if first not in ("direct", name):
            raise ValueError(f"a unit of path {first!r} in the pairs of {name!r}")
        kind = "aa_direct" if first == "direct" else "aa_proxy"
        if (k // CYCLE) % 2:
            a, b = b, a
        out[kind][0].append(a)
        out[kind][1].append(b)
    pooled = [u for pair in zip(out["aa_direct"][0], out["aa_proxy"][0]) for u in pair], \
             [u for pair in zip(out["aa_direct"][1], out["aa_proxy"][1]) for u in pair]
    return out | {"aa": pooled}


def p99(values: np.ndarray) -> float:
    return float(np.percentile(values, 99))


def resampled_p99(arm: list[np.ndarray], draws: np.ndarray) -> np.ndarray:
    """The P99 of each draw (a row of unit numbers), its units' samples together. Units of as many samples each
    (the bench's: every stream as many tokens) go through one array operation per 64 draws."""
    if len({u.size for u in arm}) == 1:
        stacked = np.stack(arm)
        return np.concatenate([np.percentile(stacked[rows].reshape(len(rows), -1), 99, axis=1)
                               for rows in np.array_split(draws, -(-len(draws) // 64))])
    return np.array([p99(np.concatenate([arm[u] for u in row])) for row in draws])


def paired_interval(a: list[np.ndarray], b: list[np.ndarray], block: int, rng, draws: int = 1000):
    """P99(b) - P99(a) over all units, and its 95% paired bootstrap interval: the same units for both arms (a
    unit's two arms met the same load), drawn in blocks of ``block`` consecutive ones (circular: a block that
    starts near the end goes on at the first unit, so every draw has as many units)."""
    n = min(len(a), len(b))
    if n == 0:
        raise ValueError("no pairs to compare")
    a, b = a[:n], b[:n]
    point = p99(np.concatenate(b)) - p99(np.concatenate(a))
    starts = np.arange(0, n, block)
    picks = rng.choice(starts, (draws, starts.size))
    rows = ((picks[:, :, None] + np.arange(min(block, n))) % n).reshape(draws, -1)
    low, high = np.percentile(resampled_p99(b, rows) - resampled_p99(a, rows), [2.5, 97.5])
    return point, float(low), float(high)


def tail_units(arm: list[np.ndarray]) -> int:
    """How many of an arm's units hold its samples beyond the P99. At concurrency 8 one stall (a collection in
    the upstream, a burst of other work) delays the eight streams of a unit together: the P99 of n samples then
    rests on fewer independent events than the n / 100 samples beyond it, and moves by whole units."""
    cut = p99(np.concatenate(arm))
    return sum(bool((u > cut).any()) for u in arm)


def goal_by_interval(low: float, high: float, allowed: float) -> str:
    """The goal's verdict that another run of the same rounds would repeat: met where the whole 95% interval of
    the P99 delta is within the allowance, missed where all of it is past, else unresolved (one run's P99 said
    met or missed by chance of its slowest few samples: the same proxy was both in runs minutes apart)."""
    return "met" if high <= allowed else "missed" if low > allowed else "unresolved"


PER_CYCLE = {"compare": 2, "aa": 2, "aa_direct": 1, "aa_proxy": 1}  # each arm list's units per cycle


def paired_figures(units, name: str, pick, block_cycles: int, seed: int, draws: int = 1000) -> dict:
    """The verdict of one path against direct from its pairs, in ms: each arm's P99, the paired P99 delta and
    its interval, the A/A intervals (pooled: the noise; and each kind alone, on half as many pairs), whether
    the pooled A/A interval covers zero, the allowance (max(1 ms, 1% of direct's P99)), the goal by the
    interval and at the noise (unresolved unless the noise is under the allowance). Units are drawn in
    blocks of ``block_cycles`` cycles; under ``MIN_BLOCKS`` blocks no interval is one: the noise is nan
    and both verdicts unresolved. Every interval draws from ``seed`` afresh: every path gets the same draws."""
    by = {kind: ([np.asarray(pick(u), dtype=float) for u in a], [np.asarray(pick(u), dtype=float) for u in b])
          for kind, (a, b) in arms(units, name).items()}
    direct, proxied = (np.concatenate(arm) for arm in by["compare"])
    allowed = max(1.0, 0.01 * p99(direct) * 1e3)

    def interval(kind):
        point, low, high = paired_interval(*by[kind], block_cycles * PER_CYCLE[kind], np.random.default_rng(seed),
                                           draws)
        return point * 1e3, [low * 1e3, high * 1e3]

    delta, ci = interval("compare")
    aa, aa_ci = interval("aa")
    blocks = -(-len(by["aa"][0]) // (block_cycles * PER_CYCLE["aa"]))
    noise = (aa_ci[1] - aa_ci[0]) / 2 if blocks >= MIN_BLOCKS else float("nan")
    goal = goal_by_interval(*ci, allowed) if blocks >= MIN_BLOCKS else "unresolved"
    return {"pairs": len(by["compare"][0]), "samples": int(min(direct.size, proxied.size)),
            "tail_samples": int(min(direct.size, proxied.size)) // 100,
            "tail_units": min(tail_units(arm) for arm in by["compare"]),
            "direct_p99_ms": p99(direct) * 1e3, "proxy_p99_ms": p99(proxied) * 1e3, "p99_delta_ms": delta,
            "p99_delta_ci_ms": ci, "aa_p99_delta_ms": aa, "aa_p99_delta_ci_ms": aa_ci,
            "aa_direct_p99_delta_ci_ms": interval("aa_direct")[1], "aa_proxy_p99_delta_ci_ms": interval("aa_proxy")[1],
            "aa_covers_zero": aa_ci[0] <= 0 <= aa_ci[1], "noise_ms": noise, "allowed_ms": allowed,
            "noise_under_allowance": noise < allowed, "goal": goal,
            "goal_at_noise": goal if noise < allowed else "unresolved", "block_cycles": block_cycles, "blocks": blocks}
