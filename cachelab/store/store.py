"""``TieredStore``: one serving step's Engram lookups through real tiers holding real bytes.

```
 row ids [tokens, layers, columns] --fold, dedup--> distinct keys
   --> HBM row cache (policy.step: hits gather from slots)
   --misses--> DRAM warm cache (policy.step)
   --misses--> backing: DRAM table | mmap | pread | O_DIRECT
   --> host staging --copy--> device rows --dequant FP8 x 2^(s-127) -> BF16, request order-->
 rows [tokens, layers, columns, row_dim] bfloat16
```

Rows are addressed as raw table rows (``layer_base + row`` of the scaled tables); the
policies see each row's number of first use, given online by a 4-byte map per table row (no
offline compaction pass: a row is numbered the step it is first asked for), the numbering the
simulator's replay uses, so every policy decides as it does there. Each policy and each tier's
slot map is sized by the table's rows (``policy_bytes_per_row`` measures what that costs).
Without CUDA the HBM tier is a CPU tensor standing in for HBM (``hbm_device`` says so) and
the host staging is the device rows themselves; with CUDA it is device memory, the staging is
pinned (the DRAM tier is not: the CPU gathers its hits into the staging), and dequantisation
runs on the GPU (a torch lookup in the CPU kernels' table). Backing ``hbm`` (serve-sim's placement)
keeps the whole table in the compute device's memory as one torch tensor, with no tier in
front: a step's rows are gathered and dequantised there, nothing staged or copied over the host
link (on the CPU that memory is host DRAM standing in for HBM, as for the row cache).
"""

from __future__ import annotations

import resource
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from functools import cached_property
from pathlib import Path

import numpy as np

from cachelab import registry
from cachelab.capacity import TABLE_ROWS, parse_capacity
from cachelab.errors import CachelabError
from cachelab.policy import Policy
from cachelab.policy.unbounded import Unbounded
from cachelab.store.backing import open_backing
from cachelab.store.build import open_tables, same_build
from cachelab.store.counters import TIME_KEYS, Counters, count_keys
from cachelab.store.device import check_device, indexed_device
from cachelab.store.format import integer_ids
from cachelab.store.kernels import (BITMAP_BYTES, DEQUANT_TABLE, SEEN_GENERATIONS, SEEN_KEY_BITS, dequant_expand,
                                    dequant_rows_torch, lookup_dequant, slot_bits)
from cachelab.store.outputs import OutputPool
from cachelab.store.source import RowSource
from cachelab.store.staging import IndexStaging
from cachelab.store.tier import CacheTier, device_free, policy_bytes_per_row, scorer_positions, tier_memory
from cachelab.workload.compaction import compact

INT64 = np.dtype(np.int64)


def available_memory() -> int:
    """Host memory the kernel says is available (MemAvailable), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _faults() -> tuple[int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_majflt


def _positions(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Index in ``keys`` (distinct) of each of ``queries`` (all present)."""
    order = np.argsort(keys, kind="stable")
    return order[np.searchsorted(keys[order], queries)]


class PrefetchHandle:
    """A step running on the store's background thread; ``wait()`` returns its rows."""

    def __init__(self, future: Future, store: "TieredStore"):
        self._future, self._store = future, store
        self.stall_seconds: float | None = None
        self._stall_lock = threading.Lock()

    def done(self) -> bool:
        return self._future.done()

    def wait(self):
        """The rows (as ``lookup`` returns them); ``stall_seconds`` is how long this blocked.
        The step's stall is counted once, by the first ``wait()`` to return: two threads
        waiting on one handle both saw it unset and both added theirs to the counters."""
        t = time.perf_counter()
        rows, counters = self._future.result()
        stalled = time.perf_counter() - t
        with self._stall_lock:
            first = self.stall_seconds is None
            if first:
                self.stall_seconds = stalled
        if first:
            self._store._add_stall(counters, stalled)
        return self._store._hand_over(rows, self._store._caller_stream())


class TieredStore:
    """Engram tables behind an HBM row cache and a DRAM warm cache, each run by a policy.

    A tier whose policy holds every row at its capacity (``Policy.holds_every_key``) runs as the
    simulator's infinite cache, and a capacity above the table's rows then keeps only their
    slots (``clamped``: per tier, the rows asked for and kept)."""

    def __init__(self, directory, backing: str = "dram", hbm_policy: Policy | str | None = "lru",
                 hbm_capacity=None, dram_policy: Policy | str | None = None, dram_capacity=None,
                 device: str = "cpu", io_threads: int | None = None, io_submit: str = "auto"):
        import torch

        self.torch = torch
        self.directory = Path(directory)
        self.layout_tables, self.manifest, self.paths = open_tables(self.directory)
        lay = self.layout_tables
        self.layout = lay.config
        self.row_bytes, self.row_dim = lay.row_bytes, lay.row_dim
        self.num_keys = lay.num_keys
        self.layer_base = lay.layer_base
        check_device(device)
        self.device = indexed_device(device)
        self.cuda = self.device.type == "cuda"
        self.hbm_device = f"{device} (HBM)" if self.cuda else "cpu (a CPU tensor stands in for HBM: no GPU)"
        table_bytes = sum(p.stat().st_size for p in self.paths)
        tiers = []
        asked = {"hbm": self._rows(hbm_capacity, "hbm_capacity"), "dram": self._rows(dram_capacity, "dram_capacity")}
        policies = {name: self._policy(spec) for name, spec in (("hbm", hbm_policy), ("dram", dram_policy))
                    if spec and asked[name]}
        # a tier that holds every row (the simulator's infinite cache) never fills slots past the
        # table's rows, so a larger capacity is clamped, not allocated; a set-associative policy
        # can evict before that (a full set) and keeps the capacity asked for
        holds = {name: policy.holds_every_key(asked[name], self.num_keys) for name, policy in policies.items()}
        hbm_rows, dram_rows = (min(rows, self.num_keys) if holds.get(name) else rows for name, rows in asked.items())
        if dram_rows and not dram_policy:
            raise CachelabError(f"dram_capacity {dram_capacity!r} needs a DRAM cache policy (dram_policy)")
        if dram_policy and dram_capacity is None:  # a capacity of 0 is no tier, for DRAM as for HBM
            raise CachelabError(f"dram_policy {getattr(dram_policy, 'name', dram_policy)!r} needs a dram_capacity "
                                "(0: no DRAM cache)")
        self.resident = backing == "hbm"  # the whole table in the compute device's memory
        if self.resident and ((hbm_policy and hbm_rows) or (dram_policy and dram_rows)):
            raise CachelabError(f"backing 'hbm' holds the whole table in the compute device's memory "
                                f"({self.hbm_device}): no row cache or DRAM cache goes in front of it; "
                                "give hbm_capacity=0 and no DRAM cache (`cachelab store bench --capacity 0`, "
                                "no --dram-capacity)")
        parts = {}  # what needs host memory, named by the argument and value that ask for it
        if dram_policy and dram_rows:
            parts[f"dram_capacity {dram_capacity!r} ({dram_rows:,} rows)"] = dram_rows * self.row_bytes
        if not self.cuda and hbm_policy and hbm_rows:
            parts[f"hbm_capacity {hbm_capacity!r} ({hbm_rows:,} rows, a CPU tensor)"] = hbm_rows * self.row_bytes
        if backing == "dram" or (self.resident and not self.cuda):
            parts[f"the table in memory (backing {backing!r})"] = table_bytes
        # a live store's policies are sized by the table's rows, not the capacity (docs/store.md): on
        # large tables on SSD these indexes, not the slots, are what outgrows the host
        for name, policy in policies.items():
            per_row = policy_bytes_per_row(Unbounded(policy) if holds[name] else policy, num_keys=1 << 16)
            parts[f"the {name} tier's index ({policy.name!r}, {per_row:g} B per table row)"] = \
                int(per_row * self.num_keys)
        id_dtype = np.dtype(np.int32 if self.num_keys < 2**31 - 1 else np.int64)  # the first-use map's
        if policies:
            parts[f"the first-use map ({id_dtype.itemsize} B per table row)"] = id_dtype.itemsize * self.num_keys
        host_need, free = sum(parts.values()), available_memory()
        if host_need > free:
            shown = ", ".join(f"{what} {nbytes:,} B" for what, nbytes in parts.items())
            raise CachelabError(f"capacity over the memory available: the tiers and table need {host_need:,} B of "
                                f"host memory ({shown}), {free:,} B are available (MemAvailable)")
        free = device_free(self.device) if self.cuda else 0
        if self.cuda and hbm_policy and hbm_rows and hbm_rows * self.row_bytes > free:
            raise CachelabError(f"hbm_capacity {hbm_capacity!r} = {hbm_rows * self.row_bytes:,} B is over the "
                                f"{free:,} B free on {device}")
        if self.cuda and self.resident and table_bytes > free:
            raise CachelabError(f"backing 'hbm': the table's {table_bytes:,} B are over the {free:,} B free on "
                                f"{device}")
        for name, rows in (("hbm", hbm_rows), ("dram", dram_rows)):
            if name in policies and rows:
                tiers.append(CacheTier(name, policies[name], asked[name], self.num_keys,
                                       tier_memory(name, rows, self.row_bytes, self.device)))
        self.tiers = tiers
        self.clamped = {t.name: {"asked": t.capacity, "rows": t.rows} for t in tiers if t.rows < t.capacity}
        self._hbm = tiers[0] if tiers and tiers[0].name == "hbm" else None
        self._dram = tiers[-1] if tiers and tiers[-1].name == "dram" else None
        self.backing = open_backing(backing, lay, self.paths, io_threads, io_submit, device)
        same_build(self.directory, self.manifest, self.backing)  # no build replaced the files while they were opened
        # no tier keeps a row and the rows are where the dequantiser runs: gathered straight to BF16
        self._fused = not tiers and not self.cuda and backing in ("dram", "hbm")
        # keys: the layout's fold; with the fused path, straight to page-table rows (a bijection
        # of the store's keys: dedup and counts are the same)
        self._key_base = self.backing.page_base * lay.rows_per_page if self._fused or self.resident else lay.layer_base
        if self._fused:  # the fold per head, once; what counts a step's distinct rows, reused
            *fold, self._inverse_size = lay.fold_heads(self._key_base)
            self._fold = np.stack(fold)  # one argument of the call, not four
            key_span = self.backing.pages.shape[0] << slot_bits(lay.rows_per_page)
            if key_span >= 1 << SEEN_KEY_BITS:
                raise CachelabError(f"{self.directory}: {self.backing.pages.shape[0]:,} pages of rows are over the "
                                    f"2^{SEEN_KEY_BITS} keys the fused lookup's set holds")
            # a bitmap of every key while it stays cache-sized, else a set sized by the step
            self._bitmap = key_span <= BITMAP_BYTES * 8
            self._seen = np.zeros(-(-key_span // 64) if self._bitmap else 0, np.int64)
            self._generation = 0
            self._keys = np.empty(0, np.int64)
        self._outputs = OutputPool()
        # id + 1 of each row seen (0: not yet), zero-filled so the OS maps only the pages of rows
        # in use: np.full(-1) wrote all 3.1 GB of the full V4.1 tables' map at open
        self._id_of = np.zeros(self.num_keys if tiers else 0, id_dtype)
        self._next_id = 0
        self._scored = 0  # the scorer's clock: distinct full-layout rows of the steps served with scores
        self.tier_names = tuple(t.name for t in tiers)
        self.totals = Counters(self.tier_names)
        self.last_step = Counters(self.tier_names)
        # where the fused step writes its counts: steps, requested, unique, backing rows, the bytes
        # of its link twice (host -> device and host reads; for 'hbm' HBM reads, one counter given
        # the same value twice), minor and major faults; all its seconds are dequant_s and step_s
        link = ("hbm_read_bytes",) * 2 if self.resident else ("host_to_device_bytes", "host_read_bytes")
        self._fused_counts = np.array([count_keys(()).index(k) for k in ("steps", "requested", "unique", "backing_rows",
                                                                         *link, "minor_faults", "major_faults")])
        self._fused_seconds = [TIME_KEYS.index("dequant_s"), TIME_KEYS.index("step_s")]
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()  # the totals': under _lock, a done prefetch's wait() waited a step
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="cachelab-store-prefetch")
        self._pending: Future | None = None
        self._closed = False
        self._unsettled = False  # a step is between its policies' steps and its end (``_serve``)
        self._bufs: dict = {}  # reused buffers by name: NumPy arrays, and torch tensors with CUDA
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None  # the steps' device work
        self._indices = IndexStaging(torch, self.device, self.cuda)  # a step's index arrays bound for the GPU
        # the CPU kernels' table on the device: its dequantiser looks the rows up in it (dequant_rows_torch)
        self._device_table = torch.from_numpy(DEQUANT_TABLE.view(np.int16).reshape(-1)).to(self.device) \
            if self.cuda else None

    @cached_property
    def source(self) -> RowSource:
        """The reference contents of the rows (the recompute, or the checkpoint built from)."""
        return RowSource.of_manifest(self.layout_tables, self.manifest)

    @classmethod
    def open(cls, directory, **kwargs) -> "TieredStore":
        """Open a built table directory (see the class for the arguments)."""
        return cls(directory, **kwargs)

    def _rows(self, capacity, where: str) -> int:
        if capacity in (None, 0, "0"):
            return 0
        return parse_capacity(capacity, where, TABLE_ROWS).rows(self.num_keys, self.row_bytes, where, TABLE_ROWS)

    @staticmethod
    def _policy(policy: Policy | str) -> Policy:
        return registry.make_policy(policy) if isinstance(policy, str) else policy

    def _number(self, uniq: np.ndarray) -> np.ndarray:
        """Each distinct row's id for the policies: rows numbered by first use, as the simulator's
        replay numbers them, so a policy that hashes its keys (``fbgemm-*``) decides alike."""
        ids = self._id_of[uniq].astype(np.int64) - 1
        new = np.flatnonzero(ids < 0)
        ids[new] = self._next_id + np.arange(new.size)
        self._id_of[uniq[new]] = ids[new] + 1
        self._next_id += new.size
        return ids

    def keys(self, row_ids) -> np.ndarray:
        """The store's keys (``layer_base + row`` of the scaled tables) of full-layout row ids."""
        return self.layout_tables.fold(row_ids)

    def _buf(self, name: str, rows: int, **torch_memory):
        """The first ``rows`` rows of a reused buffer of row bytes, grown by doubling: a NumPy
        array, or with ``torch_memory`` (``device=`` or ``pin_memory=``) a torch tensor."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows:
            shape = (max(rows, 1024, 0 if buf is None else 2 * buf.shape[0]), self.row_bytes)
            buf = self.torch.empty(shape, dtype=self.torch.uint8, **torch_memory) if torch_memory \
                else np.empty(shape, np.uint8)
            self._bufs[name] = buf
        return buf[:rows]

    # -- the step -------------------------------------------------------------------------------

    def lookup(self, row_ids, scores=None, out=None):
        """Rows of ``row_ids`` ([tokens, layers, columns] as the Addresser returns) as bfloat16
        ``[tokens, layers, columns, row_dim]`` in request order; ``scores`` (same shape as
        ``row_ids``) feed policies that need predictor scores. ``out``: a contiguous bfloat16
        tensor of that shape on the store's device to write the rows into (a caller reusing one
        saves allocating, and on the CPU first-touch faulting, 512 B per requested row)."""
        pending = self._pending
        if pending is not None:  # steps run in the order they were asked for; a prefetch's error
            wait_futures([pending])  # is its handle's, not this step's
        rows = self._step(row_ids, scores, out)[0]
        return self._hand_over(rows, self._caller_stream()) if self.cuda else rows

    def prefetch(self, row_ids, scores=None) -> PrefetchHandle:
        """Start the step for ``row_ids`` on the background thread; ``wait()`` on the handle."""
        self._check_open()
        row_ids = np.array(row_ids, copy=True)
        scores = None if scores is None else np.array(scores, copy=True)
        try:
            future = self._worker.submit(self._step, row_ids, scores)
        except RuntimeError:  # close() on another thread has shut the prefetch thread down
            raise self._closed_error() from None
        self._pending = future  # another thread may replace it before this returns: hand out our own
        return PrefetchHandle(future, self)

    def _add_stall(self, counters: Counters, seconds: float) -> None:
        with self._count_lock:
            counters["stall_s"] += seconds
            self.totals["stall_s"] += seconds

    def _caller_stream(self):
        """With CUDA, the current stream of the calling thread (None on the CPU)."""
        return self.torch.cuda.current_stream(self.device) if self.cuda else None

    def _hand_over(self, rows, stream):
        """Rows made on the store's stream, handed to the caller's: their memory is not reused
        until the work the caller queues on them is done."""
        if stream is not None:
            rows.record_stream(stream)
        return rows

    def _step(self, row_ids, scores, out=None):
        """One step under the lock. With CUDA it runs on the store's own stream, so its waits
        (``_clock``) hold the store's work only, never a forward pass the caller runs beside a
        prefetch; a caller's ``out=`` is written after what the caller queued before asking, waited
        for there (``_dequant``), not at the step's start, which held every stage's host work back."""
        if not self.cuda:
            return self._step_here(row_ids, scores, out)
        asked = self._caller_stream().record_event() if out is not None else None  # what it queued so far
        with self.torch.cuda.stream(self._stream):
            return self._step_here(row_ids, scores, out, asked)

    def _step_here(self, row_ids, scores, out, asked=None):
        with self._lock:
            self._check_open()
            c = Counters(self.tier_names)
            try:
                rows = self._serve(row_ids, scores, c, out, asked)
            except BaseException:  # a backing read error, an interrupt: see _serve
                try:
                    self._clock()  # with CUDA, its queued work done before the next step writes its buffers
                finally:
                    if self._unsettled:
                        for tier in self.tiers:
                            tier.clear()
                        self._unsettled = False
                raise
            with self._count_lock:
                self.last_step = c
                self.totals.add(c)
            return rows, c

    def _serve(self, row_ids, scores, c: Counters, out=None, asked=None):
        """One step. Its arguments are checked before any tier's policy steps; a step failing
        after that (``_unsettled``) leaves policies holding rows whose bytes never reached their
        slots, so ``_step_here`` empties the tiers: the steps after it serve correct rows from
        cold caches, and the failed step counts nothing (docs/store.md)."""
        if self._fused:
            return self._serve_fused(row_ids, scores, c, out)
        self._indices.begin()  # the last step ended waiting for its stream (``_clock``): no copy reads it
        now, clock = time.perf_counter, self._clock  # a host stage's clock, and a device stage's
        t0 = now()
        minor0, major0 = _faults()
        keys = self.layout_tables.fold(row_ids, base=self._key_base)
        shape = keys.shape
        if out is not None:
            self._output(shape, out)  # checked now, not once the tiers have stepped
        for tier in self.tiers:
            tier.check_scores(scores)
        inverse, uniq = compact(keys.reshape(-1))
        d_scores = d_made_at = None
        if scores is not None:
            scores = np.asarray(scores, dtype=np.float64)
            if scores.shape != shape:
                raise CachelabError(f"scores has shape {list(scores.shape)}, expected one per row id {list(shape)}")
            first = np.empty(uniq.size, np.int64)
            first[inverse[::-1]] = np.arange(inverse.size)[::-1]  # last write wins = first lookup
            d_scores = scores.reshape(-1)[first]
            if any(t.needs_scores for t in self.tiers):  # the tiers re-base them onto their policies' clocks
                d_made_at, self._scored = scorer_positions(row_ids, first, self._scored)
        n = uniq.size
        ids = self._number(uniq) if self.tiers else uniq
        raw = self.layout_tables.global_keys(uniq) if any(t.needs_raw_keys for t in self.tiers) else None
        d_counts = np.bincount(inverse, minlength=n) if any(t.needs_counts for t in self.tiers) else None
        t1 = now()
        c["dedup_s"] = t1 - t0
        # cache lookups: each tier sees the misses of the tier above
        hbm, dram = self._hbm, self._dram
        self._unsettled = bool(self.tiers)  # until the step is done: the policies step here
        if hbm is not None:
            hits0, slots0, res0 = hbm.lookup(ids, d_scores, d_counts, d_made_at, raw)
            hit_pos, miss_pos = np.flatnonzero(hits0), np.flatnonzero(~hits0)
        else:
            hit_pos, miss_pos = np.zeros(0, np.int64), np.arange(n, dtype=np.int64)
        keys1, ids1 = uniq[miss_pos], ids[miss_pos]
        m = keys1.size
        if dram is not None:
            hits1, slots1, res1 = dram.lookup(ids1, None if d_scores is None else d_scores[miss_pos],
                                              None if d_counts is None else d_counts[miss_pos],
                                              None if d_made_at is None else d_made_at[miss_pos],
                                              None if raw is None else raw[miss_pos])
            dram_hit, back = np.flatnonzero(hits1), np.flatnonzero(~hits1)
        else:
            dram_hit, back = np.zeros(0, np.int64), np.arange(m, dtype=np.int64)
        t2 = now()
        c["cache_lookup_s"] = t2 - t1
        if self.resident and self.cuda:  # the table in HBM: one gather there, nothing staged or copied
            h, written_hbm, file_bytes, pages = 0, 0, 0, 0
            out = self._dequant(self.backing.rows, uniq[inverse], shape, out, asked)  # uniq: the table's page rows
            t8 = clock()
            c["dequant_s"] = t8 - t2
        else:
            # host side: DRAM-cache hits and backing reads into the host staging buffer (with CUDA
            # pinned, its last copy done: the last step ended waiting for it, ``_clock``; on the CPU
            # the device rows themselves: with no device there is nothing to copy)
            h = hit_pos.size
            dev = self._device_rows(n)
            host = self._buf("host", m, pin_memory=True).numpy() if self.cuda else dev[h:h + m]
            if dram is not None:
                dram.gather(slots1, dram_hit, host)
            t3 = now()
            bk = keys1[back]
            layer = np.searchsorted(self.layer_base, bk, "right") - 1
            file_bytes, pages = self.backing.read(layer, bk - self.layer_base[layer], host, back)
            t4 = now()
            c["backing_read_s"] = t4 - t3  # a memory gather under dram, not an SSD read
            # device side: HBM hits, then the host rows copied after them
            if hbm is not None and h:
                hbm.gather(slots0, np.arange(h, dtype=np.int64), dev, self._indices)
            t5 = clock()
            self._copy(host, dev, h, m)
            t6 = clock()
            c["copy_s"] = t6 - t5
            new_pos = np.empty(n, np.int64)
            new_pos[hit_pos] = np.arange(h)
            new_pos[miss_pos] = h + np.arange(m)
            written_hbm = written_dram = 0
            if dram is not None:
                written_dram = dram.commit(res1, host, _positions(ids1, res1.admitted))
            if hbm is not None:
                written_hbm = hbm.commit(res0, dev, new_pos[_positions(ids, res0.admitted)], self._indices)
            t7 = clock()
            c["gather_s"] = (t3 - t2) + (t5 - t4) + (t7 - t6)
            out = self._dequant(dev, new_pos[inverse], shape, out, asked)
            t8 = clock()
            c["dequant_s"] = t8 - t7
        minor1, major1 = _faults()
        rb = self.row_bytes
        c["steps"], c["requested"], c["unique"] = 1, int(inverse.size), int(n)
        if hbm is not None:
            c["hbm_hits"], c["hbm_misses"] = int(h), int(m)
            c["hbm_admissions"], c["hbm_evictions"] = int(res0.admitted.size), int(res0.evicted.size)
            c["hbm_writes"] = written_hbm
        if dram is not None:
            c["dram_hits"], c["dram_misses"] = int(dram_hit.size), int(back.size)
            c["dram_admissions"], c["dram_evictions"] = int(res1.admitted.size), int(res1.evicted.size)
            c["dram_writes"] = written_dram
        c["backing_rows"] = int(back.size)
        c["ssd_pages_read"] = int(pages)
        c["ssd_to_dram_bytes"] = int(file_bytes)
        c["dram_to_hbm_bytes"] = written_hbm * rb
        c["host_to_device_bytes"] = int(m) * rb
        c["hbm_read_bytes"] = int(h) * rb
        c["host_read_bytes"] = int(dram_hit.size + (0 if self.backing.name == "direct" else back.size)) * rb
        if self.resident:  # every row gathered where it lives: nothing crosses the host link
            c["host_to_device_bytes"] = c["host_read_bytes"] = 0
            c["hbm_read_bytes"] = int(n) * rb
        c["minor_faults"], c["major_faults"] = minor1 - minor0, major1 - major0
        c["step_s"] = t8 - t0
        self._unsettled = False
        return out

    def _serve_fused(self, row_ids, scores, c: Counters, out=None):
        """No cache tier, no device, the table in host memory (``dram``, or ``hbm`` standing in on
        the CPU): the whole step (fold, count of distinct rows, gather and dequantise) is one
        compiled call, ``lookup_dequant``; its time is ``dequant_s``. What runs around it is
        what small steps pay per call (decode steps of a few tokens: tens of us, as much as
        their rows), so it is kept to the call's arguments, the fault counters and two array
        stores of the step's counters."""
        t0 = time.perf_counter()
        minor0, major0 = _faults()
        rows = np.ascontiguousarray(row_ids)
        if rows.dtype != INT64:  # 70 ns where the ids are int64, as the Addresser gives them
            rows = np.ascontiguousarray(integer_ids(rows))
        self.layout_tables.check_shape(rows)
        if scores is not None and np.shape(scores) != rows.shape:  # no policy here to use them
            raise CachelabError(f"scores has shape {list(np.shape(scores))}, expected one per row id {list(rows.shape)}")
        n = rows.size
        bits = 0  # the bitmap
        if not self._bitmap:
            bits = max(10, (2 * n - 1).bit_length())  # the set at most half full
            if self._seen.size < 1 << bits or self._generation + 1 == SEEN_GENERATIONS:
                self._seen, self._generation = np.zeros(max(self._seen.size, 1 << bits), np.int64), 0
            self._generation += 1
        res, address = self._output(rows.shape, out)
        if self._keys.size < n:
            self._keys = np.empty(max(n, 1024, 2 * self._keys.size), np.int64)
        distinct = lookup_dequant(rows.reshape(-1), self._fold, self._inverse_size, self.backing.pages, DEQUANT_TABLE,
                                  address, self.row_dim, self._seen, self._generation, bits, self._keys,
                                  work=2 * self.row_dim * n)
        if distinct < 0:
            self.layout_tables.out_of_range(rows, -1 - distinct)
        t1 = time.perf_counter()
        minor1, major1 = _faults()
        nbytes = distinct * self.row_bytes
        c.counts[self._fused_counts] = 1, n, distinct, distinct, nbytes, nbytes, minor1 - minor0, major1 - major0
        c.seconds[self._fused_seconds] = t1 - t0
        return res

    def _device_rows(self, n: int):
        return self._buf("device", n, device=self.device) if self.cuda else self._buf("device", n)

    def _clock(self) -> float:
        """The end of a stage that queued device work: with CUDA, after a wait for the store's stream,
        so its seconds hold that work, the stages add up to the step and the rows are complete when it
        returns. Host stages read ``time.perf_counter``: every step, a failed one too, ends waiting."""
        if self.cuda:
            self._stream.synchronize()
        return time.perf_counter()

    def _copy(self, host: np.ndarray, dev, h: int, m: int) -> None:
        """Host staging -> device rows ``[h, h + m)``: an asynchronous copy from pinned memory
        (on the CPU the staging is those rows: nothing to copy)."""
        if m and self.cuda:
            dev[h:h + m].copy_(self._bufs["host"][:m], non_blocking=True)

    def _output(self, shape, out):
        """The result tensor (``out`` checked, or a fresh CPU one from the pool of recycled
        outputs) and, on the CPU, the address of its memory for the kernels."""
        want = (*shape, self.row_dim)
        if out is None:
            return self._outputs.take(want)
        if (out.shape != want or out.dtype != self.torch.bfloat16 or out.device != self.device
                or not out.is_contiguous()):
            raise CachelabError(f"out= must be a contiguous bfloat16 tensor of shape {list(want)} on "
                                f"{self.device}, got {out.dtype} {list(out.shape)} on {out.device}")
        return out, None if self.cuda else out.data_ptr()  # viewed as an array it took 3.7 us

    def _dequant(self, dev, index: np.ndarray, shape, out=None, asked=None):
        """Rows ``dev[index]`` dequantised, in ``out`` if given; with CUDA ``out`` is written once
        the work the caller's stream held when the step was asked for (event ``asked``) is done."""
        torch, dim = self.torch, self.row_dim
        if not self.cuda:
            res = self._output(shape, out)[0]
            flat = res.view(torch.uint16).numpy().reshape(-1, dim)
            dequant_expand(dev, index, DEQUANT_TABLE, flat, work=flat.nbytes)
            return res
        rows = dev.index_select(0, self._indices(index))
        if out is None:
            return dequant_rows_torch(rows, dim, self._device_table).reshape(*shape, dim)
        return dequant_rows_torch(rows, dim, self._device_table, self._output(shape, out)[0],
                                  lambda: self._stream.wait_event(asked))

    def reset(self) -> None:
        """Start again as the store opened: both cache tiers emptied (their policies reset, which
        the conformance kit checks is a fresh policy's run), rows unnumbered, the scorer's clock
        and every counter and stage time at zero. The table stays read (``dram``) and the tiers
        allocated, so a run warmed up on the store (kernels compiled) counts as a fresh store's."""
        pending = self._pending
        if pending is not None:  # a prefetch asked for before runs first and counts in the old run
            wait_futures([pending])  # (its stall where its handle is waited: wait before the reset)
        with self._lock:
            self._check_open()
            for tier in self.tiers:
                tier.clear()
            self._id_of = np.zeros_like(self._id_of)  # fresh zero pages, as at open: not a write of every row
            self._next_id = self._scored = 0
            self.totals = Counters(self.tier_names)
            self.last_step = Counters(self.tier_names)

    def close(self) -> None:
        """Run the prefetches asked for, wait for a step under way on another thread, then let
        the tables go, even where the wait for the device raises (a CUDA error; they were held until
        the store was collected). A closed store refuses every step (an unmapped ``mmap`` table read
        nothing and handed back a stale buffer as rows); closing twice does nothing."""
        self._worker.shutdown()  # a prefetch's error stays its handle's
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._clock()  # with CUDA, no device work of a step cut short still uses the memory let go here
            finally:
                self._outputs.clear()
                self._bufs.clear()  # the memory goes now, not when the store is collected
                self._indices.close()
                for tier in self.tiers:
                    tier.memory = None
                self.backing.close()

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _closed_error(self) -> CachelabError:
        return CachelabError(f"the store on {self.directory} is closed")

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
