"""The live tiered store: table files, row-exact lookups through every backing, counts equal
to the simulator's, and clear errors on bad input. Tables are scaled (a few MB) so this stays fast."""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cachelab import registry
from cachelab.capacity import parse_capacity
from cachelab.engine.replay import replay
from cachelab.engine.tiers import Hierarchy, Tier
from cachelab.engram.config import get_preset
from cachelab.errors import CachelabError
from cachelab.store import TieredStore, build_tables, verify_tables
from cachelab.store.bench import PolicySpec, check_rows, replay_store
from cachelab.store.format import PAGE, TableLayout, read_manifest
from cachelab.store.kernels import DEQUANT_TABLE, dequant_expand
from cachelab.store.tier import policy_bytes_per_row
from cachelab.workload.compaction import compact_steps
from cachelab.workload.lookups import LookupStream, global_key, split_key
from llvm_checks import fresh_llvm, increfs_past_entry

SCALE = 2e-5  # ~7,700 rows per layer of the V4.1 layout, ~2 MB per file
CFG = get_preset("deepseek-v4.1-flash")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    build_tables("deepseek-v4.1-flash", SCALE, d, seed=7, progress=False)
    return d


def full_rows(rng, tokens: int, skew: float = 1.2) -> np.ndarray:
    """Full-layout row ids [tokens, layers, 24]: Zipf-skewed residues per head, so caches hit."""
    ranks = np.minimum(rng.zipf(skew, size=(tokens, len(CFG.layers), CFG.columns)), 10**6)
    residue = (ranks * 2654435761) % CFG.primes[None]
    return CFG.offsets[None] + residue


def stream_of(rng, steps: int, tokens: int) -> LookupStream:
    rows = full_rows(rng, steps * tokens)
    layer = np.broadcast_to(np.arange(len(CFG.layers))[None, :, None], rows.shape)
    keys = global_key(layer, rows).reshape(-1)
    return LookupStream(keys, np.arange(steps + 1) * tokens * len(CFG.layers) * CFG.columns, 264, CFG.layers)


def test_build_writes_headers_pages_and_verifies(tables):
    manifest = json.loads((tables / "manifest.json").read_text())
    lay = TableLayout(CFG, SCALE)
    assert manifest["table_rows"] == lay.table_rows.tolist()
    assert manifest["row_bytes"] == 264 and manifest["rows_per_page"] == 15
    for li, name in enumerate(manifest["files"]):
        assert (tables / name).stat().st_size == PAGE * (1 + -(-int(lay.table_rows[li]) // 15))
        assert (tables / name).read_bytes()[:8] == b"CLENGRAM"
    out = verify_tables(tables)
    assert out == {"rows_checked": int(lay.table_rows.sum()), "mismatches": 0}


def test_verify_finds_a_flipped_byte(tmp_path):
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    path = tmp_path / "layer14.tbl"
    data = bytearray(path.read_bytes())
    data[PAGE + 264 * 3 + 5] ^= 0x10  # row 3 of layer 14
    data[2 * PAGE + 264 * 2 + 7] ^= 0x01  # row 17
    path.write_bytes(bytes(data))
    where = {"file": "layer14.tbl", "layer": 14, "row": 3, "offset": PAGE + 264 * 3 + 5}
    assert verify_tables(tmp_path) == {"rows_checked": 816, "mismatches": 2, "first_mismatch": where}
    assert verify_tables(tmp_path, sample=1000)["first_mismatch"] == where  # sampled: every row of 408
    with pytest.raises(CachelabError, match="--sample must be at least 1 row per layer, got 0"):
        verify_tables(tmp_path, sample=0)  # checking nothing is not a pass


def test_verify_copies_each_rows_bytes_not_its_page(tables):
    """``verify`` copied each row's whole 4 KiB page and indexed its bytes with an int64 per byte:
    67 MB at peak for a layer of 7,704 rows (2 MB); on the 400 MiB tables at 2e-3, 2.5 GB of RSS
    and 52-62 s (now 0.65 GB and 3.8-4.8 s, load 5-9). It reads the rows' bytes alone."""
    import tracemalloc

    lay = TableLayout(CFG, SCALE)
    verify_tables(tables)  # compiled and imported before the count
    tracemalloc.start()
    try:
        assert verify_tables(tables)["mismatches"] == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * int(lay.table_rows.max()) * lay.row_bytes, peak


def test_fold_keeps_each_head_slice():
    lay = TableLayout(CFG, SCALE)
    rows = full_rows(np.random.default_rng(0), 50)
    keys = lay.fold(rows)
    lo = lay.layer_base[:, None] + lay.head_offsets
    assert np.all((keys >= lo[None]) & (keys < (lo + lay.head_rows)[None]))
    np.testing.assert_array_equal(lay.fold(CFG.offsets[None]), lo[None])  # residue 0 -> slice start
    layer = np.broadcast_to(np.arange(2)[None, :, None], rows.shape)
    np.testing.assert_array_equal(lay.fold(rows, layer), keys)  # the flat form agrees


def test_dequant_matches_torch_float8_for_every_scale_and_value():
    fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    want = (fp8[None, :] * torch.exp2(torch.arange(256, dtype=torch.float64) - 127)[:, None]).to(torch.bfloat16)
    got = torch.from_numpy(DEQUANT_TABLE.astype(np.int16)).view(torch.bfloat16)
    finite = ~torch.isnan(want)
    finite[255] = False  # UE8M0 255 is NaN
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.isnan(got[~finite]).all()
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (64, 264), dtype=np.uint8)
    out = np.empty((80, 256), np.uint16)
    index = rng.integers(0, 64, 80)
    dequant_expand(packed, index, DEQUANT_TABLE, out, work=0)
    expect = DEQUANT_TABLE[np.repeat(packed[index, 256:], 32, axis=1), packed[index, :256]]
    np.testing.assert_array_equal(out, expect)


def test_dequant_kernels_equal_the_table_for_every_scale_and_value():
    """The 16-bit vector path (scales 10..246), the table path (the rest), and the fused
    gather + dequantiser, bit for bit, on every (scale byte, FP8 byte) pair."""
    from cachelab.store.kernels import gather_dequant

    packed = np.zeros((256, 264), np.uint8)
    packed[:, :256] = np.arange(256, dtype=np.uint8)[None]
    packed[:, 256:] = np.arange(256, dtype=np.uint8)[:, None]  # row s: every value at scale byte s
    packed[7, 256:] = [0, 9, 10, 127, 246, 247, 255, 130]  # blocks of one row at different scales
    expect = DEQUANT_TABLE[np.repeat(packed[:, 256:], 32, axis=1), packed[:, :256]]
    index = np.arange(256)[::-1].copy()
    out = np.empty((256, 256), np.uint16)
    dequant_expand(packed, index, DEQUANT_TABLE, out, work=0)
    np.testing.assert_array_equal(out, expect[index])
    pages = np.zeros((18, PAGE), np.uint8)  # the same rows in the table file's page format
    rows = np.arange(256)
    pages.reshape(-1)[(rows // 15 * PAGE + rows % 15 * 264)[:, None] + np.arange(264)] = packed
    out[:] = 0
    gather_dequant(pages, rows, index, 15, DEQUANT_TABLE, out, work=0)
    np.testing.assert_array_equal(out, expect[index])


def test_the_devices_dequantiser_equals_the_table_for_every_scale_and_value():
    """The torch dequantiser a GPU runs (here on CPU tensors) gives the CPU kernels' bits for
    every (scale byte, FP8 byte) pair: UE8M0 255 is NaN, not +-inf, and the E4M3 NaN bytes
    the table's NaN, so a checkpoint's rows holding them pass the row check on a GPU."""
    from cachelab.store.kernels import dequant_rows_torch

    packed = np.zeros((257, 264), np.uint8)
    packed[:256, :256] = np.arange(256, dtype=np.uint8)[None]
    packed[:256, 256:] = np.arange(256, dtype=np.uint8)[:, None]
    packed[256, :256] = np.arange(256, dtype=np.uint8)
    packed[256, 256:] = [0, 255, 10, 127, 246, 247, 1, 254]  # a scale per block
    table = torch.from_numpy(DEQUANT_TABLE.view(np.int16).reshape(-1))
    got = dequant_rows_torch(torch.from_numpy(packed), 256, table)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (257, 256)
    expect = DEQUANT_TABLE[np.repeat(packed[:, 256:], 32, axis=1), packed[:, :256]]
    np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), expect)
    kernel = np.empty((257, 256), np.uint16)  # and the compiled kernel's, directly
    dequant_expand(packed, np.arange(257), DEQUANT_TABLE, kernel, work=0)
    np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), kernel)


_DEQUANT_PEAK = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from cachelab.store.kernels import DEQUANT_TABLE, dequant_rows_torch
rows = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (200_000, 264), dtype=np.uint8))
table = torch.from_numpy(DEQUANT_TABLE.view(np.int16).reshape(-1))
dequant_rows_torch(rows[:16], 256, table)  # torch's first-call allocations out of the way
given = torch.zeros((200_000, 256), dtype=torch.bfloat16) if sys.argv[2] == "out" else None  # touched: resident
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = dequant_rows_torch(rows, 256, table, **({} if given is None else {"out": given}))
assert given is None or out is given
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / out.nbytes)
"""


@pytest.mark.parametrize("into,limit", [("new", 4.5), ("out", 2.5)])
def test_the_devices_dequantiser_holds_one_index_per_value(into, limit):
    """``dequant_rows_torch`` (a GPU's dequantiser, every step) built three int32 tensors of one
    entry per value (the scales repeated per value, the values, their OR): a step's temporaries
    took twice the device memory they need. One index now, the scales ORed into it in place: on
    the CPU the resident set's peak rises by the output and that index, 3x the output (it was 6x).
    Given ``out=`` (a caller's tensor), the lookup writes into it: the peak rises by the index
    alone, 2x (the store's out= was a new output copied into the caller's, 3x)."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", _DEQUANT_PEAK, root, into], capture_output=True, text=True,
                         check=True)
    assert float(res.stdout) < limit, res.stdout


def test_dequant_lut_rows_with_a_scale_per_block_equal_the_table():
    """Rows whose eight blocks each have their own scale (the LUT path applies each block's
    exponent add; a row with one scale outside ``FAST_SCALES`` goes block by block), through
    both kernels, and the LUT row itself where the CPU has it."""
    from cachelab.store import kernels

    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (512, 264), dtype=np.uint8)
    packed[:, 256:] = rng.integers(kernels.FAST_SCALES[0], kernels.FAST_SCALES[1] + 1, (512, 8))
    packed[::7, 256 + rng.integers(0, 8, 74)] = rng.choice([0, 5, 9, 247, 250, 255], 74)  # some rows leave the LUT
    packed[1, :256] = np.arange(256)  # every FP8 byte, zeros and NaNs included
    expect = DEQUANT_TABLE[np.repeat(packed[:, 256:], 32, axis=1), packed[:, :256]]
    index = rng.permutation(512)
    out = np.zeros((512, 256), np.uint16)
    dequant_expand(packed, index, DEQUANT_TABLE, out, work=0)
    np.testing.assert_array_equal(out, expect[index])
    pages = np.zeros((35, PAGE), np.uint8)
    rows = np.arange(512)
    pages.reshape(-1)[(rows // 15 * PAGE + rows % 15 * 264)[:, None] + np.arange(264)] = packed
    out[:] = 0
    kernels.gather_dequant(pages, rows, index, 15, DEQUANT_TABLE, out, work=0)
    np.testing.assert_array_equal(out, expect[index])
    if kernels.HAS_VBMI:
        import numba

        @numba.njit
        def lut(src, out):
            for i in range(src.shape[0]):
                kernels._dequant_row_lut(src, i, 0, out, i)

        fast = np.all((packed[:, 256:] >= kernels.FAST_SCALES[0]) & (packed[:, 256:] <= kernels.FAST_SCALES[1]), axis=1)
        out[:] = 0
        lut(packed[fast], out[: fast.sum()])
        np.testing.assert_array_equal(out[: fast.sum()], expect[fast])


def test_prefetch_row_and_the_bench_references_copy_the_same_rows():
    """``benchmarks/bench_store.py``'s memcpy of the same rows (any prefetch distance) copies
    exactly the rows the gather does, and its bound counts 5 lines per 264-byte row."""
    import sys
    from pathlib import Path

    from cachelab.store.kernels import gather_pages

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_store import _copy_rows, _touch_rows, _write_output, best_parallelism, mlp_bound

    rng = np.random.default_rng(5)
    pages = rng.integers(0, 256, (40, PAGE), dtype=np.uint8)
    rows = rng.integers(0, 40 * 15, 300)
    want = np.zeros((300, 264), np.uint8)
    gather_pages(pages, rows, np.arange(300), want, 15, 264, work=0)
    np.testing.assert_array_equal(want[5], pages[rows[5] // 15, rows[5] % 15 * 264:][:264])
    for ahead in (0, 3, 8):
        got = np.zeros_like(want)
        _copy_rows(pages, rows, 15, 264, got, ahead)
        np.testing.assert_array_equal(got, want)
    out = np.zeros((7, 256), np.uint16)
    _write_output(out)  # every request's row written
    np.testing.assert_array_equal(out, np.arange(7)[:, None] + np.arange(256)[None])
    lines = np.arange(0, 264 + 63, 64).clip(max=263)
    assert _touch_rows(pages, rows, 15, 264) == int(want[:, lines].astype(np.int64).sum())
    bound = mlp_bound({"latency_ns": 200.0, "lines_in_flight": 20.0}, 264, 15)
    assert bound["lines_per_row"] == 5.0 and bound["ns_per_row"] == pytest.approx(50.0)
    runs = [{"array_bytes": 1, "ns_per_load_by_chains": {1: 200.0, 8: 30.0, 16: 10.0}},
            {"array_bytes": 1, "ns_per_load_by_chains": {1: 180.0, 8: 25.0, 16: 12.0}}]
    mp = best_parallelism(*runs)  # chain count by chain count, the faster run's figure
    assert mp["latency_ns"] == 180.0 and mp["fastest_ns_per_line"] == 10.0 and mp["lines_in_flight"] == 18.0


_HUGE_PAGES_OF = r"""
import os, re, sys
sys.path.insert(0, sys.argv[1])
import bench_store  # imports cli_numpy first: NumPy without its own huge-page advice, as the CLI runs
import numpy as np

def huge_kb(arr):  # AnonHugePages of the mapping that holds arr
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= arr.ctypes.data < hi:
            return int(re.search(r"AnonHugePages:\s+(\d+)", block).group(1))

plain, advised = np.empty(16 << 20, np.uint8), bench_store.huge_array(16 << 20)
plain.fill(1)
advised.fill(1)
print(os.environ.get("NUMPY_MADVISE_HUGEPAGE"), huge_kb(plain), huge_kb(advised))
"""


def test_the_gather_benchs_buffers_stand_on_huge_pages_as_the_table_does():
    """``benchmarks/bench_store.py`` runs NumPy as the command line does (no NumPy huge-page
    advice, since ``7468bf4``), while the store advises its DRAM table and outputs itself: the
    gather section's references (memcpy buffers, ``np.take``'s table, the latency chains over
    as many bytes as the tables) fell to 4 KiB pages and the candidates' table stayed on 2 MiB
    ones, so the ratios compared two page sizes. Every buffer of the section is advised alike."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    tree = ast.parse((bench / "bench_store.py").read_text())
    section = ("_steps_of", "_time_steps", "memory_parallelism", "dram_latency_ns")
    fresh = [f"{fn.name}: {ast.unparse(call.func)}" for fn in tree.body if isinstance(fn, ast.FunctionDef)
             and fn.name in section for call in ast.walk(fn) if isinstance(call, ast.Call)
             and ast.unparse(call.func) in ("np.empty", "np.zeros", "np.ones", "np.full", "torch.empty",
                                            "torch.zeros")]
    assert fresh == []
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("transparent huge pages are not in madvise mode here")
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    res = subprocess.run([sys.executable, "-c", _HUGE_PAGES_OF, str(bench)], capture_output=True, text=True, env=env,
                         check=True)
    setting, plain_kb, advised_kb = res.stdout.split()
    assert setting == "0" and int(plain_kb) == 0 and int(advised_kb) >= 2048


@pytest.mark.parametrize("work", [0, 1 << 40])  # the serial build, and the parallel one
@pytest.mark.parametrize("counter", ["set", "bitmap"])
def test_lookup_dequant_folds_counts_distinct_rows_and_dequantises_repeats(work, counter):
    """The fused step kernel: every request (repeats included) gets its folded row's BF16 bits,
    its key is the row's page and slot, the distinct count is the step's (in the set or in the
    bitmap, which is all zero again after every call), a later call counts rows an earlier call
    saw, and a row id outside its head is reported by its index with nothing written."""
    from cachelab.store import kernels

    rng = np.random.default_rng(11)
    first, primes = np.array([0, 100, 1 << 41], np.int64), np.array([100, 1 << 40, 70], np.int64)  # residues to 2^40
    size, key0 = np.array([7, 11, 5], np.int64), np.array([3, 10, 21], np.int64)  # 26 page-table rows in 2 pages
    pages = rng.integers(0, 256, (2, PAGE), dtype=np.uint8)
    packed = pages[:, :15 * 264].reshape(30, 264)
    inv = 1.0 / size
    assert kernels.slot_bits(15) == 4
    # the bitmap: 2 pages x 16 slots fit in word 0; more words than requests, so a call clears its own bits
    seen = np.zeros(1 << 10, np.int64)
    bits = 10 if counter == "set" else 0

    fold = np.stack([first, primes, key0, size])

    def call(rows, generation, keys, out):
        assert out.shape == (rows.size, 256) and out.flags.c_contiguous
        return kernels.lookup_dequant(rows.reshape(-1), fold, inv, pages, DEQUANT_TABLE, out.ctypes.data, 256, seen,
                                      generation, bits, keys, work=work)

    def step(tokens, generation):
        rows = first[None] + rng.integers(0, primes[None], (tokens, 3))
        keys = np.empty(rows.size, np.int64)
        out = np.zeros((rows.size, 256), np.uint16)
        distinct = call(rows, generation, keys, out)
        want = (key0[None] + (rows - first[None]) % size[None]).reshape(-1)
        np.testing.assert_array_equal(keys, want // 15 << 4 | want % 15)
        assert distinct == np.unique(want).size < want.size  # repeats in the step
        expect = DEQUANT_TABLE[np.repeat(packed[want, 256:], 32, axis=1), packed[want, :256]]
        np.testing.assert_array_equal(out, expect)
        assert counter == "set" or not seen.any()
        return rows

    a = step(40, 1)
    step(40, 2)
    b = a.copy()  # the same rows in a new generation: all distinct ones counted again
    keys = np.empty(b.size, np.int64)
    out = np.zeros((b.size, 256), np.uint16)
    assert call(b, 3, keys, out) == np.unique(keys).size
    for at, bad in (((5, 1), first[1] + primes[1]), ((0, 0), first[0] - 1), ((-1, 2), first[2] + primes[2])):
        c = b.copy()  # one past head 1's last row id; one before head 0's first; the last request's
        c[at] = bad
        out[:] = 0
        assert call(c, 4, keys, out) == -1 - np.ravel_multi_index(at, c.shape, mode="wrap")
        assert not out.any() and (counter == "set" or not seen.any())
    if counter == "bitmap":  # fewer words than requests: the call clears the whole bitmap
        seen = np.zeros(1, np.int64)
        step(40, 5)


def test_dequantisers_prefetch_their_output_rows_for_writing():
    """Each dequantising kernel prefetches the output rows it is about to write for ownership
    (``llvm.prefetch`` with rw = 1: x86's ``prefetchw``), and an output that starts inside a
    cache line (a caller's view) is still filled exactly."""
    import re

    from cachelab.store import kernels

    rng = np.random.default_rng(13)
    pages = rng.integers(0, 256, (3, PAGE), dtype=np.uint8)
    packed = pages[:, :15 * 264].reshape(45, 264)
    rows = rng.integers(0, 45, 30)
    uniq, inverse = np.unique(rows, return_inverse=True)
    expect = DEQUANT_TABLE[np.repeat(packed[rows, 256:], 32, axis=1), packed[rows, :256]]
    for work in (0, 1 << 40):  # the serial build, and the parallel one
        one = np.array([[0], [45], [0], [45]], np.int64)  # one head: first row, prime, first key, size
        for run in (lambda out: kernels.dequant_expand(packed, rows, DEQUANT_TABLE, out, work=work),
                    lambda out: kernels.gather_dequant(pages, uniq, inverse, 15, DEQUANT_TABLE, out, work=work),
                    lambda out: kernels.lookup_dequant(rows, one, 1.0 / one[3], pages, DEQUANT_TABLE, out.ctypes.data,
                                                       256, np.zeros(1 << 10, np.int64), 1, 10, np.empty(30, np.int64),
                                                       work=work)):
            out = np.zeros(rows.size * 256 + 33, np.uint16)[33:].reshape(rows.size, 256)  # 66 B into a line
            run(out)
            np.testing.assert_array_equal(out, expect)
    # the code itself (a fresh compile of the same source: the cached builds cannot be inspected)
    write = re.compile(r"llvm\.prefetch\.\w+\([^)]*, i32 1, i32 3, i32 1\)")
    for name in ("dequant_expand", "gather_dequant", "lookup_dequant"):
        irs = fresh_llvm(getattr(kernels, name).serial)
        assert irs and all(write.search(ir) for ir in irs), name


def test_dequantisers_take_no_reference_counts_per_row():
    """The dequantising kernels hand ``borrowed`` views to their inlined row helpers, so every
    ``NRT_incref`` of the compiled kernel is in its entry block, none in the loop over the
    requests (atomic increments and decrements per row: without them a step of the trace takes
    0.84-1.00x the time), and
    the views write the same bits as the reference, into an aligned and a misaligned output."""
    import numba

    from cachelab.compiled import borrowed
    from cachelab.store import kernels

    rng = np.random.default_rng(17)
    pages = rng.integers(0, 256, (3, PAGE), dtype=np.uint8)
    packed = pages[:, :15 * 264].reshape(45, 264)
    rows = rng.integers(0, 45, 40)
    uniq, inverse = np.unique(rows, return_inverse=True)
    one = np.array([[0], [45], [0], [45]], np.int64)
    expect = DEQUANT_TABLE[np.repeat(packed[rows, 256:], 32, axis=1), packed[rows, :256]]
    for skew in (0, 33):  # a 64-byte aligned output, and one that starts 66 B into a line
        base = np.zeros(rows.size * 256 + 64, np.uint16)
        at = (-base.ctypes.data // 2) % 32 + skew
        out = base[at:at + rows.size * 256].reshape(rows.size, 256)
        for run in (lambda: kernels.dequant_expand(packed, rows, DEQUANT_TABLE, out, work=0),
                    lambda: kernels.gather_dequant(pages, uniq, inverse, 15, DEQUANT_TABLE, out, work=0),
                    lambda: kernels.lookup_dequant(rows, one, 1.0 / one[3], pages, DEQUANT_TABLE, out.ctypes.data, 256,
                                                   np.zeros(1 << 10, np.int64), 1, 10, np.empty(rows.size, np.int64),
                                                   work=0)):
            out[:] = 0
            run()
            np.testing.assert_array_equal(out, expect)

    @numba.njit
    def view_sum(a):
        b = borrowed(a)
        b[0] += 1
        return b.sum()

    a = np.arange(5)
    assert view_sum(a) == 11 and a[0] == 1  # the same memory, written through the view
    for name in ("dequant_expand", "gather_dequant", "lookup_dequant"):
        build = getattr(kernels, name).serial
        assert increfs_past_entry(build) == [0] * len(build.signatures), name


def test_counters_by_name_summed_as_arrays():
    """Counters are read and written by name, a step is summed into a run as arrays, an unknown
    name is refused, and ``to_dict`` gives plain ints and floats (the metrics export keeps only
    those) in the order of the names, the hit ratio per tier after them."""
    from cachelab.store.counters import TIME_KEYS, Counters, count_keys

    run, step = Counters(("hbm",)), Counters(("hbm",))
    step["hbm_hits"], step["hbm_misses"], step["step_s"], step["minor_faults"] = 3, 1, 0.25, 7
    run.add(step)
    run.add(step)
    run["stall_s"] += 0.5
    assert run["hbm_hits"] == 6 and run["step_s"] == 0.5 and run["stall_s"] == 0.5 and run.hit_ratio("hbm") == 0.75
    d = run.to_dict()
    assert list(d) == [*count_keys(("hbm",)), *TIME_KEYS, "backing_read_s", "hbm_hit_ratio"]
    assert type(d["hbm_hits"]) is int and type(d["minor_faults"]) is int and type(d["step_s"]) is float
    assert d["minor_faults"] == 14 and d["hbm_hit_ratio"] == 0.75
    with pytest.raises(KeyError, match="no counter 'dram_hits'"):
        run["dram_hits"] = 1


def test_fused_lookup_counts_each_steps_distinct_rows(tables, monkeypatch):
    """The store's fused path (no tier, DRAM): repeated rows within a step come back in request
    order and count once; the next step, sharing rows with it, counts its own distinct rows;
    a larger step grows the set. Its fault counters are the process's getrusage over the step,
    each in its own slot: read here from a scripted count (this process's real one moves with
    any thread's faults: a major fault elsewhere during a step failed ``major_faults == 0``)."""
    import itertools

    import cachelab.store.store as store_module
    from cachelab.workload.compaction import compact

    reads = itertools.count()

    def faults():  # (minor, major) at the i-th read: a step, read before and after, sees (7, 3)
        i = next(reads)
        return 1000 + 7 * i, 3 * i

    monkeypatch.setattr(store_module, "_faults", faults)
    rng = np.random.default_rng(12)
    with TieredStore.open(tables, backing="dram", hbm_capacity=None) as store:
        assert store._fused
        a = full_rows(rng, 30, skew=1.05)
        for rows in (a, np.concatenate([a[10:], full_rows(rng, 10)]), full_rows(rng, 400)):
            got = store.lookup(rows)
            assert check_rows(store, rows, got) == 0
            distinct = compact(store.keys(rows).reshape(-1))[1].size
            c = store.last_step
            assert c["unique"] == c["backing_rows"] == distinct < c["requested"] == rows.size
            assert c["host_read_bytes"] == c["host_to_device_bytes"] == distinct * 264
            assert c["steps"] == 1 and c["hbm_read_bytes"] == 0 and (c["minor_faults"], c["major_faults"]) == (7, 3)
            assert c["dequant_s"] == c["step_s"] > 0 and c["dedup_s"] == c["gather_s"] == 0
        assert store.totals["steps"] == 3 and (store.totals["minor_faults"], store.totals["major_faults"]) == (21, 9)


@pytest.mark.parametrize("backing", ["dram", "mmap"])
def test_lookup_without_tiers_and_into_a_callers_tensor(tables, backing):
    """No cache tier (dram: the fused gather + dequantiser) and ``out=``: reference rows, the
    caller's tensor filled in place, a wrong one refused by name."""
    rng = np.random.default_rng(4)
    with TieredStore.open(tables, backing=backing, hbm_capacity=None) as store:
        rows = full_rows(rng, 30)
        assert check_rows(store, rows, store.lookup(rows)) == 0
        out = torch.empty((30, 2, 24, 256), dtype=torch.bfloat16)
        assert store.lookup(rows, out=out) is out and check_rows(store, rows, out) == 0
        assert store.last_step["backing_rows"] == store.last_step["unique"]
        with pytest.raises(CachelabError, match="out= must be a contiguous bfloat16"):
            store.lookup(rows, out=torch.empty((30, 2, 24, 256), dtype=torch.float32))


@pytest.mark.parametrize("hbm_capacity", [None, 50])  # the fused path, and a tier's
def test_fresh_outputs_reuse_dropped_memory_never_a_held_one(tables, hbm_capacity):
    """lookup's outputs come from recycled memory: a dropped one's pages serve a later step, a
    held one (or any view of it) is never written again."""
    rng = np.random.default_rng(8)
    with TieredStore.open(tables, backing="dram", hbm_capacity=hbm_capacity) as store:
        a_rows, b_rows = full_rows(rng, 40), full_rows(rng, 40)
        a = store.lookup(a_rows)
        a_ptr, a_copy = a.data_ptr(), a.clone()
        b = store.lookup(b_rows)
        assert b.data_ptr() != a_ptr and torch.equal(a, a_copy)
        view = a[1:]
        del a
        c = store.lookup(b_rows)  # a's memory is still held through its view
        assert c.data_ptr() != a_ptr and torch.equal(view, a_copy[1:]) and check_rows(store, b_rows, c) == 0
        c_ptr = c.data_ptr()
        del view, c
        assert store._outputs.held_bytes > 0
        d = store.lookup(a_rows)
        assert d.data_ptr() in (a_ptr, c_ptr) and check_rows(store, a_rows, d) == 0


@pytest.mark.parametrize("submit", ["io_uring", "threads"])
def test_direct_reads_through_io_uring_and_the_thread_pool(tables, submit):
    """Both submissions of ``direct`` return the reference rows; io_uring where the kernel has it."""
    rng = np.random.default_rng(5)
    try:
        store = TieredStore.open(tables, backing="direct", hbm_capacity=None, io_submit=submit, io_threads=8)
    except CachelabError as exc:  # io_uring disabled here (kernel, seccomp): the reason is the error
        assert submit == "io_uring" and "io_uring is not available" in str(exc)
        pytest.skip(str(exc))
    with store:
        assert store.backing.submission == submit
        rows = full_rows(rng, 60)
        assert check_rows(store, rows, store.lookup(rows)) == 0
        assert store.last_step["ssd_pages_read"] > 0
    with pytest.raises(CachelabError, match="unknown io submission 'aio'"):
        TieredStore.open(tables, backing="direct", hbm_capacity=None, io_submit="aio")


@pytest.mark.parametrize("backing", ["dram", "mmap", "pread", "direct"])
def test_lookup_returns_reference_rows_in_request_order(tables, backing):
    rng = np.random.default_rng(2)
    with TieredStore.open(tables, backing=backing, hbm_policy="lru", hbm_capacity=300, dram_policy="s3fifo",
                          dram_capacity="256KiB") as store:
        assert store.layout.name == "deepseek-v4.1-flash"
        for _ in range(4):
            rows = full_rows(rng, 40)
            got = store.lookup(rows)
            assert got.dtype == torch.bfloat16 and tuple(got.shape) == (40, 2, 24, 256)
            assert check_rows(store, rows, got) == 0
            c = store.last_step
            assert c["hbm_hits"] + c["hbm_misses"] == c["unique"] and c["requested"] == rows.size
            assert c["dram_hits"] + c["dram_misses"] == c["hbm_misses"] == c["host_to_device_bytes"] // 264
        assert store.totals["hbm_hits"] > 0 and store.totals["dram_hits"] > 0
        assert store.totals["steps"] == 4
        if backing == "direct":
            assert store.totals["ssd_pages_read"] > 0
        assert "CPU tensor" in store.hbm_device


@pytest.mark.parametrize("backing", ["dram", "direct"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "fbgemm-lru", "fbgemm-lfu"])
def test_counts_equal_the_simulators(tables, backing, policy):
    stream = stream_of(np.random.default_rng(3), steps=6, tokens=30)
    out = replay_store(tables, stream, backing, PolicySpec(policy, {}), 400, PolicySpec(policy, {}), 900)
    assert out["mismatches"] == 0 and out["rows_checked"] == stream.keys.size
    assert out["matches_simulator"], out["comparison"]
    assert out["comparison"]["hbm_hits"]["store"] > 0
    assert out["comparison"]["host_read_bytes"]["store"] > 0  # the DRAM cache's hits: compared for direct too


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), hbm=st.integers(1, 200), dram=st.integers(1, 400),
       tokens=st.integers(1, 12), policy=st.sampled_from(["lru", "s3fifo", "fifo", "clock", "arc", "fbgemm-lru", "fbgemm-lfu"]))
def test_counts_equal_the_simulators_for_any_capacities(tables, seed, hbm, dram, tokens, policy):
    stream = stream_of(np.random.default_rng(seed), steps=5, tokens=tokens)
    out = replay_store(tables, stream, "dram", PolicySpec(policy, {}), hbm, PolicySpec("lru", {}), dram)
    assert out["matches_simulator"] and out["mismatches"] == 0, out["comparison"]


def test_max_lookups_stops_at_the_budget_in_whole_tokens(tables):
    """--max-lookups ran on to the end of the step that reached it (480 lookups for 300 here, 1,000,032
    for 1,000,000 on the real stream); the step is now cut after its last whole token within the
    budget: exactly the budget where it is whole tokens of 48 rows, else the tokens under it."""
    stream = stream_of(np.random.default_rng(3), steps=4, tokens=5)  # steps of 5 tokens x 48 rows
    for budget, lookups, steps in ((336, 336, 2), (300, 288, 2), (240, 240, 1), (48, 48, 1), (10_000, 960, 4)):
        out = replay_store(tables, stream, "dram", PolicySpec("lru", {}), 100, max_lookups=budget)
        assert (out["lookups"], out["rows_checked"], out["steps"]) == (lookups, lookups, steps), budget
        assert out["matches_simulator"] and out["mismatches"] == 0, out["comparison"]
    with pytest.raises(CachelabError, match=r"--max-lookups 47 is less than one token's 48 rows"):
        replay_store(tables, stream, "dram", PolicySpec("lru", {}), 100, max_lookups=47)


def _replay_counts(store, stream, scores) -> dict:
    """``stream`` step by step through ``store`` (rows checked); the run's integer counters, less
    those the OS's state gives (faults, and what the kernel read into the page cache)."""
    per, tokens = int(stream.step_offsets[1]), int(stream.step_offsets[1]) // (len(CFG.layers) * CFG.columns)
    for s in range(stream.num_steps):
        rows = split_key(stream.keys[s * per:(s + 1) * per])[1].reshape(tokens, len(CFG.layers), CFG.columns)
        sc = None if scores is None else scores[s * per:(s + 1) * per].reshape(rows.shape)
        assert check_rows(store, rows, store.lookup(rows, sc)) == 0
    totals = store.totals.to_dict()
    kernels = ("minor_faults", "major_faults") + (("ssd_to_dram_bytes",) if store.backing.name in ("mmap", "pread")
                                                  else ())
    return {k: v for k, v in totals.items() if isinstance(v, int) and k not in kernels}


@pytest.mark.parametrize("backing", ["dram", "mmap", "pread", "direct", "hbm"])
def test_a_reset_store_counts_a_stream_as_a_freshly_opened_one(tables, backing):
    """``store bench`` warms its store up and resets it for the run (a dram table read once, not
    once per store): after another stream has run, ``reset`` leaves every counter and stage
    time at zero, and the stream again counts exactly as through a freshly opened store: hits,
    misses, admissions, evictions and bytes of each tier. The HBM tier's learned policy reads its
    scores on a clock that must restart, and the DRAM tier's set-associative policy hashes rows
    by their first-use numbers, which must restart too: the warm-up runs other rows first
    (``hbm``: no tier, the fused path)."""
    rng = np.random.default_rng(8)
    stream = stream_of(rng, steps=6, tokens=12)
    tiers = {} if backing == "hbm" else {
        "hbm_policy": registry.make_policy("learned-lfu", horizon=2048), "hbm_capacity": 200,
        "dram_policy": "fbgemm-lru", "dram_capacity": 600}
    scores = None if backing == "hbm" else -(compact_steps(stream.keys, stream.step_offsets)[0].inverse
                                             + 2048 * rng.random(stream.keys.size))
    with TieredStore.open(tables, backing=backing, **({"hbm_capacity": 0} | tiers)) as fresh:
        want = _replay_counts(fresh, stream, scores)
    if backing == "hbm":
        tiers["hbm_capacity"] = 0
    else:  # a fresh policy instance: the reset one must not lean on the first store's
        tiers["hbm_policy"] = registry.make_policy("learned-lfu", horizon=2048)
    with TieredStore.open(tables, backing=backing, **tiers) as store:
        other = stream_of(rng, steps=4, tokens=12)  # other rows first, numbered in another order
        _replay_counts(store, other, None if scores is None else -np.arange(other.keys.size, dtype=float))
        store.reset()
        assert not store.totals.counts.any() and not store.totals.seconds.any()
        assert not store.last_step.counts.any() and not store.last_step.seconds.any()
        assert _replay_counts(store, stream, scores) == want
    assert want["requested"] == stream.keys.size and want.get("hbm_evictions", 1) > 0
    assert want.get("dram_hits", 1) > 0 and want.get("dram_evictions", 1) > 0


def test_the_bench_reads_a_dram_table_once(tables, monkeypatch):
    """The bench warmed its kernels up on one store, closed it and opened another for the run:
    the whole table read twice under dram (minutes on a large table), the tiers allocated
    twice. One store now, reset after the warm-up: each table file is read once."""
    import cachelab.store.backing as backing_mod

    reads = []
    real = backing_mod._read_whole
    monkeypatch.setattr(backing_mod, "_read_whole", lambda path, *a: (reads.append(path.name), real(path, *a))[1])
    stream = stream_of(np.random.default_rng(3), steps=3, tokens=8)
    out = replay_store(tables, stream, "dram", PolicySpec("lru", {}), 200, PolicySpec("s3fifo", {}), 500)
    assert out["matches_simulator"] and out["mismatches"] == 0, out["comparison"]
    assert sorted(reads) == sorted(json.loads((tables / "manifest.json").read_text())["files"])


def _live_policies() -> list[str]:
    return sorted(n for n in registry.resolved(registry.POLICIES)
                  if not registry.make_policy(n).capabilities.needs_future)


@pytest.mark.parametrize("policy", _live_policies())
def test_every_registered_policy_counts_as_the_simulator_in_both_tiers(tables, policy):
    """Every registered policy a live store can run (all but those needing the future), learned
    ones scored, as a 60-row HBM row cache over a DRAM cache of its own kind larger than the
    stream's distinct rows: the store's counts equal the simulator's, every row its reference.
    (tests above hold seven policies to more capacities and streams.)"""
    rng = np.random.default_rng(4)
    stream = stream_of(rng, steps=4, tokens=12)
    out = replay_store(tables, stream, "dram", PolicySpec(policy, {}), 60, PolicySpec(policy, {}), 3000,
                       scores=rng.random(stream.keys.size))
    assert out["matches_simulator"] and out["mismatches"] == 0, out["comparison"]
    assert 0 < out["comparison"]["dram_hits"]["store"] and np.unique(stream.keys).size < 3000


def test_a_learned_tier_reads_the_keep_chance_the_scorer_gave_on_folded_tables(tables):
    """Scores are positions on the scorer's clock, the full-layout rows of each step (offline
    ``lookup_scores`` and the server's ``OnlineScorer`` alike); the store's policies count the
    folded table's rows, fewer where rows collide, and the DRAM tier only the HBM tier's misses.
    ``learned-lfu`` turned a score back into a keep chance on its own clock, so it read 0.75 as
    0.70 on average in HBM and 0.11 in DRAM here, and so did the simulator, which replayed the
    same drift (``matches_simulator`` held). Each tier gets its scores re-based onto its
    policy's clock now, and reads the chance given; the simulator still agrees."""
    rng = np.random.default_rng(0)
    steps, tokens, horizon = 60, 12, 4096
    stream = stream_of(rng, steps, tokens)
    position = compact_steps(stream.keys, stream.step_offsets)[0].inverse  # the scorer's clock
    scores = -(position + horizon * (1 - 0.75))
    policies = [registry.make_policy("learned-lfu", weight=1.0, horizon=horizon) for _ in range(2)]
    with TieredStore.open(tables, backing="dram", hbm_policy=policies[0], hbm_capacity=500, dram_policy=policies[1],
                          dram_capacity=2000) as store:
        per = stream.step_offsets[1]
        for s in range(steps):
            rows = split_key(stream.keys[s * per:(s + 1) * per])[1].reshape(tokens, len(CFG.layers), CFG.columns)
            store.lookup(rows, scores[s * per:(s + 1) * per].reshape(rows.shape))
        assert store.totals.to_dict()["unique"] < position[-1] + 1  # the fold merged rows: the clocks differ
        for tier in store.tiers:
            assert np.array_equal(np.unique(tier.policy.chance[tier.policy.count > 0]), [0.75]), tier.name
    spec = PolicySpec("learned-lfu", {"weight": 1.0, "horizon": horizon})
    out = replay_store(tables, stream, "dram", spec, 500, spec, 2000, scores=scores)
    assert out["matches_simulator"] and out["mismatches"] == 0, out["comparison"]


def test_a_learned_store_decides_as_the_simulator_on_the_folded_stream_with_the_same_predictions(tables):
    """The same predicted waits, handed to the store as positions on the full-layout rows' clock
    and to the engine's replay of the folded stream as positions on that stream's own clock: every
    tier hits exactly alike (not while the store's policies read the scores on their own clocks,
    by a drift that grows with the run: 10,282 HBM hits and 4,651 DRAM hits in the store against
    the replay's 10,275 and 4,631 here)."""
    rng = np.random.default_rng(5)
    steps, tokens, horizon = 60, 12, 4096
    stream = stream_of(rng, steps, tokens)
    wait = horizon * (1 - rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], stream.keys.size))
    position = compact_steps(stream.keys, stream.step_offsets)[0].inverse
    with TieredStore.open(tables, backing="dram", hbm_policy=registry.make_policy("learned-lfu", horizon=horizon),
                          hbm_capacity=500, dram_policy=registry.make_policy("learned-lfu", horizon=horizon),
                          dram_capacity=2000) as store:
        per = stream.step_offsets[1]
        folded = np.empty(stream.keys.size, np.int64)
        for s in range(steps):
            rows = split_key(stream.keys[s * per:(s + 1) * per])[1].reshape(tokens, len(CFG.layers), CFG.columns)
            store.lookup(rows, -(position + wait)[s * per:(s + 1) * per].reshape(rows.shape))
            folded[s * per:(s + 1) * per] = store.keys(rows).reshape(-1)
        totals = store.totals.to_dict()
    on_folded = compact_steps(folded, stream.step_offsets)[0].inverse  # the folded stream's own clock
    assert on_folded[-1] < position[-1]
    tiers = [Tier("hbm", registry.make_policy("learned-lfu", horizon=horizon), capacity_rows=500),
             Tier("dram", registry.make_policy("learned-lfu", horizon=horizon), capacity_rows=2000)]
    levels = replay(LookupStream(folded, stream.step_offsets, 264), Hierarchy(tiers, 264),
                    scores=-(on_folded + wait)).stats().to_dict()["levels"]
    assert (totals["hbm_hits"], totals["dram_hits"]) == (levels["hbm"]["served_unique"],
                                                         levels["dram"]["served_unique"])
    assert totals["hbm_hits"] > 0 and totals["dram_hits"] > 0


@pytest.mark.parametrize("policy", ["lru", "fbgemm-lru"])
def test_a_capacity_above_the_tables_rows_is_clamped_and_holds_every_row(tables, policy):
    """Past the table's rows a tier whose policy holds every row (no set of 100,000 rows' 3,125
    gets more than 32 of the 15,408) keeps only the table's rows of memory, the store says so,
    and it is the simulator's infinite cache."""
    num_keys = int(TableLayout(CFG, SCALE).num_keys)
    with TieredStore.open(tables, hbm_policy=policy, hbm_capacity=100_000, dram_policy="lru",
                          dram_capacity="100%") as store:
        assert [(t.capacity, t.rows, t.memory.shape[0]) for t in store.tiers] == [
            (100_000, num_keys, num_keys), (num_keys, num_keys, num_keys)]
        assert store.clamped == {"hbm": {"asked": 100_000, "rows": num_keys}}  # 100% is the table's rows
        rows = full_rows(np.random.default_rng(14), 40)
        assert check_rows(store, rows, store.lookup(rows)) == 0
    stream = stream_of(np.random.default_rng(15), steps=8, tokens=400)
    out = replay_store(tables, stream, "dram", PolicySpec(policy, {}), "100%")
    assert out["capacities"] == {"hbm": num_keys} and out["clamped_capacities"] == {}
    assert out["matches_simulator"] and out["mismatches"] == 0, out["comparison"]
    distinct = np.unique(TableLayout(CFG, SCALE).fold(full_rows(np.random.default_rng(15), 8 * 400))).size
    misses = out["comparison"]["hbm_misses"]["store"]
    # the table's rows hold the stream's 14,580 for LRU (each missed once, on its first use), not
    # for fbgemm-lru, whose 481 sets of 32 ways get up to 46 of them: conflict misses, in both
    assert out["simulator"]["levels"]["hbm"]["infinite"] == (policy == "lru") == (misses == distinct)


@pytest.mark.parametrize("policy", ["fbgemm-lru", "fbgemm-lfu"])
def test_a_set_associative_tier_past_the_streams_rows_misses_as_the_simulator(tables, policy):
    """Between the stream's 3,870 distinct rows and the table's 15,408 a set-associative tier
    still has conflict misses where more than 32 rows share a set (4,000 rows: 125 sets, the
    fullest with 47 of the stream's rows): the simulator runs the policy there too, not the
    infinite cache, and counts them as the store does; a capacity that fits them holds every
    row and gets the memory it asked for, not clamped."""
    stream = stream_of(np.random.default_rng(3), steps=6, tokens=30)
    distinct = np.unique(TableLayout(CFG, SCALE).fold(full_rows(np.random.default_rng(3), 6 * 30))).size
    conflicts = 0
    for capacity in (4_000, 4_400, 5_000, 20_000):
        out = replay_store(tables, stream, "dram", PolicySpec(policy, {}), capacity)
        assert out["matches_simulator"] and out["mismatches"] == 0, (capacity, out["comparison"])
        assert out["capacities"] == {"hbm": capacity} and out["clamped_capacities"] == {}
        misses = out["comparison"]["hbm_misses"]["store"]
        assert out["simulator"]["levels"]["hbm"]["infinite"] == (misses == distinct) == (capacity == 20_000)
        conflicts += misses - distinct
    assert distinct == 3_870 and conflicts > 0


def test_prefetch_returns_the_same_rows_and_reports_stall(tables):
    rng = np.random.default_rng(4)
    steps = [full_rows(rng, 20) for _ in range(3)]
    with TieredStore.open(tables, hbm_policy="lru", hbm_capacity=500) as a, \
            TieredStore.open(tables, hbm_policy="lru", hbm_capacity=500) as b:
        for rows in steps:
            handle = b.prefetch(rows)
            want = a.lookup(rows)
            got = handle.wait()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            assert handle.stall_seconds >= 0 and b.last_step["stall_s"] == handle.stall_seconds
        assert a.totals["hbm_hits"] == b.totals["hbm_hits"]


def test_two_threads_waiting_on_one_prefetch_count_its_stall_once(tables, monkeypatch):
    """Both threads blocked on one handle return; the step's ``stall_s`` (and the run's) is the
    one stall the handle reports, not the sum of both waits. Both threads are held, once they
    have their rows and before they record, until the other is there too: the race forced."""
    import types

    import cachelab.store.store as store_module

    barrier, calls = threading.Barrier(2), threading.local()

    def perf_counter():
        calls.n = getattr(calls, "n", 0) + 1
        if threading.current_thread().name.startswith("waiter") and calls.n == 2:
            try:  # the moment between the rows coming back and the stall being recorded
                barrier.wait(timeout=2)
            except threading.BrokenBarrierError:
                pass
        return time.perf_counter()

    clock = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}  # the module, perf_counter held
    monkeypatch.setattr(store_module, "time", types.SimpleNamespace(**{**clock, "perf_counter": perf_counter}))
    rows = full_rows(np.random.default_rng(6), 20)
    with TieredStore.open(tables, hbm_policy="lru", hbm_capacity=500) as store:
        handle = store.prefetch(rows)
        got = []
        waiters = [threading.Thread(target=lambda: got.append(handle.wait()), name=f"waiter-{i}") for i in range(2)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        assert len(got) == 2 and torch.equal(got[0].view(torch.int16), got[1].view(torch.int16))
        assert store.last_step["stall_s"] == handle.stall_seconds == store.totals["stall_s"]


def test_a_done_prefetch_is_waited_for_without_the_step_after_it(tables, monkeypatch):
    """Prefetching two steps ahead: the first's rows are back while the second runs on the
    prefetch thread. ``wait()`` on the first recorded its stall under the lock the second step
    holds, so it returned only once that step was done: the rows held back a whole step, and
    its stall counted the step after it."""
    rng = np.random.default_rng(12)
    with TieredStore.open(tables, hbm_policy="lru", hbm_capacity=300) as store:
        first = store.prefetch(full_rows(rng, 10))
        while not first.done():
            time.sleep(0.001)
        entered, release, read = threading.Event(), threading.Event(), store.backing.read

        def held(*args):  # the second step's backing read, held until the first's rows are back
            entered.set()
            release.wait(timeout=3)
            return read(*args)

        monkeypatch.setattr(store.backing, "read", held)
        second = store.prefetch(full_rows(rng, 10))
        assert entered.wait(timeout=10)
        t = time.perf_counter()
        rows = first.wait()
        waited, second_running = time.perf_counter() - t, not second.done()
        release.set()
        assert second_running and waited < 1.5 and first.stall_seconds < 1.5, waited
        second.wait()
        assert rows.shape[0] == 10 and store.totals["stall_s"] == first.stall_seconds + second.stall_seconds


class _PrefetchRace(TieredStore):
    """A store on which another thread's prefetch lands right after a prefetch records itself as
    the pending step, before its handle is made: a race under threads, forced."""

    @property
    def _pending(self):
        return self.__dict__["pending"]

    @_pending.setter
    def _pending(self, future):
        self.__dict__["pending"] = future
        rows, self.__dict__["theirs"] = self.__dict__.get("theirs"), None
        if future is not None and rows is not None:
            thread = threading.Thread(target=lambda: self.__dict__.setdefault("other", self.prefetch(rows)))
            thread.start()
            thread.join()


def test_a_prefetch_handle_waits_for_its_own_step_when_threads_prefetch(tables):
    rng = np.random.default_rng(8)
    mine, theirs = full_rows(rng, 2), full_rows(rng, 3)
    with _PrefetchRace.open(tables, backing="mmap", hbm_capacity=100) as store:
        store.__dict__["theirs"] = theirs
        got = store.prefetch(mine).wait()
        assert got.shape[0] == 2 and check_rows(store, mine, got) == 0
        assert store.__dict__["other"].wait().shape[0] == 3


@pytest.mark.parametrize("hbm_capacity", [100, None])
def test_a_failed_prefetch_fails_its_handle_not_the_next_lookups(tables, hbm_capacity):
    rng = np.random.default_rng(9)
    bad, good = full_rows(rng, 2), full_rows(rng, 2)
    bad[0, 0, 0] = -1
    with TieredStore.open(tables, backing="mmap", hbm_capacity=hbm_capacity) as store:
        handle = store.prefetch(bad)
        with pytest.raises(CachelabError, match="row id -1 is out of range"):
            handle.wait()
        for _ in range(2):
            assert check_rows(store, good, store.lookup(good)) == 0


@pytest.mark.parametrize("backing", ["mmap", "direct"])
def test_a_closed_store_refuses_steps_and_closes_once(tables, backing):
    rng = np.random.default_rng(10)
    store = TieredStore.open(tables, backing=backing, hbm_capacity=100)
    store.lookup(full_rows(rng, 2))
    store.close()
    for step in (store.lookup, store.prefetch):
        with pytest.raises(CachelabError, match="is closed"):
            step(full_rows(rng, 2))
    store.close()


def test_threads_prefetching_and_looking_up_the_same_rows_get_their_reference_rows(tables):
    """Steps from several threads at once, prefetches and lookups of the same hot rows through two
    small tiers (evictions every step, slots reused): every row returned equals its reference, and
    the counts are every step's (a step run beside another would gather a slot an eviction is
    overwriting, or count into the other's counters)."""
    requested, bad, errors = [], [], []

    def serve(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in range(30):
                rows = full_rows(rng, int(rng.integers(1, 12)))
                handle = store.prefetch(rows) if i % 2 else None
                other = full_rows(rng, 3)
                bad.append(check_rows(store, other, store.lookup(other)))
                bad.append(check_rows(store, rows, handle.wait() if handle else store.lookup(rows)))
                requested.extend((other.size, rows.size))
        except BaseException as exc:
            errors.append(exc)

    with TieredStore.open(tables, backing="pread", hbm_policy="lru", hbm_capacity=40, dram_policy="s3fifo",
                          dram_capacity=150) as store:
        threads = [threading.Thread(target=serve, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and sum(bad) == 0
        assert store.totals["steps"] == len(requested) and store.totals["requested"] == sum(requested)
        assert store.totals["hbm_evictions"] > 0 and store.totals["dram_evictions"] > 0


def test_a_prefetch_asked_while_another_thread_closes_the_store_is_refused_as_closed(tables, monkeypatch):
    """``close()`` shuts the prefetch thread down, waiting for the steps asked, before it marks the
    store closed: a ``prefetch`` from another thread in that wait (a step under way takes
    milliseconds on SSD) passed the closed check and died in the executor ('cannot schedule new
    futures after shutdown', a RuntimeError), not refused as a step on a closed store."""
    rng = np.random.default_rng(12)
    started, release = threading.Event(), threading.Event()
    with TieredStore.open(tables, backing="mmap", hbm_capacity=100) as store:
        serve = store._serve

        def held(*args):  # the step under way when close() is asked
            started.set()
            release.wait(10)
            return serve(*args)

        monkeypatch.setattr(store, "_serve", held)
        first = store.prefetch(full_rows(rng, 2))
        started.wait(10)
        closing = threading.Thread(target=store.close)
        closing.start()
        while not store._worker._shutdown:  # close() is in its wait for the step under way
            closing.join(0.001)
        try:
            with pytest.raises(CachelabError, match="is closed"):
                store.prefetch(full_rows(rng, 2))
        finally:
            release.set()
            closing.join(10)
        assert first.wait().shape[0] == 2  # the step asked before close() still ran


@pytest.mark.parametrize("backing, failure", [("pread", "truncated"), ("direct", "truncated"),
                                              ("dram", OSError(errno.EIO, "Input/output error")),
                                              ("mmap", KeyboardInterrupt())])
def test_a_step_failing_midway_leaves_the_store_serving_reference_rows(tmp_path, backing, failure):
    """A backing read failing after the policies had stepped left them holding rows whose bytes
    never reached a slot (and slots they had freed still mapped): the steps after it returned
    another row's bytes as a hit, or were refused for a hit the policy 'never admitted'. A step
    that fails midway now empties both caches and counts nothing; the steps after it serve
    their reference rows."""
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)  # 408 rows a layer
    rng = np.random.default_rng(17)
    steps = [full_rows(rng, 4) for _ in range(40)]
    path = tmp_path / "layer14.tbl"
    with TieredStore.open(tmp_path, backing=backing, hbm_policy="lru", hbm_capacity=40, dram_policy="s3fifo",
                          dram_capacity=90) as store:
        for rows in steps[:10]:
            assert check_rows(store, rows, store.lookup(rows)) == 0
        before, last = store.totals.to_dict(), store.last_step.to_dict()
        if failure == "truncated":  # a real short read: the file cut to its header, then restored
            data = path.read_bytes()
            os.truncate(path, PAGE)
            with pytest.raises(CachelabError, match="layer14.tbl: read of .* failed"):
                store.lookup(steps[10])
            path.write_bytes(data)  # in place: the store's descriptors see it again
        else:
            read = store.backing.read

            def fails_once(*args):
                store.backing.read = read
                if isinstance(failure, KeyboardInterrupt):  # ctrl-C once the rows were read
                    read(*args)
                raise failure

            store.backing.read = fails_once
            with pytest.raises(type(failure)):
                store.lookup(steps[10])
        assert store.totals.to_dict() == before and store.last_step.to_dict() == last  # nothing counted
        assert all(t.policy.resident().size == 0 and (t.slot_of < 0).all() for t in store.tiers)
        for rows in steps[10:]:
            assert check_rows(store, rows, store.lookup(rows)) == 0
        assert store.totals["steps"] == 40 and store.totals["hbm_hits"] > before["hbm_hits"]


def test_a_step_refused_for_its_arguments_changes_nothing(tables):
    """A step refused for scores its DRAM tier needs had already run the HBM tier's policy, and
    one refused for its ``out=`` had run and committed both: the store after them counted and
    held other rows than one never asked. Both are now refused before anything changes."""
    rng = np.random.default_rng(18)
    steps = [full_rows(rng, 6) for _ in range(8)]
    kwargs = dict(backing="dram", hbm_policy="lru", hbm_capacity=120, dram_policy="learned-s3fifo",
                  dram_capacity=300)
    with TieredStore.open(tables, **kwargs) as plain, TieredStore.open(tables, **kwargs) as refused:
        for rows in steps:
            scores = rng.random(rows.shape)
            with pytest.raises(CachelabError, match="needs predictor scores"):
                refused.lookup(rows)
            with pytest.raises(CachelabError, match="out= must be a contiguous bfloat16 tensor"):
                refused.lookup(rows, scores, out=torch.empty(1, dtype=torch.bfloat16))
            got = refused.lookup(rows, scores)
            assert torch.equal(got, plain.lookup(rows, scores)) and check_rows(refused, rows, got) == 0
        counts = [k for k in plain.totals.to_dict() if not k.endswith(("_s", "_faults", "_ratio"))]
        assert [refused.totals[k] for k in counts] == [plain.totals[k] for k in counts]


def test_no_cache_tiers_serve_from_the_backing(tables):
    rows = full_rows(np.random.default_rng(5), 10)
    with TieredStore.open(tables, backing="mmap", hbm_capacity=None) as store:
        assert check_rows(store, rows, store.lookup(rows)) == 0
        assert store.tiers == [] and store.last_step["backing_rows"] == store.last_step["unique"]


def test_hbm_backing_gathers_the_resident_table_on_its_device(tables):
    """Backing ``hbm``: the whole table one torch tensor on the compute device (the CPU here,
    its memory standing in for HBM), bit-exact reference rows, every row read from it and
    nothing over the host link; no cache tier may sit in front."""
    rows = full_rows(np.random.default_rng(6), 50)
    with TieredStore.open(tables, backing="hbm", hbm_policy=None) as store:
        table = store.backing.table
        assert isinstance(table, torch.Tensor) and table.device == store.device and store.tiers == []
        assert store.backing.nbytes == sum(p.stat().st_size - PAGE for p in store.paths)
        for _ in range(2):
            assert check_rows(store, rows, store.lookup(rows)) == 0
            c = store.last_step
            assert c["backing_rows"] == c["unique"] and c["hbm_read_bytes"] == c["unique"] * 264
            assert c["host_to_device_bytes"] == c["host_read_bytes"] == c["dram_to_hbm_bytes"] == 0
    with pytest.raises(CachelabError, match="backing 'hbm' holds the whole table"):
        TieredStore.open(tables, backing="hbm", hbm_policy="lru", hbm_capacity=300)


def test_device_rows_copies_the_pages_rows_a_chunk_at_a_time():
    """The GPU's resident table (``device_rows``), built on the CPU here: every page's rows
    without its tail padding, in order, through chunks that do not divide the pages (the GPU
    run, tests/test_store_cuda.py, checks its memory and stream)."""
    from cachelab.store.backing import device_rows

    pages = np.random.default_rng(3).integers(0, 256, (7, PAGE), dtype=np.uint8)
    got = device_rows((pages[:3], pages[3:6], pages[6:]), 7, 15, 264, torch.device("cpu"))
    assert got.shape == (105, 264) and got.is_contiguous()
    assert np.array_equal(got.numpy(), pages[:, :15 * 264].reshape(-1, 264))


def test_the_resident_tables_pages_reach_the_device_a_chunk_of_host_memory_at_a_time(tables):
    """On a GPU the ``hbm`` backing loaded the whole table into host memory first, which the
    store's check of host memory does not count there: a table over the host's memory died of
    it. The files are read a chunk at a time into one buffer (here onto the CPU: the same rows as
    the DRAM copy, with at most two chunks of NumPy memory at once)."""
    import tracemalloc

    from cachelab.store.backing import DramBacking, data_pages, device_rows, file_chunks
    from cachelab.store.build import open_tables

    layout, _, paths = open_tables(tables)
    pages, _ = data_pages(layout, len(paths))
    tracemalloc.start()
    try:
        got = device_rows(file_chunks(paths, pages, chunk_bytes=5 * PAGE), sum(pages), layout.rows_per_page,
                          layout.row_bytes, torch.device("cpu"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    host = DramBacking(layout, paths)
    used = layout.rows_per_page * layout.row_bytes
    assert sum(pages) > 100 and peak < 3 * 5 * PAGE
    assert np.array_equal(got.numpy(), host.pages[:, :used].reshape(-1, layout.row_bytes))
    host.close()


def test_the_dram_cache_is_unpinned_host_memory_of_its_capacity_on_any_device():
    """With CUDA the DRAM cache was pinned: no DMA reads it (its hits are gathered into the pinned
    staging), and torch's pinned allocator rounds a block up to a power of two, so 33 MB of
    cache locked 64 MB, past the store's check of host memory. Asked for a GPU here, it is made
    without touching CUDA (none here): plain host memory of exactly its rows."""
    from cachelab.store.tier import tier_memory

    mem = tier_memory("dram", 125_000, 264, torch.device("cuda", 0))
    assert isinstance(mem, np.ndarray) and mem.shape == (125_000, 264) and mem.nbytes == 33_000_000
    assert isinstance(tier_memory("hbm", 10, 264, torch.device("cpu")), np.ndarray)  # a stand-in, moved by the kernels


def test_a_tiers_host_memory_is_its_slot_map_and_its_host_slots():
    """A live point's ``row_cache.dram_bytes`` sums the tiers' host memory; with CUDA it left out
    the whole HBM row cache, whose slot map (4 B per table row) is host memory all the same."""
    from cachelab.store.tier import CacheTier

    on_gpu = CacheTier("hbm", registry.make_policy("lru"), 10, 1000, torch.empty((10, 264), dtype=torch.uint8))
    on_host = CacheTier("dram", registry.make_policy("lru"), 10, 1000, np.empty((10, 264), np.uint8))
    assert on_gpu.host_bytes == 4000 and on_host.host_bytes == 4000 + 2640


def test_free_device_memory_counts_what_torchs_allocator_keeps_unused(monkeypatch):
    """A store's slots on a GPU, once it is closed, stay in torch's caching allocator for reuse,
    which the driver counts as taken: checked by the driver's free memory alone, the second store
    of `store bench` (the first runs its warm-up) was refused a tier over half the GPU."""
    from cachelab.store.tier import device_free

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 45 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 << 30)
    assert device_free(torch.device("cuda", 0)) == 74 << 30


def test_a_store_on_cuda_names_its_device_with_the_index_tensors_carry(monkeypatch):
    """``torch.device('cuda') != torch.device('cuda:0')``, and a tensor's device always has its
    index: a store opened on ``cuda`` refused every ``out=`` made there. It keeps the current
    CUDA device's index (the GPU run, tests/test_store_cuda.py, passes an ``out=``)."""
    from cachelab.store.device import indexed_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed_device("cuda") == torch.device("cuda:1") and indexed_device("cuda:0") == torch.device("cuda:0")
    assert indexed_device("cpu") == torch.empty(0).device


def test_policy_state_per_table_row_is_measured():
    assert 4 < policy_bytes_per_row("lru") < 64


# -- bad input ---------------------------------------------------------------------------------

def test_missing_and_truncated_files_are_named(tmp_path):
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    path = tmp_path / "layer1.tbl"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CachelabError, match="layer1.tbl: truncated"):
        TieredStore.open(tmp_path)
    path.unlink()
    with pytest.raises(CachelabError, match="layer1.tbl: table file missing"):
        verify_tables(tmp_path)
    with pytest.raises(CachelabError, match="nowhere: no such table directory"):
        TieredStore.open(tmp_path / "nowhere")


def test_a_table_file_truncated_after_its_header_check_is_named_by_every_backing(tmp_path):
    """A file shorter than its header says once the store has checked it is named by every
    backing: ``dram`` and ``hbm`` loading it (not rows of the buffer's leftovers), ``mmap``
    mapping it and at every later step (a row past the end would be a SIGBUS), ``pread`` and
    ``direct`` reading past its end."""
    from cachelab.store.backing import open_backing
    from cachelab.store.build import open_tables

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    layout, _, paths = open_tables(tmp_path)
    path, full = paths[1], paths[1].stat().st_size  # layer14.tbl: 408 rows in 28 data pages
    short = full - PAGE  # the last data page (rows 405..407) gone
    last_row = full_rows(np.random.default_rng(16), 3)
    last_row[0, 1, 23] = CFG.offsets[1, 23] + 16  # the last head's 17th row: table row 407
    os.truncate(path, short)
    for name in ("dram", "hbm"):
        with pytest.raises(CachelabError, match=f"layer14.tbl: read of 4096 B at offset {short} failed"):
            open_backing(name, layout, paths)
    with pytest.raises(CachelabError, match=f"layer14.tbl: {short:,} B mapped, {full:,} B expected"):
        open_backing("mmap", layout, paths)
    for backing, at in (("mmap", None), ("pread", f"read of 264 B at offset {short + 2 * 264}"),
                        ("direct", f"read of 4096 B at offset {short}")):
        os.truncate(path, full)
        with TieredStore.open(tmp_path, backing=backing, hbm_capacity=None) as store:
            os.truncate(path, short)
            rows = CFG.offsets[None].copy() if at is None else last_row  # mmap: none on the lost page
            with pytest.raises(CachelabError, match=f"layer14.tbl: {at or f'truncated to {short:,} B under'}"):
                store.lookup(rows)


def test_a_file_truncated_between_its_header_check_and_verify_mapping_it_is_named(tmp_path, monkeypatch):
    """``verify`` mapped a file cut short after its header check and died of an IndexError."""
    from cachelab.store import build as build_mod

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    path = tmp_path / "layer14.tbl"
    full, check = path.stat().st_size, build_mod.check_header
    for short, why in ((full - PAGE, f"{full - PAGE:,} B mapped, {full:,} B expected"),
                       (100, f"cannot be mapped \\(.*\\), {full:,} B expected")):
        def then_cut(p, *args, short=short):
            out = check(p, *args)
            if p == path:
                os.truncate(path, short)
            return out

        monkeypatch.setattr(build_mod, "check_header", then_cut)
        os.truncate(path, full)
        with pytest.raises(CachelabError, match=f"layer14.tbl: {why}: the file changed since its header was checked"):
            verify_tables(tmp_path)


def test_a_second_build_into_a_directory_is_refused_while_one_writes_it(tmp_path, monkeypatch):
    """Two builds into one directory wrote the same ``.tmp`` files and could mix their layers;
    a reader beside a build reads the previous build, whole."""
    from cachelab.store import build as build_mod

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    fill, writing, go = build_mod.fill_pages, threading.Event(), threading.Event()

    def second_layer_waits(*args):  # the first build stops midway, its first layer written
        if args[1] == 1:
            writing.set()
            go.wait(60)
        return fill(*args)

    monkeypatch.setattr(build_mod, "fill_pages", second_layer_waits)
    first = threading.Thread(target=build_tables, args=("deepseek-v4.1-flash", 1e-6, tmp_path),
                             kwargs={"seed": 2, "progress": False})
    first.start()
    try:
        assert writing.wait(60)
        with pytest.raises(CachelabError, match=rf"`cachelab store build` \(pid {os.getpid()}\) is using {tmp_path} "
                           "now; wait for it to end"):
            build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=3, progress=False)
        assert verify_tables(tmp_path) == {"rows_checked": 816, "mismatches": 0}
        with TieredStore.open(tmp_path, backing="pread") as store:
            assert store.manifest["seed"] == 1
    finally:
        go.set()
        first.join()
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 2
    assert verify_tables(tmp_path)["mismatches"] == 0


@pytest.mark.parametrize("where", ["headers", "verify", "store"])
def test_files_a_build_replaced_while_a_reader_opened_them_are_refused(tmp_path, monkeypatch, where):
    """A build renaming its files in while a reader opened them gave the reader a mix of two
    builds: served as the manifest's rows (``verify``: every row a mismatch), or named damaged."""
    from cachelab.store import build as build_mod, store as store_mod

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    done = []

    def then_rebuild(real):
        def wrapped(*args):
            out = real(*args)
            if not done:  # once the reader has its manifest and the first header (or all of them)
                done.append(build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False))
            return out
        return wrapped

    module, name = {"headers": (build_mod, "check_header"), "verify": (build_mod, "open_tables"),
                    "store": (store_mod, "open_tables")}[where]
    monkeypatch.setattr(module, name, then_rebuild(getattr(module, name)))
    with pytest.raises(CachelabError, match="another `cachelab store build` replaced the tables while they were "
                       "being opened; open them again"):
        if where == "store":
            TieredStore.open(tmp_path, backing="mmap").close()
        else:
            verify_tables(tmp_path)
    monkeypatch.undo()
    assert verify_tables(tmp_path)["mismatches"] == 0  # opened again: the new build


def test_a_damaged_manifest_is_named_with_its_field(tmp_path):
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    path = tmp_path / "manifest.json"
    good = json.loads(path.read_text())
    for key, value, why in (("scale", "abc", "could not convert string to float: 'abc'"),
                            ("seed", "x", "seed 'x' is not an integer"),
                            ("source", {"kind": "safetensors"}, "source {'kind': 'safetensors'}: expected")):
        path.write_text(json.dumps({**good, key: value}))
        with pytest.raises(CachelabError, match=f"manifest.json: malformed manifest \\({why}"):
            verify_tables(tmp_path)
    path.write_text(json.dumps({**good, "version": 2}))  # a later format's build was read as version 1's
    for read in (verify_tables, TieredStore.open):
        with pytest.raises(CachelabError, match="manifest.json: table build version 2, this cachelab reads version 1"):
            read(tmp_path)


def test_wrong_row_size_or_layout_hash_is_refused(tmp_path):
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "a", progress=False)
    build_tables("deepseek-v4.1-flash", 2e-6, tmp_path / "b", progress=False)
    os.replace(tmp_path / "b" / "layer14.tbl", tmp_path / "a" / "layer14.tbl")  # another scale's file
    with pytest.raises(CachelabError, match="layer14.tbl: .*(layout hash|rows)"):
        verify_tables(tmp_path / "a")
    path = tmp_path / "b" / "layer1.tbl"
    data = bytearray(path.read_bytes())
    data[56:60] = (128).to_bytes(4, "little")  # the row bytes field
    path.write_bytes(bytes(data))
    with pytest.raises(CachelabError, match="row size 128 B, the layout needs 264 B"):
        TieredStore.open(tmp_path / "b")


def test_a_file_of_another_build_or_a_damaged_header_is_refused(tmp_path):
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "a", seed=1, progress=False)
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "b", seed=2, progress=False)
    (tmp_path / "a" / "layer1.tbl").write_bytes((tmp_path / "b" / "layer1.tbl").read_bytes())  # same layout
    with pytest.raises(CachelabError, match="layer1.tbl: rows of seed 2, the manifest's build has seed 1"):
        TieredStore.open(tmp_path / "a", backing="mmap")
    path = tmp_path / "b" / "layer14.tbl"
    data = bytearray(path.read_bytes())
    data[2000] = 0x5A  # the header page's padding
    path.write_bytes(bytes(data))
    with pytest.raises(CachelabError, match="layer14.tbl: header byte 2000 is 0x5a, a build writes 0x00"):
        verify_tables(tmp_path / "b")


def test_a_build_never_overwrites_a_manifest_it_did_not_write(tmp_path):
    """A directory holding a ``cachelab train`` model (its manifest.json seals its files) or any
    other manifest.json is refused by name before anything is written; readers refuse it too."""
    from cachelab.learning.predictor import read_sealed, seal

    model = tmp_path / "model"
    model.mkdir()
    (model / "metadata.json").write_text(json.dumps({"predictor": "lgbm"}))
    (model / "model.txt").write_text("tree\n")
    seal(model)  # what `cachelab train` writes last
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with pytest.raises(CachelabError, match=r"model/manifest.json: not the manifest of a table build \(a `cachelab "
                       r"train` model's manifest.*it wrote nothing"):
        build_tables("deepseek-v4.1-flash", 1e-6, model, progress=False)
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before and read_sealed(model)
    with pytest.raises(CachelabError, match="manifest.json: not the manifest of a table build"):
        TieredStore.open(model)
    (model / "manifest.json").write_text("[1, 2")
    with pytest.raises(CachelabError, match="manifest.json: not valid JSON.*it wrote nothing"):
        build_tables("deepseek-v4.1-flash", 1e-6, model, progress=False)
    (model / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(CachelabError, match="manifest.json: not the manifest of a table build \\(format 'other'"):
        build_tables("deepseek-v4.1-flash", 1e-6, model, progress=False)
    assert sorted(p.name for p in model.iterdir()) == ["manifest.json", "metadata.json", "model.txt"]
    for seed in (-1, 1 << 64):  # the header holds 8 bytes
        with pytest.raises(CachelabError, match=f"--seed must be in \\[0, 2\\^64\\), got {seed}"):
            build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "t", seed=seed, progress=False)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("hbm_capacity", [10, None])
def test_row_ids_that_are_not_integers_are_refused(tables, hbm_capacity):
    """Float ids were truncated to the row below (a row id + 0.5 served that row, no error), and
    booleans read as rows 0 and 1."""
    with TieredStore.open(tables, hbm_capacity=hbm_capacity) as store:
        rows = full_rows(np.random.default_rng(6), 2)
        with pytest.raises(CachelabError, match=fr"row ids must be integers, got dtype float64 \(e.g. {rows[0, 0, 0]}.5\)"):
            store.lookup(rows + 0.5)
        with pytest.raises(CachelabError, match="row ids must be integers, got dtype bool"):
            store.lookup(rows > 0)
        with pytest.raises(CachelabError, match="row ids must be integers"):
            store.keys(rows.astype(np.float32))
        assert check_rows(store, rows, store.lookup(rows.astype(np.uint32))) == 0
        huge = rows.astype(np.uint64)
        huge[1, 0, 3] = 2 ** 64 - 5  # as int64, -5: it was reported as row id -5
        with pytest.raises(CachelabError, match=f"row id {2 ** 64 - 5} is out of range: row ids are below 2"):
            store.lookup(huge)
        assert store.lookup(np.zeros((0, 2, 24))).shape == (0, 2, 24, CFG.row_dim)  # nothing to read: any dtype


@pytest.mark.parametrize("hbm_capacity", [10, None])  # a tier, and the fused path (page-table rows)
def test_row_id_out_of_range_and_capacity_over_memory(tables, hbm_capacity, monkeypatch):
    with TieredStore.open(tables, hbm_capacity=hbm_capacity) as store:
        rows = full_rows(np.random.default_rng(6), 2)
        rows[1, 0, 5] = CFG.offsets[0, 6]  # the next head's first row: outside head 5
        # the place named as token, layer and column (it was numpy's repr: "(np.int64(1), np.int64(0), ...)")
        with pytest.raises(CachelabError, match=fr"row id {CFG.offsets[0, 6]} is out of range for its head of layout "
                                                fr"'deepseek-v4.1-flash' \(token 1, table layer 0 \(layer id 1\), column "
                                                fr"5: rows {CFG.offsets[0, 5]} to {CFG.offsets[0, 6] - 1}\)"):
            store.lookup(rows)
        with pytest.raises(CachelabError, match=r"must be \[tokens, 2, 24\]"):
            store.lookup(rows[:, :1])
    with TieredStore.open(tables, hbm_capacity=10, dram_policy="lru", dram_capacity=0) as store:
        assert [t.name for t in store.tiers] == ["hbm"], "a DRAM capacity of 0 is no DRAM tier, as for HBM"
    from cachelab.store import store as store_mod

    monkeypatch.setattr(store_mod, "available_memory", lambda: 1 << 20)  # a capacity is at most the table's rows
    with pytest.raises(CachelabError, match=r"capacity over the memory available: the tiers and table need 4,206,384 B "
                                            r"of host memory \(hbm_capacity '64TiB' \(15,408 rows, a CPU tensor\) "
                                            r"4,067,712 B, the hbm tier's index \('lru', 5 B per table row\) 77,040 B, "
                                            r"the first-use map \(4 B per table row\) 61,632 B\), 1,048,576 B are "
                                            r"available"):
        TieredStore.open(tables, backing="mmap", hbm_capacity="64TiB")  # 15,408 rows of 264 B
    with pytest.raises(CachelabError, match=r"need 5,057,680 B of host memory \(dram_capacity 2000 \(2,000 rows\) "
                                            r"528,000 B, hbm_capacity 10 \(10 rows, a CPU tensor\) 2,640 B, the table "
                                            r"in memory \(backing 'dram'\) 4,218,880 B, the hbm tier's index "
                                            r"\('lru', 8 B per table row\) 123,264 B, the dram tier's index \('lru', 8 B "
                                            r"per table row\) 123,264 B, the first-use map \(4 B per table row\) "
                                            r"61,632 B\)"):  # which of them: unsaid
        TieredStore.open(tables, backing="dram", hbm_capacity=10, dram_policy="lru", dram_capacity=2000)
    with pytest.raises(CachelabError, match="dram_policy 'lru' needs a dram_capacity"):
        TieredStore.open(tables, hbm_capacity=10, dram_policy="lru")
    with pytest.raises(CachelabError, match="dram_capacity 100 needs a DRAM cache policy"):
        TieredStore.open(tables, hbm_capacity=10, dram_capacity=100)


def test_a_store_capacity_error_says_a_share_counts_the_tables_rows(tables, tmp_path):
    """The store resolves a share ('1%', 0.01) against the table's rows (it has no workload to
    count); its capacity errors said 'a fraction of the distinct rows', the simulator's meaning,
    at the API, in `store bench` and `store page-cache`, and in `serve`'s cache flags."""
    from typer.testing import CliRunner

    from cachelab.cli import app
    from cachelab.live.launch import ServeOptions, open_rows

    forms = "write rows (1000), a fraction of the table's rows (0.01), a percentage of them ('5%')"
    with pytest.raises(CachelabError, match=re.escape(f"hbm_capacity: '0.5x' is not a capacity; {forms}")):
        TieredStore.open(tables, hbm_capacity="0.5x")
    with TieredStore.open(tables, hbm_capacity="1%", hbm_policy="lru") as store:
        assert store.tiers[0].capacity == round(store.num_keys / 100)  # what the message says
    stream = stream_of(np.random.default_rng(10), steps=2, tokens=4).save(tmp_path / "s.npz")
    for verb, flag in (("bench", "--dram-capacity"), ("bench", "--capacity"), ("page-cache", "--capacity")):
        args = ["store", verb, "--dir", str(tables), "--trace", str(stream), flag, "1x"]
        args += ["--policy", "lru", "--capacity", "10"] if verb == "bench" and flag != "--capacity" else \
            ["--policy", "lru", "--backing", "dram"] if verb == "bench" else []
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and f"{flag}: '1x' is not a capacity; {forms}" in " ".join(res.output.split()), \
            (args, res.output)
    share = "'150%': a share of the table's rows must be in (0%, 100%]"  # it said 'a share must be in', of what unsaid
    with pytest.raises(CachelabError, match=re.escape(f"hbm_capacity: {share}")):
        TieredStore.open(tables, hbm_capacity="150%")
    res = CliRunner().invoke(app, ["store", "bench", "--dir", str(tables), "--trace", str(stream), "--capacity", "150%"])
    assert res.exit_code == 2 and f"--capacity: {share}" in " ".join(res.output.split()), res.output
    with pytest.raises(CachelabError, match=re.escape(f"--dram-cache-capacity: {share}")):
        open_rows(ServeOptions(store=tables, dram_cache_capacity="150%"), "deepseek-v4.1-flash")
    with pytest.raises(CachelabError, match=re.escape(f"--row-cache-capacity: '1x' is not a capacity; {forms}")):
        open_rows(ServeOptions(store=tables, row_cache_capacity="1x"), "deepseek-v4.1-flash")
    with pytest.raises(CachelabError, match=re.escape("'1x' is not a capacity; write rows (1000), a fraction of the "
                                                      "distinct rows (0.01)")):  # the simulator's share: unchanged
        parse_capacity("1x", "--capacity")


def test_the_policies_index_counts_against_the_memory_available(tables, monkeypatch):
    """A live store sizes each tier's policy state and slot map by the table's rows (5-40 B a row
    per tier, and a 4-B first-use map), not by its capacity: on the full V4.1 tables (768 M rows)
    behind ``mmap``, an LRU HBM tier and an S3-FIFO DRAM tier of a few thousand rows need 22 GB
    of index. The check against MemAvailable counted the slots alone, so such a store passed it
    and was killed, or died of a MemoryError, allocating its index; the index now counts, each
    part named."""
    from cachelab.store import store as store_mod

    monkeypatch.setattr(store_mod, "available_memory", lambda: 100_000)  # the slots (29,040 B) fit
    with pytest.raises(CachelabError, match=r"need 475,872 B of host memory \(dram_capacity 100 \(100 rows\) "
                                            r"26,400 B, hbm_capacity 10 \(10 rows, a CPU tensor\) 2,640 B, the hbm "
                                            r"tier's index \('lru', 8 B per table row\) 123,264 B, the dram tier's "
                                            r"index \('s3fifo', 17 B per table row\) 261,936 B, the first-use map "
                                            r"\(4 B per table row\) 61,632 B\), 100,000 B are available"):
        TieredStore.open(tables, backing="mmap", hbm_capacity=10, dram_policy="s3fifo", dram_capacity=100)
    monkeypatch.setattr(store_mod, "available_memory", lambda: 475_872)
    with TieredStore.open(tables, backing="mmap", hbm_capacity=10, dram_policy="s3fifo", dram_capacity=100) as store:
        rows = full_rows(np.random.default_rng(8), 4)
        assert check_rows(store, rows, store.lookup(rows)) == 0


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")])
def test_a_rebuild_that_stops_midway_leaves_the_previous_build(tmp_path, monkeypatch, failure):
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    from cachelab.store import build as build_mod

    fill, calls = build_mod.fill_pages, []

    def second_layer_fails(*args):  # the first layer is written whole, the second stops
        calls.append(1)
        if len(calls) == 2:
            raise failure
        return fill(*args)

    monkeypatch.setattr(build_mod, "fill_pages", second_layer_fails)
    with pytest.raises(KeyboardInterrupt if failure is KeyboardInterrupt else CachelabError) as err:
        build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False)
    if failure is not KeyboardInterrupt:
        assert ".layer14.tbl.tmp: No space left on device: the build stopped" in str(err.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no .tmp left, nothing replaced
    assert verify_tables(tmp_path)["mismatches"] == 0



def test_a_rebuild_whose_manifest_the_disk_refuses_keeps_the_previous_build(tmp_path, monkeypatch):
    """The manifest was written after the swap (the old manifest removed, the new layers renamed
    in): a disk filled during the build (past the free-space check) refused it there, and the
    build removed its layers, leaving no build where the previous one had been. The manifest is
    written first, under a scratch name; refused, the build stops before any layer and the
    previous build stays; the swap itself only renames."""
    from cachelab.store import format as format_mod

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(path, *args, **kwargs):  # the manifest's file, wherever it is written
        f = open(path, *args, **kwargs)
        if "manifest.json" in str(path):
            def refused(*_):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = refused
        return f

    monkeypatch.setattr(format_mod, "open", full_disk, raising=False)
    with pytest.raises(CachelabError, match=r"manifest.json: No space left on device: the build stopped and keeps "
                                            r"nothing; the directory's previous build, if any, is untouched"):
        build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no scratch file, nothing replaced
    monkeypatch.undo()
    assert verify_tables(tmp_path)["mismatches"] == 0 and read_manifest(tmp_path)["seed"] == 1
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False)  # and with room, the new one
    assert read_manifest(tmp_path)["seed"] == 2 and sorted(p.name for p in tmp_path.iterdir() if
                                                           p.name.startswith(".")) == [".build.lock"]


def test_a_rebuild_after_a_killed_build_counts_its_tmp_files_as_free_space(tmp_path, monkeypatch):
    """A build killed while writing (SIGKILL) leaves its ``.tmp`` files; the next build counted the
    space they hold as used and refused a rebuild that fits once they are gone (on V4.1's 189 GiB
    that is most of a disk). The next build removes them (it holds the lock: they are a dead
    build's), then checks the free space."""
    from types import SimpleNamespace

    from cachelab.store import build as build_mod

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    lay = TableLayout(CFG, 1e-6)
    need = sum(lay.file_bytes(li) for li in range(2))
    for name in (".layer1.tbl.tmp", ".layer14.tbl.tmp", ".layer7.tbl.tmp"):  # a killed build's, any layout's
        (tmp_path / name).write_bytes(bytes(lay.file_bytes(0)))

    def disk(path):  # room for the new build once the killed build's files are gone, no more
        return SimpleNamespace(f_frsize=1, f_bavail=need + build_mod.MANIFEST_ROOM
                               - sum(p.stat().st_size for p in tmp_path.glob(".*.tmp")))

    monkeypatch.setattr(os, "statvfs", disk)
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False)
    assert not list(tmp_path.glob(".*.tmp")) and verify_tables(tmp_path)["mismatches"] == 0


def test_a_build_needs_room_for_its_manifest_beside_its_layers(tmp_path, monkeypatch):
    """A disk with room for the layers alone passed the free-space check; the manifest's write then
    failed with a traceback (ENOSPC from the manifest's write), the layers renamed in and nothing able
    to read them. It is refused before anything is written, and a manifest that still
    fails to be written (a disk filled since) is an error naming it, its layers removed."""
    from types import SimpleNamespace

    from cachelab.store import build as build_mod

    lay = TableLayout(CFG, 1e-6)
    need = sum(lay.file_bytes(li) for li in range(2))
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_frsize=4096, f_bavail=need // 4096))
    with pytest.raises(CachelabError, match=f"{need + build_mod.MANIFEST_ROOM:,} B needed, {need:,} B free"):
        build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.lock"]
    monkeypatch.undo()

    write = build_mod.place_manifest

    def disk_full(*args):  # the manifest written, the directory's last sync failing
        write(*args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(build_mod, "place_manifest", disk_full)
    with pytest.raises(CachelabError, match=r"manifest.json: No space left on device: the tables were written but "
                                            r"not their manifest, so nothing could read them; they are removed"):
        build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.lock"]


def test_ctrl_c_while_a_build_swaps_its_files_in_is_delivered_once_the_new_build_is_whole(tmp_path, monkeypatch):
    """Between removing the old manifest and writing the new one a directory holds no build; a
    ctrl-C there lost the old build and kept no new one. It is now held back until the new
    manifest is written, then raised."""
    import signal

    from cachelab.store import build as build_mod

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    write = build_mod.place_manifest

    def interrupted(*args):  # the old manifest gone, the new layers renamed in
        signal.raise_signal(signal.SIGINT)
        return write(*args)

    monkeypatch.setattr(build_mod, "place_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False)
    assert verify_tables(tmp_path) == {"rows_checked": 816, "mismatches": 0}
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.data
def test_bench_stores_pagecache_section_replays_the_tables_layout(tmp_path, data_dir, monkeypatch):
    """``bench_store.py --pagecache`` read its trace as V4.1-Flash's whatever the tables' layout:
    on the demo layout's tables it stopped at its first step ('not whole tokens of 2 layers x 16
    rows'). It reads the trace as the tables' layout."""
    import sys
    from pathlib import Path

    from cachelab.store import pagecache

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_store import pagecache_section

    build_tables("engram-27b-demo", 1e-3, tmp_path, progress=False)
    monkeypatch.setattr(pagecache, "make_cgroup", lambda: (None, "not in this test"))
    out = pagecache_section(tmp_path, "gsm8k", 1, 3, None)
    assert out["cold"]["steps"] == out["warm"]["steps"] == 3 and out["warm"]["major_faults"] == 0
    assert out["cgroup"] == {"unavailable": "not in this test"}


def test_pagecache_experiment_phases(tables):
    from cachelab.store.pagecache import pagecache_experiment

    stream = stream_of(np.random.default_rng(8), steps=12, tokens=10)
    out = pagecache_experiment(tables, stream, 12, hbm_capacity=50, interval_s=0.0, cgroup=False)
    for phase in ("cold", "warm", "reclaim"):
        r = out[phase]
        assert r["steps"] == 12 and 0 <= r["table_pages_resident"] <= r["table_pages"]
        assert r["step_p50_ms"] <= r["step_p99_ms"]
    assert out["warm"]["major_faults"] == 0
    assert out["cold"]["table_pages_resident"] > 0
    assert out["reclaim"]["drops"] == 12  # interval 0: the pages go after every step
    assert "cgroup" not in out  # the cgroup phase (a child process) runs in benchmarks/bench_store.py


def test_the_page_cache_experiments_cold_phase_holds_no_first_step_cost(tables, monkeypatch):
    """A process's first step through the store loads the compiled kernels (7.5 s in a fresh
    checkout, 1.0 s in the cgroup's child): it fell in the cold phase, whose P99 over 30 steps was
    that load, no page-cache cost. An untimed step through a store closed again comes first
    (a first-read cost stands in for the load here)."""
    from cachelab.store import backing, pagecache

    read, calls = backing.MmapBacking.read, []

    def first_read_slow(self, *args):
        if not calls:
            time.sleep(0.4)
        calls.append(1)
        return read(self, *args)

    monkeypatch.setattr(backing.MmapBacking, "read", first_read_slow)
    stream = stream_of(np.random.default_rng(9), steps=4, tokens=10)
    out = pagecache.pagecache_experiment(tables, stream, 4, hbm_capacity=50, cgroup=False)
    assert out["cold"]["step_p99_ms"] < 400 and out["cold"]["table_pages_resident"] > 0


def test_the_page_cache_experiment_refuses_tables_whose_pages_the_drop_leaves(tables, monkeypatch):
    """On tmpfs (or with another process mapping the tables) dropping the pages leaves them
    resident: every phase read a resident table, the 'cold' one too (0 major faults, all 1,030
    pages resident on /dev/shm), reported as the page cache's figures. It is refused, named."""
    from cachelab.store import pagecache

    for path in tables.glob("layer*.tbl"):
        path.read_bytes()  # every page in the page cache
    monkeypatch.setattr(pagecache, "drop_pages", lambda paths: None)  # what tmpfs does with the drop
    stream = stream_of(np.random.default_rng(11), steps=3, tokens=10)
    with pytest.raises(CachelabError, match=r"of the tables' 1,030 pages stayed in the page cache when dropped: "
                                            r"on tmpfs"):
        pagecache.pagecache_experiment(tables, stream, 3, hbm_capacity=50, cgroup=False)


@pytest.mark.parametrize("section", ["modes", "prefetch", "direct"])
def test_bench_stores_storage_sections_refuse_tables_the_page_cache_keeps(tmp_path, monkeypatch, section):
    """``bench_store.py``'s ``modes`` and ``prefetch`` dropped the tables' pages and timed
    `store bench` with no check that they went: on tmpfs (the files are the page cache) their
    'SSD' reads were memory's, printed as storage figures; ``direct`` timed O_DIRECT there
    against fio's reads of memory alike. As the page-cache experiment does, the first two now
    refuse tables the page cache keeps, and ``direct`` a file whose O_DIRECT reads fetch nothing
    from storage, before timing anything."""
    import subprocess
    import sys
    from pathlib import Path

    from cachelab.store import pagecache

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_store

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    monkeypatch.setattr(pagecache, "drop_pages", lambda paths: None)  # what tmpfs does with the drop
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"timed {a[0]} on tables in memory"))
    from cachelab.store import backing

    if section == "direct":  # O_DIRECT on tmpfs (Linux 6.6 on) reads memory: no byte fetched from storage
        monkeypatch.setattr(backing.StorageReads, "__call__", lambda self: 7)
        with pytest.raises(CachelabError, match=r"layer1.tbl: 28 random O_DIRECT page reads fetched nothing from "
                                                r"storage .* on tmpfs the file is memory"):
            bench_store.direct_section(tmp_path, depths=(1,), reads=16, rounds=1)
        return
    run = {"modes": lambda: bench_store.modes_section(tmp_path, "gsm8k", 1),
           "prefetch": lambda: bench_store.prefetch_section(tmp_path, "gsm8k", 1, 1.0)}[section]
    with pytest.raises(CachelabError, match=r"pages stayed in the page cache when dropped: on tmpfs the files are "
                                            r"the page cache.* would time memory"):
        run()


def test_store_page_cache_runs_the_experiment_and_checks_its_flags(tables, tmp_path):
    """`cachelab store page-cache`: the experiment that only `benchmarks/bench_store.py --pagecache`
    ran, as a verb (the library's, the CLI parsing and printing); its flags checked first."""
    from typer.testing import CliRunner

    from cachelab.cli import app

    stream = stream_of(np.random.default_rng(10), steps=5, tokens=10).save(tmp_path / "s.npz")
    runner = CliRunner()
    base = ["store", "page-cache", "--dir", str(tables), "--trace", str(stream), "--capacity", "50", "--no-cgroup"]
    res = runner.invoke(app, [*base, "--steps", "4", "--json", "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [p for p in ("cold", "warm", "reclaim", "cgroup") if p in out] == ["cold", "warm", "reclaim"]
    assert out["steps"] == out["warm"]["steps"] == 4 and out["warm"]["major_faults"] == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    res = runner.invoke(app, [*base, "--steps", "2"])
    assert res.exit_code == 0 and "page cache of the mmap backing: 2 steps a phase" in res.output
    for flags, why in ((["--steps", "0"], "--steps must be at least 1, got 0"),
                       (["--cgroup-share", "0"], "--cgroup-share must be in (0, 1], got 0.0"),
                       (["--reclaim-interval-ms", "-1"], "--reclaim-interval-ms must be a finite number, 0 or more"),
                       (["--policy", "learned-lfu"], "--policy 'learned-lfu' needs predictor scores"),
                       (["--plot", str(tmp_path / "nowhere" / "p.png")], "no directory"),
                       (["--requests", "3"], "--requests does not apply")):
        res = runner.invoke(app, [*base, *flags])
        assert res.exit_code == 2 and why in res.output, (flags, res.output)


def test_the_page_cache_experiment_and_the_direct_bench_refuse_files_a_build_replaced(tmp_path, monkeypatch):
    """The page-cache experiment dropped pages by file name, and ``bench_store.py``'s ``direct``
    section read a file it opened, with no check that another build had not renamed its files
    in meanwhile: the experiment's 'cold' pass could start on another build's cached pages,
    the bench could time a file of another layout. Both now check as every reader does."""
    import sys
    from pathlib import Path

    from cachelab.store import backing as backing_mod, pagecache

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_store import direct_section

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=1, progress=False)
    done = []

    def then_rebuild(real):
        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            if not done:  # once the first file's pages are dropped, or the bench's file is open
                done.append(build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, seed=2, progress=False))
            return out
        return wrapped

    replaced = "another `cachelab store build` replaced the tables while they were being opened"
    monkeypatch.setattr(pagecache, "drop_cache", then_rebuild(pagecache.drop_cache))
    with pytest.raises(CachelabError, match=replaced):
        pagecache.pagecache_experiment(tmp_path, stream_of(np.random.default_rng(8), 2, 2), 2, cgroup=False)
    monkeypatch.undo()
    done.clear()
    monkeypatch.setattr(backing_mod.DirectBacking, "__init__", then_rebuild(backing_mod.DirectBacking.__init__))
    monkeypatch.setattr("bench_store.fio_iops", lambda *args: None)
    with pytest.raises(CachelabError, match=replaced):
        direct_section(tmp_path, depths=(1,), reads=16, rounds=1)
    monkeypatch.undo()
    assert direct_section(tmp_path, depths=(1,), reads=16, rounds=1)["depths"][1]["threads_iops"] > 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "fbgemm-lru"])
def test_a_tier_in_device_memory_moves_the_same_bytes_as_a_host_tier(policy):
    """The HBM row cache on a GPU keeps its rows in a torch tensor and moves them with index
    ops; a host tier with NumPy and the compiled loop. Driven by the same steps, the two hold
    and return the same bytes, and every hit returns its own row. (A CPU tensor stands in for
    device memory: the torch path is the same on CUDA; tests/test_store_cuda.py runs it there.)"""
    from cachelab import registry
    from cachelab.store.staging import IndexStaging
    from cachelab.store.tier import CacheTier

    rng = np.random.default_rng(11)
    indices = IndexStaging(torch, torch.device("cpu"), False)
    num_keys, capacity, rb = 5_000, 300, 264
    row_of = rng.integers(0, 256, (num_keys, rb), dtype=np.uint8)  # each key's row contents
    host = CacheTier("dram", registry.make_policy(policy), capacity, num_keys, np.zeros((capacity, rb), np.uint8))
    dev = CacheTier("hbm", registry.make_policy(policy), capacity, num_keys, torch.zeros((capacity, rb), dtype=torch.uint8))
    hits_seen = 0
    for _ in range(40):
        ids = np.unique(np.minimum(rng.zipf(1.3, 400), num_keys) - 1)
        rng.shuffle(ids)
        got = {}
        for name, tier in (("host", host), ("dev", dev)):
            hits, slots, res = tier.lookup(ids, None)
            hit_pos, miss_pos = np.flatnonzero(hits), np.flatnonzero(~hits)
            rows = np.zeros((ids.size, rb), np.uint8)
            rows[miss_pos] = row_of[ids[miss_pos]]  # the misses, as read from below
            step = rows if name == "host" else torch.from_numpy(rows.copy())
            tier.gather(slots, hit_pos, step, indices)
            order = np.argsort(ids)
            tier.commit(res, step, order[np.searchsorted(ids[order], res.admitted)], indices)  # admitted rows' places
            got[name] = (hits, np.asarray(step))
        assert np.array_equal(got["host"][0], got["dev"][0])
        assert np.array_equal(got["host"][1], got["dev"][1])
        assert np.array_equal(got["host"][1], row_of[ids])  # hits returned their own rows
        assert np.array_equal(host.memory, dev.memory.numpy())
        hits_seen += int(got["host"][0].sum())
    assert hits_seen > 1000
