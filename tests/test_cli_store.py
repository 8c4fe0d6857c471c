"""``cachelab store build / verify / bench`` as a user runs them: JSON contracts, exit codes,
clear errors, and a build killed midway leaving nothing a reader accepts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from piped_cli import run_piped

from cachelab.cli import build
from cachelab.engram.config import get_preset
from cachelab.errors import CachelabError
from cachelab.store import TieredStore
from cachelab.workload.lookups import LookupStream, global_key

runner = CliRunner()
CFG = get_preset("deepseek-v4.1-flash")
# the store verbs alone, as `cachelab store ...` builds them (cachelab.cli.main): the whole command line
# imports polars, which scripts/device-check's GPU machine lacks (tests/test_store_device_check.py)
app = build(["store"])


def run(*args):
    return runner.invoke(app, ["store", *map(str, args)])


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_tables")
    res = run("build", "--layout", "deepseek-v4.1-flash", "--scale", "1e-5", "--dir", d, "--seed", 3, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["row_bytes"] == 264
    return d


def test_verify_prints_the_contract_and_fails_on_a_mismatch(tables, tmp_path):
    res = run("verify", "--dir", tables, "--json")
    assert res.exit_code == 0 and json.loads(res.output) == {"rows_checked": 7728, "mismatches": 0}
    res = run("verify", "--dir", tables, "--sample", 100, "--json")
    assert json.loads(res.output)["rows_checked"] == 200
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tables.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    data = bytearray((copy / "layer1.tbl").read_bytes())
    data[4096 + 10] ^= 0xFF
    (copy / "layer1.tbl").write_bytes(bytes(data))
    res = run("verify", "--dir", copy, "--json")
    assert res.exit_code == 1 and json.loads(res.output)["mismatches"] == 1


def test_bench_json_matches_the_simulator(tables, tmp_path):
    rng = np.random.default_rng(0)
    ranks = np.minimum(rng.zipf(1.3, size=(8 * 16, 2, 24)), 10**6)
    rows = CFG.offsets[None] + (ranks * 2654435761) % CFG.primes[None]
    keys = global_key(np.broadcast_to(np.arange(2)[None, :, None], rows.shape), rows).reshape(-1)
    path = LookupStream(keys, np.arange(9) * 16 * 48, 264, CFG.layers).save(tmp_path / "s.npz")
    for backing in ("mmap", "pread"):
        res = run("bench", "--dir", tables, "--trace", path, "--policy", "s3fifo", "--capacity", 150,
                  "--dram-capacity", "100KiB", "--backing", backing, "--json")
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["matches_simulator"] is True and out["mismatches"] == 0
        assert out["store"]["hbm_hits"] == out["simulator"]["levels"]["hbm"]["served_unique"] > 0
        assert ("cuda" if torch.cuda.is_available() else "CPU tensor") in out["hbm_device"]  # --device auto
        assert out["policies"] == {"hbm": "s3fifo", "dram": "s3fifo"}
    copy = tmp_path / "corrupt"  # every row of the first layer wrong: printed, and the exit status says so
    copy.mkdir()
    for f in tables.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    data = np.fromfile(copy / "layer1.tbl", np.uint8)
    data[4096:] ^= 1
    data.tofile(copy / "layer1.tbl")
    res = run("bench", "--dir", copy, "--trace", path, "--capacity", 150, "--device", "cpu", "--json")
    assert res.exit_code == 1 and "rows differ from their reference" in res.stderr, res.output
    assert json.loads(res.stdout)["mismatches"] > 0  # it was exit 0: a script took the run as good
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", 0, "--backing", "hbm", "--device", "cpu",
              "--json")
    out = json.loads(res.stdout)  # no tier runs a policy; the table's rows are HBM reads on both sides
    assert res.exit_code == 0 and out["policies"] == {} and out["matches_simulator"] is True, out["comparison"]
    assert out["comparison"]["hbm_read_bytes"]["simulator"] == out["store"]["unique"] * 264
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", "1e9", "--no-verify", "--device", "cpu")
    assert res.exit_code == 0 and "hbm capacity 1,000,000,000 rows clamped to the table's 7,728 rows" in res.output
    for device in ("gpu", "cuda:x", "cudax"):  # 'cuda...' was taken for CUDA: torch's RuntimeError on a GPU machine
        res = run("bench", "--dir", tables, "--trace", path, "--capacity", 150, "--device", device)
        assert res.exit_code == 2 and f"device '{device}': expected cpu, cuda or cuda:N" in res.output, res.output


def _two_layer_stream(tmp_path):
    """Six steps of 384 lookups over both of the layout's tables' first 5,000 rows."""
    rng = np.random.default_rng(1)
    rows = CFG.offsets[None] + rng.integers(0, 5_000, (6 * 8, 2, 24)) % CFG.primes[None]
    keys = global_key(np.broadcast_to(np.arange(2)[None, :, None], rows.shape), rows).reshape(-1)
    return LookupStream(keys, np.arange(7) * 8 * 48, 264, CFG.layers).save(tmp_path / "s.npz")


def test_bench_text_prints_the_bytes_of_each_link(tables, tmp_path):
    """The issue's `store bench` prints per-tier hits, misses and bytes: the text printed the
    figures compared with the simulator alone, so on `mmap` and `pread` (whose page cache the
    simulator leaves out) no byte of the SSD -> DRAM or DRAM -> HBM link, nor the evictions."""
    path = _two_layer_stream(tmp_path)
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", 150, "--dram-capacity", 400, "--backing",
              "mmap", "--device", "cpu", "--json")
    st = json.loads(res.stdout)["store"]
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", 150, "--dram-capacity", 400, "--backing",
              "mmap", "--device", "cpu")
    assert res.exit_code == 0, res.output
    lines = {line.split()[1]: line.split()[3] for line in res.stdout.splitlines() if line.count("│") == 4}
    for name in ("hbm_evictions", "dram_evictions", "ssd_to_dram_bytes", "dram_to_hbm_bytes", "host_read_bytes",
                 "hbm_hits", "dram_misses", "host_to_device_bytes"):
        assert lines[name] == f"{st[name]:,}", (name, res.stdout)
    assert st["dram_to_hbm_bytes"] > 0 and st["hbm_evictions"] > 0


def test_piped_build_and_bench_print_whole_lines(tables, tmp_path):
    """Piped with no COLUMNS, Rich's 80 columns broke build's summary before its directory and
    bench's seconds before its faults; a script reading either line got half of it."""
    target = tmp_path / "a-directory-whose-name-takes-the-summary-past-eighty-columns"
    built = run_piped("store", "build", "--scale", "1e-6", "--dir", str(target), "--seed", "4").stdout.splitlines()
    assert [line for line in built if "816 rows of 264 B" in line and line.endswith(str(target))], built
    res = run_piped("store", "bench", "--dir", str(tables), "--trace", str(_two_layer_stream(tmp_path)), "--capacity",
                    "150", "--dram-capacity", "400", "--backing", "mmap", "--device", "cpu")
    seconds = [line for line in res.stdout.splitlines() if line.startswith("seconds: dedup ")]
    assert len(seconds) == 1 and "backing_read: reads through the page cache" in seconds[0] \
        and seconds[0].endswith(" major"), res.stdout


def test_bad_input_exits_2_naming_the_value(tables, tmp_path):
    res = run("bench", "--dir", tmp_path, "--trace", "x.npz", "--capacity", 10)
    assert res.exit_code == 2 and "manifest.json: missing" in res.output
    res = run("build", "--scale", 2, "--dir", tmp_path)
    assert res.exit_code == 2 and "--scale must be in (0, 1], got 2.0" in res.output
    res = run("bench", "--dir", tables, "--trace", "x.npz", "--capacity", 10, "--backing", "tape")
    assert res.exit_code == 2
    rows = CFG.offsets[None]  # one token: each head's first row
    keys = global_key(np.broadcast_to(np.arange(2)[None, :, None], rows.shape), rows).reshape(-1)
    path = LookupStream(keys, np.array([0, 48]), 264, CFG.layers).save(tmp_path / "one.npz")
    for flag, value, why in (("--compute-ms", -1, "a finite number of milliseconds, 0 or more, got -1.0"),
                             ("--compute-ms", "nan", "a finite number of milliseconds, 0 or more, got nan"),
                             ("--compute-ms", "inf", "a finite number of milliseconds, 0 or more, got inf"),
                             ("--max-lookups", 0, "at least 1, got 0")):  # nan and inf were a traceback
        res = run("bench", "--dir", tables, "--trace", path, "--capacity", 10, flag, value)
        assert res.exit_code == 2 and f"{flag} must be {why}" in res.output, res.output
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", 10, "--backing", "hbm", "--device", "cpu")
    assert res.exit_code == 2 and "`cachelab store bench --capacity 0`" in res.output  # said "give no policy"
    # a saved stream is replayed whole: --requests was ignored without a word
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", 10, "--requests", 3)
    assert res.exit_code == 2 and "--requests does not apply to it" in res.output, res.output
    # corpus names take at least one request each: the refusal named no flag ('requests per source ...')
    for command in (["bench", "--capacity", 10], ["page-cache"]):
        res = run(*command, "--dir", tables, "--trace", "gsm8k", "--requests", -2)
        assert res.exit_code == 2 and "--requests -2: corpus names take N >= 1 requests per corpus" in res.output, \
            res.output


def test_bench_refuses_what_it_ignored_or_named_in_python_terms(tables, tmp_path):
    """A demanding user's flags: an unknown --io-submit or --io-threads below 1 passed in silence
    with a backing that does not read through them; a learned policy without --model was told
    to 'pass scores= to lookup/prefetch' once the trace had loaded, a bad capacity named as
    'hbm_capacity' or 'dram_capacity'; a stream of another layout was 'not whole tokens'; a
    --seed beside --from-safetensors meant nothing; a --dir that is a file was 'no such table
    directory'."""
    missing = tmp_path / "not-yet.npz"  # refused before the trace is read
    for backing in ("dram", "mmap"):
        res = run("bench", "--dir", tables, "--trace", path_of_one(tmp_path), "--capacity", 10, "--backing", backing,
                  "--io-submit", "uring")
        assert res.exit_code == 2 and "unknown io submission 'uring'" in res.output, res.output
        res = run("bench", "--dir", tables, "--trace", path_of_one(tmp_path), "--capacity", 10, "--backing", backing,
                  "--io-threads", 0)
        assert res.exit_code == 2 and "--io-threads must be at least 1, got 0" in res.output, res.output
    for flags, flag in ((["--capacity", 10], "--policy"), (["--capacity", 0, "--dram-capacity", 10], "--policy"),
                        (["--capacity", 10, "--dram-policy", "learned-s3fifo", "--dram-capacity", 10], "--dram-policy")):
        policy = [] if flag == "--dram-policy" else ["--policy", "learned-s3fifo"]
        res = run("bench", "--dir", tables, "--trace", missing, *policy, *flags)
        assert res.exit_code == 2 and (f"{flag} 'learned-s3fifo' needs predictor scores: pass --model DIR "
                                       "(from `cachelab train`)") in res.output, res.output
    res = run("bench", "--dir", tables, "--trace", path_of_one(tmp_path), "--policy", "learned-s3fifo", "--capacity", 0,
              "--backing", "hbm", "--device", "cpu", "--no-verify", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["policies"] == {}  # no tier: nothing needs scores
    other = LookupStream(np.arange(32, dtype=np.int64), np.array([0, 32]), 128, (1, 15)).save(tmp_path / "demo.npz")
    res = run("bench", "--dir", tables, "--trace", other, "--capacity", 10)  # was "step 0 ... not whole tokens"
    assert res.exit_code == 2 and ("demo.npz has 2 table layers of 128-byte rows, but layout 'deepseek-v4.1-flash', "
                                   f"which it is read as, has 2 of 264 bytes: the tables in {tables} are of that "
                                   "layout") in res.output, res.output
    for flags, why in ((["--capacity", "abc"], "--capacity: 'abc' is not a capacity"),  # was 'hbm_capacity: ...'
                       (["--capacity", 10, "--dram-capacity", "0.0"], "--dram-capacity: '0.0' is less than one row")):
        res = run("bench", "--dir", tables, "--trace", missing, *flags)
        assert res.exit_code == 2 and why in res.output, res.output
    res = run("build", "--scale", "1e-6", "--dir", tmp_path / "t", "--seed", 0, "--from-safetensors", missing)
    assert res.exit_code == 2 and "--seed 0 and --from-safetensors: the rows are the checkpoint's" in res.output
    assert not (tmp_path / "t").exists()
    (tmp_path / "a-file").write_text("")
    for verb in (["verify"], ["bench", "--trace", missing, "--capacity", 10]):
        res = run(verb[0], "--dir", tmp_path / "a-file", *verb[1:])
        assert res.exit_code == 2 and "a-file: not a directory" in res.output, res.output


def test_bench_refuses_a_model_no_tier_reads(tables, tmp_path):
    """store bench --model with heuristics only loaded the model, scored the stream and replayed
    without the scores, saying nothing; refused now, naming the tiers, before anything loads."""
    missing, model = tmp_path / "not-yet.npz", tmp_path / "no-model"
    for flags, running in ((["--policy", "lru", "--capacity", 10], "--policy lru"),
                           (["--capacity", 10, "--dram-policy", "fifo", "--dram-capacity", 10],
                            "--policy lru, --dram-policy fifo"),
                           (["--capacity", 0, "--backing", "hbm"], "no cache tier")):
        res = run("bench", "--dir", tables, "--trace", missing, "--model", model, *flags)
        assert res.exit_code == 2 and (f"--model scores rows for a learned policy, and no tier runs one ({running})"
                                       in res.output), res.output


def keep_model(folder):
    """A keep model of 300 rows (horizon 2,000) in ``folder/m``, and the stream it was trained on, saved."""
    from cachelab import registry
    from cachelab.learning.streams import LearningView, request_stream
    from cachelab.learning.training import TrainSpec, save, train

    rng = np.random.default_rng(4)
    prompts = [rng.integers(1000, 1400, int(rng.integers(80, 200))) for _ in range(24)]
    stream = request_stream(prompts, [p[:3] for p in prompts], ["chat"] * 24, tokens_per_step=64)
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=3, num_leaves=4)
    model, _ = train(LearningView.of(stream), predictor, TrainSpec(horizon=2000, capacity=300), tune=False)
    save(model, folder / "m")
    return stream.save(folder / "s.npz")


def test_bench_names_a_keep_model_run_at_another_size(tables, tmp_path):
    """store bench --model ran a keep model (Belady's keep decisions at one cache size) in a tier of
    any size without a word (seen by helper-144): a note on stderr names both sizes, --json the model's."""
    trace = keep_model(tmp_path)
    base = ("bench", "--dir", tables, "--trace", trace, "--policy", "lru",
            "--dram-policy", "learned-lfu", "--model", tmp_path / "m", "--no-verify", "--device", "cpu", "--json")
    res = run(*base, "--capacity", 10, "--dram-capacity", 300)
    assert res.exit_code == 0 and "keep model" not in res.stderr, res.output
    assert {k: json.loads(res.stdout)[k] for k in ("model_capacity", "model_capacity_rows")} == {
        "model_capacity": 300, "model_capacity_rows": 300}
    res = run(*base, "--capacity", 300, "--dram-capacity", 20)  # the HBM tier runs lru: its size is not the model's
    assert res.exit_code == 0 and json.loads(res.stdout)["model_capacity"] == 300, res.output
    assert ("store bench: the model is a keep model for capacity 300 (300 rows on its training stream): at "
            "--dram-capacity 20 (the DRAM tier's 20 rows) its keep chances are for another cache size") in " ".join(res.stderr.split())


def path_of_one(folder):
    """A saved stream of one token (each head's first row)."""
    rows = CFG.offsets[None]
    keys = global_key(np.broadcast_to(np.arange(2)[None, :, None], rows.shape), rows).reshape(-1)
    return LookupStream(keys, np.array([0, 48]), 264, CFG.layers).save(folder / "one.npz")


def test_bench_checks_a_stream_s_layout_as_the_learning_view_does(tables, tmp_path):
    """The bench compared the stream's decoder layer ids, the learning view its table count: a
    stream whose tables other decoder layers read (a live model moves them; the rows stay) was
    refused by the bench and read by the view. One check (LookupStream.check_tables) now."""
    one = LookupStream.load(path_of_one(tmp_path))
    moved = LookupStream(one.keys, one.step_offsets, 264, (1, 3)).save(tmp_path / "moved.npz")
    res = run("bench", "--dir", tables, "--trace", moved, "--capacity", 10, "--device", "cpu", "--no-verify", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["lookups"] == 48


def test_bench_refuses_a_stream_it_cannot_replay_naming_the_trace_and_step(tables, tmp_path, monkeypatch):
    """A row id outside its head's rows (a stream built for other tables, a damaged one) or a key of
    another table layer was found by the step that reached it, the run minutes in, and the error named
    the row but not the --trace file or the step. The whole stream is checked before any step runs."""
    from cachelab.store import bench

    rng = np.random.default_rng(4)
    rows = CFG.offsets[None] + rng.integers(0, 1 << 40, (6 * 4, 2, 24)) % CFG.primes[None]
    keys = global_key(np.broadcast_to(np.arange(2)[None, :, None], rows.shape), rows).reshape(-1)
    offsets = np.arange(7) * 4 * 48
    steps = []
    monkeypatch.setattr(bench, "warm_up", lambda store, *a: steps.append(1))  # a step would run there first
    for at, key, why in ((5 * 192 + 3 * 48 + 24 + 7, int(global_key(1, 7)),
                          r"step 5: row id 7 is out of range for its head of layout 'deepseek-v4.1-flash' \(token 3, "
                          r"table layer 1 \(layer id 14\), column 7: rows \d+ to \d+\)"),
                         (200, 1 << 62, r"step 1, lookup 8: key 4611686018427387904 is of table layer 1073741824, "
                                        r"where the layout's token order has layer 0 \(of 2\)")):
        bad = keys.copy()
        bad[at] = key
        path = LookupStream(bad, offsets, 264, CFG.layers).save(tmp_path / "bad.npz")
        res = run("bench", "--dir", tables, "--trace", path, "--capacity", 10, "--device", "cpu")
        assert res.exit_code == 2 and steps == [], res.output
        assert re.search(rf"error: --trace {re.escape(str(path))}: {why}", " ".join(res.output.split())), res.output
    path = LookupStream(keys[:-1], np.append(offsets[:-1], keys.size - 1), 264, CFG.layers).save(tmp_path / "cut.npz")
    res = run("bench", "--dir", tables, "--trace", path, "--capacity", 10, "--device", "cpu")
    assert res.exit_code == 2 and steps == [], res.output
    assert "cut.npz: step 5 holds 191 lookups, not whole tokens of 2 layers x 24 rows" in " ".join(res.output.split())


def test_bench_checks_every_flag_before_the_trace_loads(tables, tmp_path):
    """--backing and --device (and --compute-ms, --max-lookups, --param) were checked once the
    trace had loaded (~1.6 s on corpora): a trace that does not exist yet shows they come first."""
    missing = tmp_path / "not-yet.npz"
    for flags, why in ((["--backing", "ssd"], "unknown backing 'ssd'; choose one of"),
                       (["--device", "gpu"], "--device 'gpu': expected cpu, cuda or cuda:N"),
                       (["--compute-ms", "-1"], "--compute-ms must be a finite number of milliseconds"),
                       (["--max-lookups", "0"], "--max-lookups must be at least 1, got 0"),
                       (["--max-lookups", "10"], "--max-lookups 10 is less than one token's 48 rows"),
                       (["--param", "nope=1"], "--param")):
        res = run("bench", "--dir", tables, "--trace", missing, "--capacity", 10, *flags)
        assert res.exit_code == 2 and why in res.output and "not-yet.npz" not in res.output, (flags, res.output)


def test_io_threads_over_io_uring_s_ring_are_refused_naming_the_flag(tables, tmp_path):
    """--io-threads above io_uring's 32,768 entries read 'io_uring is not available' (--io-submit
    io_uring), or fell back in silence to a pool of that many threads (auto)."""
    from cachelab.store.backing import check_io

    missing = tmp_path / "not-yet.npz"
    for submit in ("auto", "io_uring"):
        res = run("bench", "--dir", tables, "--trace", missing, "--capacity", 10, "--backing", "direct",
                  "--io-threads", 40000, "--io-submit", submit)
        assert res.exit_code == 2 and ("--io-threads 40,000 is over io_uring's limit of 32,768 entries (reads in "
                                       "flight)") in res.output, res.output
    check_io(32768, "auto", "direct")  # a full ring is allowed
    check_io(40000, "auto", "mmap")  # mmap reads through no pool and no ring
    with pytest.raises(CachelabError, match="io_threads 40,000 is over io_uring's limit"):
        TieredStore.open(tables, backing="direct", io_threads=40000)


def test_io_threads_over_a_pool_s_limit_are_refused_naming_the_flag(tables, tmp_path):
    """A pool of preads (pread, direct with threads) took any --io-threads: 100,000 started 386
    OS threads for one step of 53 K rows and took 70 times as long as 8 threads; more would
    exhaust the process's threads. Refused, naming the flag and the bound, before the trace loads."""
    from cachelab.store.backing import MAX_POOL_THREADS, check_io

    missing = tmp_path / "not-yet.npz"
    for backing, submit in (("pread", "auto"), ("pread", "threads"), ("direct", "threads")):
        res = run("bench", "--dir", tables, "--trace", missing, "--capacity", 10, "--backing", backing,
                  "--io-threads", 100000, "--io-submit", submit)
        assert res.exit_code == 2 and ("--io-threads 100,000 is over the limit of 1,024 for a pool of preads "
                                       f"(backing '{backing}'") in res.output, res.output
    check_io(MAX_POOL_THREADS, "threads", "direct")
    check_io(MAX_POOL_THREADS, "auto", "pread")
    with pytest.raises(CachelabError, match="io_threads 1,025 is over the limit of 1,024 for a pool of preads"):
        TieredStore.open(tables, backing="pread", io_threads=MAX_POOL_THREADS + 1)


def test_auto_does_not_fall_back_to_a_pool_over_its_limit(tables, monkeypatch):
    """Where io_uring is refused, auto fell back to a pool of preads as deep as the ring asked for."""
    from cachelab.store import backing

    def refused(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(backing, "_UringIO", refused)
    paths = sorted(tables.glob("layer*.tbl"))
    reader, how = backing.open_reader(paths, 64, 0, "auto")
    assert how.startswith("threads (io_uring unavailable") and reader.threads == 64
    reader.close()
    with pytest.raises(CachelabError, match="io_uring is not available here .*, and 2,000 reads in flight are over "
                                            "the limit of 1,024 for the pool of preads"):
        backing.open_reader(paths, 2000, 0, "auto")


def test_ctrl_c_in_a_build_says_what_the_directory_kept(tmp_path, monkeypatch):
    """Ctrl-C exited 130 with nothing said: the previous build stays whole (or there is none)
    and the partial files are gone, and one line now says so."""
    from cachelab.store import build as build_mod

    real, calls = build_mod.fill_pages, []

    def interrupted(*args):  # ctrl-C once the first chunk is written
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(build_mod, "fill_pages", interrupted)
    d = tmp_path / "t"
    res = run("build", "--scale", "1e-3", "--dir", d)
    assert res.exit_code == 130
    assert res.output.strip() == f"store build interrupted: {d} holds no build; the partial files were removed"
    assert run("build", "--scale", "1e-6", "--dir", d, "--seed", 4).exit_code == 0  # past the second call: whole
    old = (d / "manifest.json").read_text()
    calls.clear()
    res = run("build", "--scale", "1e-3", "--dir", d)
    assert res.exit_code == 130 and res.output.strip() == (f"store build interrupted: {d} keeps its previous "
                                                           "build, whole; the partial files were removed")
    assert (d / "manifest.json").read_text() == old and not list(d.glob(".*.tmp"))
    assert run("verify", "--dir", d).exit_code == 0


def test_a_build_refused_the_write_of_its_lock_names_the_file_and_keeps_the_build_there(tables, tmp_path):
    """A full disk or a file size limit refusing the lock's note of its holder (the build's first
    write) ended the build as 'error: a write failed: File too large', naming no file. The lock
    file is named; the directory's build is untouched."""
    import resource

    copy = tmp_path / "t"
    copy.mkdir()
    for f in tables.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.name != ".build.lock"}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # Python ignores SIGXFSZ: the first write gets EFBIG
    try:
        res = run("build", "--scale", "1e-5", "--dir", copy, "--seed", 5)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert res.exit_code == 2, res.output
    assert f"error: {copy / '.build.lock'}: File too large" in " ".join(res.output.split()), res.output
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name != ".build.lock"} == before
    res = run("verify", "--dir", copy, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["mismatches"] == 0


def test_build_into_a_directory_another_build_holds_exits_2_naming_it(tables):
    from cachelab.paths import held

    with held(tables / ".build.lock", "cachelab store build", "a test holds it"):
        res = run("build", "--scale", "1e-5", "--dir", tables, "--seed", 3)
    assert res.exit_code == 2 and f"`cachelab store build` (pid {os.getpid()}) is using {tables} now" in res.output
    assert run("verify", "--dir", tables, "--json").exit_code == 0


@pytest.mark.parametrize("before", [False, True])  # a fresh directory; one holding a build
def test_a_build_killed_midway_leaves_no_table(tables, tmp_path, before):
    target = tmp_path / "t"
    if before:
        assert run("build", "--scale", "1e-6", "--dir", target, "--seed", 4, "--json").exit_code == 0
    proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", "store", "build", "--scale", "1e-3",
                             "--dir", str(target)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (target / ".layer1.tbl.tmp").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if before:  # the previous build whole, nothing of the killed one
        res = run("verify", "--dir", target, "--json")
        assert res.exit_code == 0 and json.loads(res.output) == {"rows_checked": 816, "mismatches": 0}
        assert json.loads((target / "manifest.json").read_text())["scale"] == 1e-6
        return
    assert not (target / "manifest.json").exists()
    for verb in (["verify", "--dir", target], ["bench", "--dir", target, "--trace", "x.npz", "--capacity", 1]):
        res = run(*verb)
        assert res.exit_code == 2 and "no complete table build" in res.output


def test_bench_gives_a_learned_dram_tier_what_it_takes_from_the_model(tables, tmp_path, monkeypatch):
    """--policy lru --dram-policy learned-lfu --model M made the DRAM tier's policy by name: the
    default horizon (131,072) where the model's scores are positions of its own (2,000)."""
    import cachelab.store.bench as bench

    trace = keep_model(tmp_path)
    seen = {}

    def replay(directory, stream, backing, hbm, capacity, dram, *args, **kwargs):
        seen.update(hbm=hbm, dram=dram)
        raise SystemExit(0)

    monkeypatch.setattr(bench, "replay_store", replay)  # what the verb imports as it runs
    run("bench", "--dir", tables, "--trace", trace, "--policy", "lru", "--capacity", 10,
        "--dram-policy", "learned-lfu", "--dram-capacity", 20, "--model", tmp_path / "m")
    assert (seen["hbm"].name, seen["hbm"].params) == ("lru", {})
    assert (seen["dram"].name, seen["dram"].params) == ("learned-lfu", {"horizon": 2000})
