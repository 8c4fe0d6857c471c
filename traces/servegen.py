"""ServeGen per-client workloads (alibaba/ServeGen, Apache-2.0; Xiang et al., arXiv 2505.09999).

ServeGen publishes distributions, not requests. A model folder holds, per client N,
``chunk-N-trace.csv`` (no header; one row per 10-minute window: ``start_s, rate (req/s), cv,
pattern, p1, p2``, where ``pattern`` is the family of the inter-arrival distribution,
``Gamma`` or ``Weibull`` with fitted parameters p1, p2, empty for an idle window) and
``chunk-N-dataset.json`` (per 6-hour window, the PMFs of ``input_tokens`` and
``output_tokens`` as ``{tokens: probability}`` literals).

A window lasts the file's window length (the least step between starts: 10 minutes in every
published file), so a window missing from the file, or skipped as bad, is idle rather than
the window before it stretched over it.

Requests are sampled per client and window: gaps of the window's family with mean
1 / rate and the window's CV (the fitted p1, p2 are not used: in a few bursty windows their
mean disagrees with the measured rate by orders of magnitude), from the window start to its end; input and output lengths independently from the PMFs of the
latest dataset window at or before it (windows whose PMFs are empty are skipped, as ServeGen
does; a trace window with no length distribution before it yields no requests).
Deterministic for a seed; client N draws from its own generator, so subsets reproduce.
"""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError
from cachelab.trace.ingest import MAX_COUNT, Ingest, count_field

PATTERNS = ("Gamma", "Weibull")
TRACE_FIELDS = ("start_s", "rate", "cv", "pattern", "p1", "p2")
MAX_RATE = 1e4  # requests per second per client (production peaks are about 20); above is damage
MAX_DATASET_BYTES = 64 << 20  # 58 times the largest published dataset file (reason/deepseek-r1 client 35)
MAX_WINDOW_REQUESTS = MAX_RATE * 600  # a window's requests, drawn in one array: 10 minutes at the highest rate
_CLIENT = re.compile(r"chunk-(\d+)-trace\.csv$")


def _number(col: str, positive: bool = False) -> tuple[pl.Expr, str]:
    value = pl.col(col).cast(pl.Float64, strict=False)
    ok = value.is_finite() & ((value > 0) if positive else (value >= 0))
    return pl.when(ok).then(value), "a number > 0" if positive else "a number >= 0"


def read_windows(ingest: Ingest) -> pl.DataFrame:
    """The rate windows of one client: start, rate, pattern, shape, scale (idle windows kept)."""
    rows, lines = [], []
    ingest.hold()
    for number, text in ingest.lines():
        if not text.strip():
            continue
        fields = [f.strip() for f in text.split(",")]
        if len(fields) != len(TRACE_FIELDS):
            ingest.bad(number, f"{len(fields)} fields, expected {len(TRACE_FIELDS)} ({', '.join(TRACE_FIELDS)})")
            continue
        if fields[3] and fields[3] not in PATTERNS:
            ingest.bad(number, f"field 'pattern': {fields[3]!r} is not one of {list(PATTERNS)} or empty")
            continue
        rows.append(fields)
        lines.append(number)
    raw = pl.DataFrame(rows, schema=list(TRACE_FIELDS), orient="row") if rows else \
        pl.DataFrame(schema={f: pl.String for f in TRACE_FIELDS})
    idle = pl.col("pattern") == ""
    rate = pl.col("rate").cast(pl.Float64, strict=False)
    conversions = {"start_s": count_field("start_s"),
                   "rate": (pl.when(rate.is_finite() & (rate >= 0) & (rate <= MAX_RATE)).then(rate),
                            f"a rate between 0 and {MAX_RATE:g} requests/s"),
                   "cv": _number("cv"),
                   "pattern": (pl.col("pattern"), "a pattern")}
    for p in ("p1", "p2"):  # an idle window's parameters are ignored (ServeGen writes 0)
        value, expected = _number(p, positive=True)
        conversions[p] = (pl.when(idle).then(pl.lit(0.0)).otherwise(value), expected)
    lines = np.asarray(lines, dtype=np.int64)
    typed = ingest.convert(raw.with_columns(pl.Series("line", lines)), lines,
                           {**conversions, "line": (pl.col("line"), "a line")})
    dup = typed.filter(pl.col("start_s").is_duplicated()).sort("start_s", "line")
    if dup.height:
        start, first, second = dup["start_s"][0], dup["line"][0], dup["line"][1]
        raise CachelabError(f"{ingest.path}:{second}: window start {start} s repeats line {first}'s; "
                            "each 10-minute window is one row")
    return typed.select(TRACE_FIELDS).sort("start_s")  # in file-column order: callers unpack rows


def _line_of(text: str, *needles: str) -> int:
    """The 1-based line of the last needle, each searched after the previous one."""
    pos = 0
    for needle in needles:
        found = text.find(needle, pos)
        if found < 0:
            return 1
        pos = found
    return text.count("\n", 0, pos) + 1


def _unique_keys(path: Path, text: str):
    """A ``json.loads`` object hook that refuses a repeated key (a window start), naming its line."""
    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                line = text.count("\n", 0, text.find(f'"{key}"', text.find(f'"{key}"') + 1)) + 1
                raise CachelabError(f"{path}:{line}: window {key!r} appears twice; the second would "
                                    "silently replace the first")
            seen.add(key)
        return dict(pairs)
    return hook


def read_pmfs(ingest: Ingest) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Dataset window start -> field -> (values, cumulative probabilities), for windows with both
    PMFs; a window with a bad PMF is a bad row of ``ingest`` (counted under ``skip_bad``).

    The file is read whole (one JSON object; its PMFs are Python literals): Python holds about 30
    times its size while it is parsed, so one over ``MAX_DATASET_BYTES`` is refused unread."""
    path = ingest.path
    size = path.stat().st_size
    if size > MAX_DATASET_BYTES:
        raise CachelabError(f"{path}: {size:,} bytes, more than the {MAX_DATASET_BYTES:,} a ServeGen dataset file "
                            "may have (the published ones have at most 1.1 MB): not a dataset file, or damaged")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise CachelabError(f"{path}:{line}: not UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise CachelabError(f"{path}: empty file")
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys(path, text))
    except json.JSONDecodeError as exc:
        ends = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")  # its quote never came
        cut = ": the file ends before its JSON does (truncated?)" if ends else ""
        raise CachelabError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}){cut}") from None
    except CachelabError:
        raise
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits, deep nesting
        raise CachelabError(f"{path}: not usable JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(data, dict):
        raise CachelabError(f"{path}:1: expected an object of windows")
    out = {}
    for ts, fields in data.items():
        line = _line_of(text, f'"{ts}"')
        # ASCII digits, a start in seconds as the trace's: str.isdigit took '²' (then int() failed), and a
        # start past int64 failed the windows' array
        if not re.fullmatch(r"[0-9]{1,10}", ts) or int(ts) > MAX_COUNT or not isinstance(fields, dict):
            ingest.bad(line, f"window {ts!r}: expected a start in seconds holding an object of PMFs")
            continue
        pmfs, problem = {}, None
        for name in ("input_tokens", "output_tokens"):
            where = _line_of(text, f'"{ts}"', f'"{name}"')
            try:
                pmf = ast.literal_eval(fields[name]) if isinstance(fields.get(name), str) else None
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pmf = None
            if not isinstance(pmf, dict):
                problem = (where, f"window {ts}, field {name!r}: expected a {{tokens: probability}} literal")
                break
            if not pmf:
                break  # an empty PMF: ServeGen skips the window
            values, probs = np.asarray(list(pmf), dtype=object), np.asarray(list(pmf.values()), dtype=object)
            try:  # a key of 12.5 tokens was cut to 12: only whole counts are token counts
                if not all(type(v) is int for v in values) or not all(type(p) in (int, float) for p in probs):
                    raise TypeError  # a probability "0.5" (a string) was parsed, True taken for 1
                values, probs = values.astype(np.int64), probs.astype(np.float64)
            except (TypeError, ValueError, OverflowError):
                problem = (where, f"window {ts}, field {name!r}: keys must be whole token counts, values probabilities")
                break
            least = 1 if name == "input_tokens" else 0  # no request has an empty prompt
            if values.min() < least:
                problem = (where, f"window {ts}, field {name!r}: token count {values.min()} (the least is {least})")
                break
            if values.max() > MAX_COUNT:  # past int32: the trace's build failed in Polars, naming no file
                problem = (where, f"window {ts}, field {name!r}: token count {values.max()} (the most is {MAX_COUNT})")
                break
            if probs.min() < 0 or not math.isclose(probs.sum(), 1.0, abs_tol=1e-6):
                problem = (where, f"window {ts}, field {name!r}: not a PMF over token counts (sum {probs.sum():.6f})")
                break
            pmfs[name] = (values, np.cumsum(probs / probs.sum()))
        if problem:
            ingest.bad(*problem)
        elif len(pmfs) == 2:
            out[int(ts)] = pmfs
    return out


_WEIBULL_K = np.geomspace(0.05, 100.0, 4000)
_WEIBULL_CV = np.sqrt(np.exp([math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k) for k in _WEIBULL_K]) - 1)  # falls with k


def _gaps(rng: np.random.Generator, pattern: str, rate: float, cv: float, size: int) -> np.ndarray:
    """Inter-arrival gaps of the window's family with mean 1 / rate and coefficient of variation cv."""
    mean = 1.0 / rate
    if cv < 1e-6:
        return np.full(size, mean)
    if pattern == "Gamma":
        shape = 1.0 / cv**2
        return rng.gamma(shape, mean / shape, size)
    k = float(np.interp(cv, _WEIBULL_CV[::-1], _WEIBULL_K[::-1]))
    return mean / math.exp(math.lgamma(1 + 1 / k)) * rng.weibull(k, size)


class ServeGenWorkload:
    """Requests sampled from a ServeGen model folder (e.g. ``traces/servegen/data/reason/deepseek-r1``).

    Args:
        path: the folder of ``chunk-N-trace.csv`` / ``chunk-N-dataset.json`` files.
        duration_s: seconds to generate, from ``start_s`` (ServeGen's clock: seconds of the day).
        clients: only these client numbers (all when None).
        seed: generator seed.
        skip_bad: skip and count unusable rows instead of failing on the first.
        domain: label for every request; default the category folder (``reason``).
    """

    name = "servegen"
    has_lengths = True

    def __init__(self, path: str, duration_s: float = 3600.0, start_s: float = 0.0, clients: list[int] | None = None,
                 seed: int = 0, skip_bad: bool = False, domain: str | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CachelabError(f"ServeGen folder not found: {self.path}")
        if not duration_s > 0 or start_s < 0:
            raise CachelabError(f"ServeGen: duration_s must be > 0 and start_s >= 0, got {duration_s}, {start_s}")
        self.duration_s, self.start_s, self.clients, self.seed = duration_s, start_s, clients, seed
        self.skip_bad = skip_bad
        self.domain = domain or self.path.parent.name
        self.skipped = 0
        self.skipped_lines: list[str] = []  # FILE:LINE of every skipped row, trace and dataset windows
        self.first_skipped: str | None = None

    def client_files(self) -> dict[int, Path]:
        found = {int(m.group(1)): p for p in self.path.iterdir() if (m := _CLIENT.match(p.name))}
        if not found:
            raise CachelabError(f"{self.path}: no chunk-N-trace.csv files (is this a ServeGen model folder?)")
        if self.clients is not None:
            missing = sorted(set(self.clients) - set(found))
            if missing:
                raise CachelabError(f"{self.path}: no client(s) {missing}; it has {len(found)} clients")
            found = {c: found[c] for c in self.clients}
        return dict(sorted(found.items()))

    def _client(self, client: int, trace_path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ingest = Ingest(trace_path, self.skip_bad)
        windows = read_windows(ingest)
        dataset = trace_path.with_name(f"chunk-{client}-dataset.json")
        if not dataset.is_file():
            raise CachelabError(f"{dataset}: missing (every trace file needs its dataset file)")
        pmf_ingest = Ingest(dataset, self.skip_bad)
        pmfs = read_pmfs(pmf_ingest)
        for one in (ingest, pmf_ingest):
            self.skipped += one.skipped
            self.first_skipped = self.first_skipped or one.first_skipped
            self.skipped_lines += [f"{one.path.name}:{line}" for line in one.skipped_lines]
        starts = windows["start_s"].to_numpy()
        step = int(np.diff(starts).min()) if starts.size > 1 else 600  # the window length: 600 s in every file
        ends = np.minimum(np.append(starts[1:], starts[-1] + step), starts + step) if starts.size else starts
        stop = self.start_s + self.duration_s
        pmf_starts = np.asarray(sorted(pmfs), dtype=np.int64)
        times, n_in, n_out = [], [], []
        for (start, rate, cv, pattern, _, _), end in zip(windows.iter_rows(), ends.tolist()):
            lo, hi = max(start, self.start_s), min(end, stop)
            if not pattern or hi <= lo:
                continue
            which = np.searchsorted(pmf_starts, start, side="right") - 1
            if which < 0:
                continue
            if rate <= 0:
                continue
            if rate * (end - start) > MAX_WINDOW_REQUESTS:  # all drawn at once: a sparse file's long window
                raise CachelabError(f"{trace_path}: the window from {start} s, {rate:g} requests/s over its "
                                    f"{end - start:,} s (the least step between starts), is more than "
                                    f"{MAX_WINDOW_REQUESTS:,.0f} requests to draw")
            # the whole window drawn, from its own generator, then cut to [lo, hi): a window's requests
            # are the same whatever start_s and duration_s take in (they depended on the windows before)
            rng, t, drawn = np.random.default_rng([self.seed, client, start]), float(start), []
            while t < end:
                arrivals = t + np.cumsum(_gaps(rng, pattern, rate, cv, int(rate * (end - start) * 1.1) + 16))
                drawn.append(arrivals)
                t = float(arrivals[-1])
            arrivals = np.concatenate(drawn)
            arrivals = arrivals[arrivals < end]
            pmf = pmfs[int(pmf_starts[which])]
            keep = (arrivals >= lo) & (arrivals < hi)
            times.append(arrivals[keep] - self.start_s)
            for out, name in ((n_in, "input_tokens"), (n_out, "output_tokens")):
                values, cdf = pmf[name]
                out.append(values[np.minimum(np.searchsorted(cdf, rng.random(arrivals.size), side="right"),
                                             values.size - 1)][keep])
        if not times:
            return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(times), np.concatenate(n_in), np.concatenate(n_out)

    def arrivals(self) -> pl.DataFrame:
        parts = [self._client(c, p) for c, p in self.client_files().items()]
        times = np.concatenate([p[0] for p in parts])
        if times.size == 0:
            raise CachelabError(f"{self.path}: no requests between {self.start_s} s and "
                                f"{self.start_s + self.duration_s} s")
        return arrival_frame(times, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]),
                             domain=self.domain, source=self.name)
