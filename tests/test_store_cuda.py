"""The store on a GPU: the HBM row cache in device memory, pinned staging, the host -> device
copy and dequantisation by torch ops. Runs where torch sees CUDA (a lent device) and is skipped
elsewhere; on the CPU, tests/test_store.py runs the same tier logic with a CPU tensor."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from cachelab.store import TieredStore, build_tables
from cachelab.store.bench import PolicySpec, check_rows, replay_store
from cachelab.store.format import PAGE
from test_store import SCALE, full_rows, stream_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU)")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    build_tables("deepseek-v4.1-flash", SCALE, d, seed=7, progress=False)
    return d


@pytest.mark.parametrize("backing", ["dram", "mmap", "pread", "direct"])
def test_cuda_store_returns_the_cpu_stores_rows_and_counts(tables, backing):
    rng = np.random.default_rng(2)
    tiers = dict(backing=backing, hbm_policy="lru", hbm_capacity=300, dram_policy="s3fifo", dram_capacity="256KiB")
    with TieredStore.open(tables, device="cuda", **tiers) as gpu, TieredStore.open(tables, **tiers) as cpu:
        assert "cuda" in gpu.hbm_device and gpu.tiers[0].memory.is_cuda
        dram = gpu.tiers[1].memory  # host memory no DMA reads: never pinned (tier_memory)
        assert isinstance(dram, np.ndarray) and not torch.from_numpy(dram).is_pinned()
        for _ in range(6):
            rows = full_rows(rng, 40)
            got, want = gpu.lookup(rows), cpu.lookup(rows)
            assert got.is_cuda and got.dtype == torch.bfloat16
            assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
            assert check_rows(gpu, rows, got) == 0
            for key in ("unique", "hbm_hits", "dram_hits", "backing_rows", "host_to_device_bytes", "dram_to_hbm_bytes"):
                assert gpu.last_step[key] == cpu.last_step[key], key
            if gpu.last_step["hbm_misses"]:
                assert gpu.last_step["copy_s"] > 0  # the stage waits for its copy
        assert gpu.totals["hbm_hits"] > 0 and gpu.totals["dram_hits"] > 0


def test_cuda_prefetch_and_the_resident_table(tables):
    rng = np.random.default_rng(4)
    with TieredStore.open(tables, device="cuda", hbm_policy="lru", hbm_capacity=500) as store:
        for _ in range(3):
            rows = full_rows(rng, 20)
            assert check_rows(store, rows, store.prefetch(rows).wait()) == 0
    with TieredStore.open(tables, backing="hbm", hbm_policy=None, device="cuda") as store:
        assert store.backing.rows.is_cuda and store.backing.table is None  # the CPU's pages only
        rows = full_rows(rng, 50)
        assert check_rows(store, rows, store.lookup(rows)) == 0
        assert store.last_step["host_to_device_bytes"] == 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "fbgemm-lru"])
def test_cuda_store_bench_matches_the_simulator(tables, policy):
    stream = stream_of(np.random.default_rng(3), steps=6, tokens=30)
    out = replay_store(tables, stream, "direct", PolicySpec(policy, {}), 400, PolicySpec(policy, {}), 900,
                       device="cuda")
    assert out["mismatches"] == 0 and out["matches_simulator"], out["comparison"]
    assert "cuda" in out["hbm_device"]


def test_the_device_memory_a_store_takes_is_its_tiers_and_its_table(tables):
    """What the HBM row cache says it holds (``memory.nbytes``) is what it takes on the device:
    opened, the store holds its slots and the dequantiser's 128 KiB table (each rounded up to
    the caching allocator's 512 B), nothing else; closed and dropped, it holds nothing."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    store = TieredStore.open(tables, device="cuda", hbm_policy="lru", hbm_capacity=3000,
                             dram_policy="lru", dram_capacity=5000)
    slots = store.tiers[0].memory.nbytes
    assert slots == 3000 * 264 and torch.cuda.memory_allocated() - before == -(-slots // 512) * 512 + 65536 * 2
    store.lookup(full_rows(np.random.default_rng(1), 20))
    store.close()  # its slots and staging go at close, not when it is collected
    assert torch.cuda.memory_allocated() - before == 65536 * 2  # the dequantiser's table, held by the object
    del store
    gc.collect()
    assert torch.cuda.memory_allocated() == before


def test_memory_torch_keeps_cached_counts_as_free_for_a_stores_tier(tables):
    """A closed store's slots stay in torch's caching allocator for reuse, which the driver's
    free memory does not count: `store bench` opens a store for its warm-up, closes it, then
    opens the one it times, and a tier over half the GPU was refused at the second open. Here
    the GPU's memory is taken in blocks and given back to the cache, the driver's free memory
    then under the tier's 3.96 MB."""
    held = []
    for size in (1 << 30, 64 << 20, 512 << 10):  # the last from 2 MiB segments: under 2 MiB left to the driver
        while True:
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.cuda.OutOfMemoryError:
                break
    try:
        held.clear()  # cached by torch, not given back to the driver
        assert torch.cuda.mem_get_info()[0] < 15000 * 264
        with TieredStore.open(tables, device="cuda", hbm_policy="lru", hbm_capacity=15000) as store:
            rows = full_rows(np.random.default_rng(5), 10)
            assert store.tiers[0].memory.nbytes == 15000 * 264 and check_rows(store, rows, store.lookup(rows)) == 0
    finally:
        held.clear()
        torch.cuda.empty_cache()


def test_the_gpus_dequantiser_equals_the_cpu_kernel_for_every_scale_and_value():
    """Every (UE8M0 scale, E4M3 byte) pair dequantised on the GPU (torch's int32 index, its
    in-place OR, the table lookup there) gives the compiled CPU kernel's bits: NaN bytes, scale
    255, subnormal and overflowing products included (the store's rows hold none of these)."""
    from cachelab.store.kernels import DEQUANT_TABLE, dequant_expand, dequant_rows_torch

    packed = np.zeros((256, 264), np.uint8)
    packed[:, :256] = np.arange(256, dtype=np.uint8)[None]
    packed[:, 256:] = np.arange(256, dtype=np.uint8)[:, None]  # row s: every value at scale byte s
    want = np.empty((256, 256), np.uint16)
    dequant_expand(packed, np.arange(256), DEQUANT_TABLE, want, work=0)
    table = torch.from_numpy(DEQUANT_TABLE.view(np.int16).reshape(-1)).cuda()
    got = dequant_rows_torch(torch.from_numpy(packed).cuda(), 256, table)
    assert got.is_cuda and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.cpu().view(torch.int16).numpy().view(np.uint16), want)


def test_a_prefetch_does_not_wait_for_the_callers_stream(tables):
    """The store's steps run on its own stream: a prefetch started while the caller's stream is
    busy (a forward pass; here a kernel that spins about a second) completes before it."""
    rows = full_rows(np.random.default_rng(8), 20)
    with TieredStore.open(tables, device="cuda", hbm_policy="lru", hbm_capacity=500) as store:
        store.lookup(rows)  # warm: allocations and compilation out of the way
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles on the caller's stream
        got = store.prefetch(rows).wait()
        assert not torch.cuda.current_stream().query()  # the caller's spin still running
        assert check_rows(store, rows, got) == 0


def test_the_resident_table_is_built_once_on_the_device_and_complete(tables):
    """``--backing hbm`` copied the whole pages over, then reshaped them without their padding
    (a copy of a strided view): the table twice on the device at once (a table over half the
    free memory passed the store's check and died out of memory), the second copy queued on the
    default stream, which the store's own stream does not wait for. Now built in chunks straight
    into the rows, the device synchronised before the store uses them."""
    from cachelab.store.backing import DeviceTable
    from cachelab.store.build import open_tables

    layout, _, paths = open_tables(tables)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    table = DeviceTable(layout, paths, "cuda")
    rows_bytes = table.rows.numel()
    assert torch.cuda.max_memory_allocated() - before < rows_bytes + (64 << 20)  # was rows + the padded pages
    assert torch.cuda.current_stream().query()  # nothing left queued
    pages = table.rows.view(-1, layout.rows_per_page * layout.row_bytes).cpu().numpy()
    host = np.concatenate([np.fromfile(p, np.uint8)[PAGE:].reshape(-1, PAGE) for p in paths])
    assert np.array_equal(pages, host[:, :layout.rows_per_page * layout.row_bytes])
    table.close()


def test_out_on_the_device_the_store_was_opened_on(tables, monkeypatch):
    """A store opened on ``cuda`` (what ``--device auto`` gives) compared ``out.device``
    (``cuda:0``, a tensor's device always has its index) with ``torch.device('cuda')``: unequal,
    so every ``out=`` was refused as on another device."""
    rows = full_rows(np.random.default_rng(9), 10)
    with TieredStore.open(tables, device="cuda", hbm_policy="lru", hbm_capacity=300) as store:
        out = torch.empty((*rows.shape, 256), dtype=torch.bfloat16, device="cuda")
        copies, copy = [], torch.Tensor.copy_  # written by the dequantiser's lookup, not copied into
        monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: copies.append(t.data_ptr()) or copy(t, *a, **k))
        assert store.lookup(rows, out=out).data_ptr() == out.data_ptr() and out.data_ptr() not in copies
        monkeypatch.setattr(torch.Tensor, "copy_", copy)
        assert check_rows(store, rows, out) == 0
        assert torch.equal(out.view(torch.int16), store.lookup(rows).view(torch.int16))


def test_a_step_waits_for_the_device_four_times_and_a_failed_one_leaves_nothing_queued(tables, monkeypatch):
    """A step waits for its stream after its 4 device stages only (its 5 host stages waited for
    nothing: tests/test_store_cuda_branch.py has the order); a step failing with its copy queued
    waits for it before raising, so the next step's host writes never race that copy: its rows
    stay right. The waits counted on the real stream here, the rows on the real device."""
    rng = np.random.default_rng(10)
    with TieredStore.open(tables, device="cuda", hbm_policy="lru", hbm_capacity=300, dram_policy="lru",
                          dram_capacity=400) as store:
        waits, wait = [], store._stream.synchronize
        monkeypatch.setattr(store._stream, "synchronize", lambda: waits.append(1) or wait(), raising=False)
        for _ in range(3):
            rows = full_rows(rng, 40)
            del waits[:]
            assert check_rows(store, rows, store.lookup(rows)) == 0 and len(waits) == 4
        copy = store._copy

        def failed_copy(*args):
            copy(*args)
            torch.cuda._sleep(200_000_000)  # the copy and a spin behind it still queued when the step fails
            raise KeyboardInterrupt

        monkeypatch.setattr(store, "_copy", failed_copy)
        with pytest.raises(KeyboardInterrupt):
            store.lookup(full_rows(rng, 40))
        assert store._stream.query()  # waited for before the interrupt went on
        monkeypatch.setattr(store, "_copy", copy)
        for _ in range(2):
            rows = full_rows(rng, 40)
            assert check_rows(store, rows, store.lookup(rows)) == 0
