"""``cachelab store bench``: a lookup stream through the live store, and the simulator beside it.

Every step of the stream goes through ``TieredStore.lookup`` (real bytes); each returned row
can be checked against its recomputed reference; the same stream, folded into the store's
tables, is replayed by the engine (``cachelab.engine.replay``) with the same policies and
capacities, and the two sets of counts are compared figure by figure.

The simulator is given an SSD without page cache for the SSD backings: its page reads are then
the distinct pages of the rows that reach the backing, exactly what ``direct`` reads; the
buffered modes read through the OS page cache, which the comparison leaves out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from cachelab import registry
from cachelab.engine.replay import replay
from cachelab.engine.tiers import Hierarchy, SSDStore, Tier
from cachelab.errors import CachelabError
from cachelab.progress import progress_bar
from cachelab.store.format import PAGE
from cachelab.store.kernels import DEQUANT_TABLE, dequant_expand
from cachelab.store.store import TieredStore
from cachelab.workload.compaction import compact_steps
from cachelab.workload.lookups import LookupStream, split_key


@dataclass
class PolicySpec:
    """A tier's policy by registry name and keyword arguments (a fresh instance per use)."""

    name: str
    params: dict

    def make(self):
        return registry.make_policy(self.name, **self.params)


def step_rows(stream: LookupStream, s: int, layers: int, columns: int) -> np.ndarray:
    """Step ``s``'s full-layout row ids as ``[tokens, layers, columns]`` (a stream is in token,
    layer, column order within a step)."""
    lo, hi = int(stream.step_offsets[s]), int(stream.step_offsets[s + 1])
    layer, row = split_key(stream.keys[lo:hi])
    per_token = layers * columns
    if (hi - lo) % per_token or not np.array_equal(layer, np.tile(np.repeat(np.arange(layers), columns),
                                                                  (hi - lo) // per_token)):
        raise CachelabError(f"step {s} of the stream is not whole tokens of {layers} layers x {columns} rows "
                            "(a store replays streams built from token sequences)")
    return row.reshape(-1, layers, columns)


def check_stream_rows(stream: LookupStream, lay, source: str) -> None:
    """Refuse a stream the store cannot replay, before a step runs, naming ``source`` and the
    step: a step not whole tokens of the layout's layers x columns in that order, or a row id
    outside its head's rows (a stream cut, or built for other tables). Both were found by the
    step that reached them (one run minutes in), the out-of-range row named without its file
    or step. Checked ``1 << 20`` lookups at a time, in whole tokens."""
    cfg = lay.config
    L, C = cfg.offsets.shape
    per_token = L * C
    sizes = np.diff(stream.step_offsets)
    if (cut := np.flatnonzero(sizes % per_token)).size:
        raise CachelabError(f"{source}: step {int(cut[0])} holds {int(sizes[cut[0]]):,} lookups, not whole tokens of "
                            f"{L} layers x {C} rows (a store replays streams built from token sequences)")
    first, span = cfg.offsets.astype(np.int64), cfg.primes.astype(np.int64)
    chunk = max(1, (1 << 20) // per_token) * per_token
    for lo in range(0, stream.keys.size, chunk):
        layer, row = split_key(stream.keys[lo:lo + chunk])
        other = layer.reshape(-1, L, C) != np.arange(L)[:, None]
        r = row.reshape(-1, L, C) - first
        bad = (other | (r < 0) | (r >= span)).reshape(-1)
        if not bad.any():
            continue
        j = int(np.argmax(bad))
        i = lo + j
        s = int(np.searchsorted(stream.step_offsets, i, "right")) - 1
        at = int(stream.step_offsets[s])
        if other.reshape(-1)[j]:
            raise CachelabError(f"{source}: step {s}, lookup {i - at:,}: key {int(stream.keys[i])} is of table layer "
                                f"{int(layer[j])}, where the layout's token order has layer {j // C % L} (of {L})")
        try:
            lay.out_of_range(split_key(stream.keys[at:int(stream.step_offsets[s + 1])])[1].reshape(-1, L, C), i - at)
        except CachelabError as exc:
            raise CachelabError(f"{source}: step {s}: {exc}") from None


def check_rows(store: TieredStore, row_ids: np.ndarray, got) -> int:
    """How many of the returned rows differ from the dequantised reference rows (the recompute,
    or the checkpoint the tables were built from)."""
    keys = store.keys(row_ids).reshape(-1)
    lay = store.layout_tables
    layer = np.searchsorted(lay.layer_base, keys, "right") - 1
    packed = np.empty((keys.size, lay.row_bytes), np.uint8)
    for li in range(lay.layer_base.size):
        sel = np.flatnonzero(layer == li)
        packed[sel] = store.source.rows(li, keys[sel] - lay.layer_base[li])
    want = np.empty((keys.size, lay.row_dim), np.uint16)  # the CPU's dequantiser, whatever the store's device
    dequant_expand(packed, np.arange(keys.size, dtype=np.int64), DEQUANT_TABLE, want, work=want.nbytes)
    got = got.reshape(keys.size, -1).cpu().view(store.torch.int16).numpy().view(np.uint16)
    return int((got != want).any(axis=1).sum())


def simulate(store: TieredStore, stream: LookupStream, folded: np.ndarray, specs: dict[str, PolicySpec],
             capacities: dict[str, int], scores: np.ndarray | None) -> dict:
    """The engine's replay of the folded stream with the store's tiers, policies and capacities;
    ``stream``'s own (full-layout) rows number the scorer's clock, which ``scores`` are positions on."""
    lay = store.layout_tables
    sim_stream = LookupStream(lay.global_keys(folded), stream.step_offsets, lay.row_bytes, tuple(lay.config.layers))
    tiers = [Tier(name, specs[name].make(), capacity_rows=capacities[name], location="gpu" if name == "hbm" else "host")
             for name in store.tier_names]
    backing = SSDStore(page_bytes=PAGE, page_cache_bytes=0) if store.backing.on_ssd else "dram"
    made_at = None if scores is None else compact_steps(stream.keys, stream.step_offsets)[0].inverse
    stats = replay(sim_stream, Hierarchy(tiers, lay.row_bytes, backing), scores=scores, made_at=made_at).stats()
    return stats.to_dict()


def compare(store_totals: dict, sim: dict, tier_names, backing: str) -> dict[str, tuple[int, int]]:
    """Figure -> (store, simulator) for every figure the two must agree on."""
    levels = sim["levels"]
    out = {}
    for t in tier_names:
        lv = levels[t]
        out[f"{t}_hits"] = (store_totals[f"{t}_hits"], lv["served_unique"])
        out[f"{t}_misses"] = (store_totals[f"{t}_misses"], lv["requests_unique"] - lv["served_unique"])
    backing_levels = [n for n in levels if n not in tier_names]
    out["backing_rows"] = (store_totals["backing_rows"], sum(levels[n]["served_unique"] for n in backing_levels))
    out["unique"] = (store_totals["unique"], sim["unique_rows"])
    out["requested"] = (store_totals["requested"], sim["lookups"])
    hbm_read, host_to_gpu = sim["bytes"]["hbm_read"], sim["bytes"]["host_to_gpu"]
    if backing == "hbm":  # the engine's backing is in host memory; here the table is on the device
        hbm_read, host_to_gpu = hbm_read + host_to_gpu, 0
    out["hbm_read_bytes"] = (store_totals["hbm_read_bytes"], hbm_read)
    out["host_to_device_bytes"] = (store_totals["host_to_device_bytes"], host_to_gpu)
    if backing in ("dram", "direct"):  # the buffered modes' page cache is host memory the simulator leaves out
        out["host_read_bytes"] = (store_totals["host_read_bytes"], sim["bytes"]["host_read"])
    if backing == "direct":
        out["ssd_pages_read"] = (store_totals["ssd_pages_read"], sim["page_reads"])
        out["ssd_to_dram_bytes"] = (store_totals["ssd_to_dram_bytes"], sim["bytes"]["ssd_to_host"])
    return out


def table_stream(directory, trace: str, requests: int | None, verb: str) -> LookupStream:
    """``--trace`` as a row stream for the tables in ``directory``: a saved stream (.npz) as saved,
    or prompt corpora at ``requests`` each (default 50) in the tables' layout; a stream of another
    layout is refused (other multipliers or table sizes name other rows of tables of the same shape)."""
    from cachelab.engram.config import PRESETS, preset_flag
    from cachelab.learning.streams import check_stream_layout, load_trace
    from cachelab.store.build import load_layout
    from cachelab.trace.kinds import detect, refuse_unused

    lay = load_layout(directory)[0]
    cfg = lay.config
    if not trace.endswith(".npz") and cfg.name not in PRESETS:
        raise CachelabError(f"tables of the custom layout {cfg.name!r} replay a saved stream (.npz) only")
    found = detect(trace)
    refuse_unused(found, {"--requests": requests})  # a saved stream is replayed as it was saved
    stream = load_trace(found, 50 if requests is None else requests, 0, cfg.name, verb=verb)
    check_stream_layout(stream, cfg, f"--trace {trace}", f"the tables in {directory} are of that layout; write the "
                        f"stream for it (`cachelab trace lookups ... {preset_flag(cfg.name)}`)")
    check_stream_rows(stream, lay, f"--trace {trace}")
    return stream


def check_run(compute_ms: float, max_lookups: int | None, per_token: int = 1) -> None:
    """Refuse a hold per step that is negative, NaN or infinite (a traceback from the first
    step's sleep) and a lookup budget below 1, or below one token's ``per_token`` rows where the
    layout is known; named by the bench's flags."""
    if not 0 <= compute_ms < math.inf:
        raise CachelabError(f"--compute-ms must be a finite number of milliseconds, 0 or more, got {compute_ms}")
    if max_lookups is not None and max_lookups < 1:
        raise CachelabError(f"--max-lookups must be at least 1, got {max_lookups}")
    if max_lookups is not None and max_lookups < per_token:
        raise CachelabError(f"--max-lookups {max_lookups} is less than one token's {per_token} rows (its layers x "
                            "columns, looked up together)")


def first_lookups(stream: LookupStream, max_lookups: int, per_token: int) -> LookupStream:
    """The stream's first ``max_lookups`` lookups, down to whole tokens: a token's ``per_token`` rows
    (its layers x columns) are one lookup of the store, so the step that reaches the budget is cut
    after its last whole token within it (the run went on to that step's end: 1,000,032 lookups for
    1,000,000). Exactly ``max_lookups`` where it is whole tokens."""
    n = min(max_lookups - max_lookups % per_token, stream.num_lookups)
    steps = max(1, int(np.searchsorted(stream.step_offsets, n, "left")))
    offsets = stream.step_offsets[: steps + 1].copy()
    offsets[-1] = n
    return LookupStream(stream.keys[:n], offsets, stream.row_bytes, stream.layers)


def warm_up(store: TieredStore, stream: LookupStream, scores: np.ndarray | None) -> None:
    """The stream's first token through the store, which is then reset for the run. A process's
    first steps compile the kernels they run, or load them from Numba's cache. That time fell
    in the run's stage seconds: 0.45 s of backing read for a dram run in a fresh cache, 0.02 s
    warm. The token's rows are read, so for mmap and pread its pages (48 at most in V4.1's
    layout) are in the page cache before the run. The store is reset, not closed and opened
    again: a second store read the whole table into memory again under dram, and allocated its
    tiers and their policies' indexes while the first one's were still held."""
    if not stream.num_steps:
        return
    rows = step_rows(stream, 0, len(store.layout.layers), store.layout.columns)[:1]
    store.lookup(rows, None if scores is None else scores[: rows.size].reshape(rows.shape))
    store.reset()


def replay_store(directory, stream: LookupStream, backing: str, hbm: PolicySpec | None, hbm_capacity,
                 dram: PolicySpec | None = None, dram_capacity=None, scores: np.ndarray | None = None,
                 verify: bool = True, prefetch: bool = False, io_threads: int | None = None, io_submit: str = "auto",
                 progress: bool = False, max_lookups: int | None = None, compute_ms: float = 0.0,
                 device: str = "cpu") -> dict:
    """Replay ``stream`` through a store opened on ``directory``; the store's totals, the
    simulator's figures, the comparison and the row check, as one JSON-shaped dict.

    ``compute_ms``: the caller holds each step's rows this long (sleeping, the GIL released),
    standing for the model's forward pass that a prefetch of the next step overlaps. ``wall_s``:
    the replay's seconds (steps, holds, row checks), which the store's ``step_s`` and
    ``stall_s`` each stay within."""
    check_run(compute_ms, max_lookups)
    specs = {k: v for k, v in (("hbm", hbm), ("dram", dram)) if v is not None}
    mismatches = 0

    with TieredStore.open(directory, backing=backing, hbm_policy=hbm and hbm.make(), hbm_capacity=hbm_capacity,
                          dram_policy=dram and dram.make(), dram_capacity=dram_capacity,
                          io_threads=io_threads, io_submit=io_submit, device=device) as store:
        warm_up(store, stream, scores)
        cfg = store.layout
        L, C = len(cfg.layers), cfg.columns
        if max_lookups is not None:
            check_run(compute_ms, max_lookups, L * C)
            stream = first_lookups(stream, max_lookups, L * C)
            scores = None if scores is None else scores[: stream.keys.size]
        steps = stream.num_steps
        folded = np.empty(stream.keys.size, np.int64)
        wall = time.perf_counter()
        with progress_bar(enabled=progress) as bar:
            task = bar.add_task(f"store bench ({backing})", total=steps)
            ahead = None
            for s in range(steps):
                rows = step_rows(stream, s, L, C)
                lo, hi = int(stream.step_offsets[s]), int(stream.step_offsets[s + 1])
                sc = None if scores is None else scores[lo:hi].reshape(rows.shape)
                folded[lo:hi] = store.keys(rows).reshape(-1)
                if prefetch:
                    got = (ahead if ahead is not None else store.prefetch(rows, sc)).wait()
                    if s + 1 < steps:  # the next step's fetch overlaps this step's use
                        nxt = step_rows(stream, s + 1, L, C)
                        lo2, hi2 = int(stream.step_offsets[s + 1]), int(stream.step_offsets[s + 2])
                        ahead = store.prefetch(nxt, None if scores is None else scores[lo2:hi2].reshape(nxt.shape))
                else:
                    got = store.lookup(rows, sc)
                if compute_ms:
                    time.sleep(compute_ms / 1e3)
                if verify:
                    mismatches += check_rows(store, rows, got)
                bar.advance(task)
        wall = time.perf_counter() - wall
        totals = store.totals.to_dict()
        capacities = {t.name: t.capacity for t in store.tiers}
        sim = simulate(store, stream, folded, specs, capacities, scores)
        figures = compare(totals, sim, store.tier_names, backing)
        out = {"backing": backing, "hbm_device": store.hbm_device, "steps": steps, "prefetch": prefetch,
               "io_submission": getattr(store.backing, "submission", None),
               "compute_ms": compute_ms, "wall_s": wall,
               "lookups": int(stream.keys.size), "capacities": capacities, "clamped_capacities": store.clamped,
               "policies": {t: specs[t].name for t in store.tier_names},  # the tiers that run
               "store": totals, "simulator": sim,
               "comparison": {k: {"store": int(a), "simulator": int(b)} for k, (a, b) in figures.items()},
               "matches_simulator": all(int(a) == int(b) for a, b in figures.values())}
        if verify:
            out["rows_checked"], out["mismatches"] = int(stream.keys.size), mismatches
    return out
