"""The store's CUDA branch run here, on CPU tensors: a store opened on the CPU is switched onto
the code it runs on a GPU (the HBM tier a torch tensor moved by index ops, a pinned staging
buffer copied to the device rows, the torch dequantiser, the resident table's gather) with
``torch.cuda``'s streams stood in by fakes that record what the step asks of them. What a GPU
alone can show (the copies' asynchrony, memory, timing) is tests/test_store_cuda.py's; this
finds the logic errors of that branch without one (four reviews found such errors by reading)."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest
import torch

from cachelab.errors import CachelabError
from cachelab.store import TieredStore, build_tables
from cachelab.store.backing import device_rows
from cachelab.store.bench import check_rows
from cachelab.store.kernels import DEQUANT_TABLE
from cachelab.store.staging import IndexStaging
from test_store import SCALE, full_rows


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    build_tables("deepseek-v4.1-flash", SCALE, d, seed=7, progress=False)
    return d


class FakeCuda:
    """``torch.cuda``'s streams: the current one per the ``stream`` context, and a log of the
    store's synchronisations, waits, allocations (with the stream current) and hand-overs."""

    def __init__(self):
        self.log, self.current = [], self.Stream("caller")
        self.pinned = []  # the host buffers allocated pinned (kept: no other allocation takes their memory)

    def Stream(self, name="store"):  # noqa: N802 (torch's name)
        cuda = self
        return types.SimpleNamespace(name=name, synchronize=lambda: cuda.log.append(("sync", name)),
                                     record_event=lambda: cuda.log.append(("event", name)) or ("event", name),
                                     wait_event=lambda event: cuda.log.append(("wait", name, event[1])))

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before


def on_cuda_branch(store: TieredStore, monkeypatch) -> FakeCuda:
    """``store`` (opened on the CPU) switched onto its CUDA branch."""
    cuda = FakeCuda()

    class Torch:  # the store's ``torch``: the real one, its CUDA streams faked, pinning logged
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, pin_memory=False, **kwargs):
            cuda.log.append(("empty", pin_memory, cuda.current.name))
            buf = torch.empty(*args, **kwargs)
            if pin_memory:
                cuda.pinned.append(buf)
            return buf

    Torch.cuda = cuda
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: cuda.log.append(("record", s.name)))
    store.torch, store.cuda, store._fused = Torch(), True, False
    store._stream = cuda.Stream()
    store._device_table = torch.from_numpy(DEQUANT_TABLE.view(np.int16).reshape(-1))
    store._indices = IndexStaging(store.torch, store.device, True)
    for tier in store.tiers:
        if tier.name == "hbm":  # a tensor, as on a GPU: moved by index ops, never by the host kernels
            tier.memory = torch.from_numpy(tier.memory)
    return cuda


@pytest.mark.parametrize("backing", ["dram", "mmap"])
def test_the_cuda_branch_returns_the_cpu_stores_rows_and_counts(tables, backing, monkeypatch):
    rng = np.random.default_rng(2)
    tiers = dict(backing=backing, hbm_policy="lru", hbm_capacity=300, dram_policy="s3fifo", dram_capacity="256KiB")
    with TieredStore.open(tables, **tiers) as gpu, TieredStore.open(tables, **tiers) as cpu:
        cuda = on_cuda_branch(gpu, monkeypatch)
        for step in range(4):
            rows = full_rows(rng, 40)
            if step == 2:  # the background thread's step
                got, want = gpu.prefetch(rows).wait(), cpu.lookup(rows)
            elif step == 3:  # into the caller's tensor, after the work the caller queued
                before = len(cuda.log)
                out = torch.empty((*rows.shape, 256), dtype=torch.bfloat16)
                copy = torch.Tensor.copy_  # out= is written by the dequantiser itself, never copied into
                monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: cuda.log.append(("copy", t.data_ptr()))
                                    or copy(t, *a, **k))
                got, want = gpu.lookup(rows, out=out), cpu.lookup(rows)
                monkeypatch.setattr(torch.Tensor, "copy_", copy)
                assert ("copy", out.data_ptr()) not in cuda.log and any(e[0] == "copy" for e in cuda.log[before:])
                step = cuda.log[before:]  # the wait for what the caller queued before asking (an event then)
                waited = step.index(("wait", "store", "caller"))  # is where out= is written: after every clock but one
                assert got.data_ptr() == out.data_ptr() and step.count(("wait", "store", "caller")) == 1
                assert step.index(("event", "caller")) < step.index(("sync", "store"))
                assert step[:waited].count(("sync", "store")) == 3 and step[waited:].count(("sync", "store")) == 1
            else:
                got, want = gpu.lookup(rows), cpu.lookup(rows)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and check_rows(gpu, rows, got) == 0
            # mmap's ssd_to_dram_bytes is the kernel's count of the whole process's reads: a module
            # imported from a cold page cache during one store's step counted there, not the other's
            counts = [k for k in cpu.last_step.to_dict() if not k.endswith(("_s", "_faults", "_ratio"))
                      and not (backing == "mmap" and k == "ssd_to_dram_bytes")]
            assert {k: gpu.last_step[k] for k in counts} == {k: cpu.last_step[k] for k in counts}
            assert isinstance(gpu.tiers[0].memory, torch.Tensor) and isinstance(gpu.tiers[1].memory, np.ndarray)
        assert gpu.totals["hbm_hits"] > 0 and gpu.totals["dram_hits"] > 0
    assert cuda.log[-1] == ("sync", "store")  # closed: no work left on its stream when its memory goes
    allocated = {(pinned, stream) for what, pinned, stream in (e for e in cuda.log if e[0] == "empty")}
    assert allocated <= {(True, "store"), (False, "store")} and (True, "store") in allocated  # pinned staging
    assert ("record", "caller") in cuda.log and ("sync", "store") in cuda.log


def host_to_device_copies(cuda: FakeCuda, monkeypatch) -> list[bool]:
    """Whether each asynchronous copy (``to``/``copy_`` with ``non_blocking``: the host -> device
    copies of the CUDA branch) reads a pinned buffer, logged as it is asked for."""
    copies, to, copy = [], torch.Tensor.to, torch.Tensor.copy_

    def pinned(t) -> bool:
        return any(p.data_ptr() <= t.data_ptr() and t.data_ptr() + t.nbytes <= p.data_ptr() + p.nbytes
                   for p in cuda.pinned)

    def logged_to(t, *args, non_blocking=False, **kwargs):
        if non_blocking:
            copies.append(pinned(t))
        return to(t, *args, non_blocking=non_blocking, **kwargs)

    def logged_copy(t, src, non_blocking=False):
        if non_blocking:
            copies.append(pinned(src))
        return copy(t, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "to", logged_to)
    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    return copies


@pytest.mark.parametrize("backing", ["dram", "hbm"])
def test_every_copy_to_the_device_reads_pinned_memory(tables, backing, monkeypatch):
    """A step's index arrays (the HBM row cache's slots and places, the dequantiser's row of each
    request, the resident table's rows) went to the GPU from NumPy's pageable memory: a synchronous
    copy, the host waiting, beside the rows' asynchronous one from the pinned staging. Each now
    crosses from a pinned buffer, as the rows do. (No GPU here: the fake logs what is pinned.)"""
    rng = np.random.default_rng(8)
    tiers = dict(backing="dram", hbm_policy="lru", hbm_capacity=300, dram_policy="lru", dram_capacity=400) \
        if backing == "dram" else dict(backing="hbm", hbm_policy=None)
    with TieredStore.open(tables, **tiers) as gpu, TieredStore.open(tables, **tiers) as cpu:
        if backing == "hbm":  # the table as DeviceTable holds it on a GPU: the pages' rows only
            table, lay = gpu.backing, gpu.layout_tables
            table.rows = device_rows([table.pages], table.pages.shape[0], lay.rows_per_page, lay.row_bytes,
                                     torch.device("cpu"))
            table.table = table.pages = None
        cuda = on_cuda_branch(gpu, monkeypatch)
        copies = host_to_device_copies(cuda, monkeypatch)
        for tokens in (40, 20_000, 40):  # the middle step outgrows the index buffer: a new one, pinned
            rows, before = full_rows(rng, tokens), len(copies)
            got, want = gpu.lookup(rows), cpu.lookup(rows)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            c = gpu.last_step  # the dequantiser's index; the rows; the hits' two indices; the admitted rows' two
            asked = 1 + (c["host_to_device_bytes"] > 0) + 2 * (c["hbm_hits"] > 0) + 2 * (c["hbm_writes"] > 0) \
                if backing == "dram" else 1
            assert len(copies) - before == asked
        assert all(copies), copies
        assert sum(p.dtype == torch.int64 for p in cuda.pinned) == 2  # the index buffer outgrown once
        if backing == "dram":
            assert gpu.totals["hbm_hits"] > 0 and gpu.totals["hbm_admissions"] > 0


def test_the_cuda_branch_gathers_the_resident_table(tables, monkeypatch):
    rng = np.random.default_rng(6)
    with TieredStore.open(tables, backing="hbm", hbm_policy=None) as gpu, \
            TieredStore.open(tables, backing="hbm", hbm_policy=None) as cpu:
        lay = gpu.layout_tables
        table = gpu.backing  # as DeviceTable holds it on a GPU: the pages' rows only
        table.rows = device_rows([table.pages], table.pages.shape[0], lay.rows_per_page, lay.row_bytes,
                                 torch.device("cpu"))
        table.table = table.pages = None
        cuda = on_cuda_branch(gpu, monkeypatch)
        for _ in range(2):
            rows = full_rows(rng, 50)
            before = len(cuda.log)
            got, want = gpu.lookup(rows), cpu.lookup(rows)
            assert cuda.log[before:].count(("sync", "store")) == 1  # the gather's: its host stages wait for nothing
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and check_rows(gpu, rows, got) == 0
            c = gpu.last_step
            assert c["hbm_read_bytes"] == c["unique"] * 264 and c["host_to_device_bytes"] == 0


def test_a_step_waits_for_its_stream_after_its_device_stages_only(tables, monkeypatch):
    """A step's stages that queue no device work (dedup, the policies, the host gathers and the
    backing read) read the clock without waiting for the store's stream: 4 waits a step, where
    each of the 9 stage clocks waited (the 5 host ones for nothing: every step ends waiting, a
    failed one too, so the stream is idle when the next begins). A step failing after its copy
    is queued waits for it before the error is raised: the next step's host writes go into the
    staging that copy reads."""
    rng = np.random.default_rng(4)
    tiers = dict(backing="dram", hbm_policy="lru", hbm_capacity=300, dram_policy="lru", dram_capacity=400)
    with TieredStore.open(tables, **tiers) as gpu, TieredStore.open(tables, **tiers) as cpu:
        cuda = on_cuda_branch(gpu, monkeypatch)
        for _ in range(3):
            rows = full_rows(rng, 40)
            before = len(cuda.log)
            got, want = gpu.lookup(rows), cpu.lookup(rows)
            assert cuda.log[before:].count(("sync", "store")) == 4
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert gpu.totals["hbm_hits"] > 0 and gpu.totals["dram_hits"] > 0
        copy, read, gather = gpu._copy, gpu.backing.read, gpu.tiers[1].gather

        def failed_copy(*args):
            copy(*args)
            cuda.log.append(("copy",))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def logged(what, fn):
            return lambda *args: cuda.log.append((what,)) or fn(*args)

        monkeypatch.setattr(gpu, "_copy", failed_copy)
        monkeypatch.setattr(gpu.backing, "read", logged("host write", read))
        monkeypatch.setattr(gpu.tiers[1], "gather", logged("host write", gather))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            gpu.lookup(full_rows(rng, 40))
        monkeypatch.setattr(gpu, "_copy", copy)
        rows = full_rows(rng, 40)
        got = gpu.lookup(rows)
        after = cuda.log[cuda.log.index(("copy",)):]
        assert after.index(("sync", "store")) < after.index(("host write",))
        assert check_rows(gpu, rows, got) == 0  # the tiers emptied by the failure: cold, and right


def test_close_lets_the_memory_go_when_the_wait_for_the_device_fails(tables, monkeypatch):
    """``close()`` waits for the store's stream before it lets the tiers' memory go; a CUDA error
    raised by that wait (an illegal address of an earlier step, say) skipped the release, and the
    store, already marked closed, never tried again: slots, staging and table held until it was
    collected."""
    store = TieredStore.open(tables, backing="dram", hbm_policy="lru", hbm_capacity=300, dram_policy="lru",
                             dram_capacity=400)
    on_cuda_branch(store, monkeypatch)
    store.lookup(full_rows(np.random.default_rng(3), 20))
    assert store._bufs and all(t.memory is not None for t in store.tiers)

    def failed():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    store._stream.synchronize = failed
    with pytest.raises(RuntimeError, match="illegal memory access"):
        store.close()
    assert store._bufs == {} and all(t.memory is None for t in store.tiers) and store.backing.buf is None
    store.close()  # closed: nothing more to let go, and no second wait
    with pytest.raises(CachelabError, match="is closed"):
        store.lookup(full_rows(np.random.default_rng(3), 5))
