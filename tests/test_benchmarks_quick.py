"""The benchmarks under ``benchmarks/`` run in their quick modes (small arguments), to the end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True)


def bench_engine(*args: str) -> subprocess.CompletedProcess:
    return run("bench_engine.py", "--streams", "zipf", "--repeats", "1", *args)


@pytest.mark.slow
def test_a_small_run_raises_the_capacity_to_libcachesims_minimum_and_the_miss_counts_agree():
    """At 1% of a small stream's keys libCacheSim's S3-FIFO refused to start (a small FIFO of
    0 bytes) or, at 10-19 objects, cached nothing; the capacity is raised to 20 for every policy."""
    pytest.importorskip("libcachesim")
    done = bench_engine("--requests", "400", "--policies", "lru,s3fifo", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["policy"], r["capacity"], r["miss_counts_equal"]) for r in rows] == [("lru", 20, True),
                                                                                    ("s3fifo", 20, True)]


@pytest.mark.slow
def test_bench_engine_share_gives_cachelab_the_share_and_libcachesim_the_same_rows():
    """``--share`` times `simulate --capacity 0.01`, the distinct count included; the bench checks
    that cachelab resolved it to the rows libCacheSim gets (cachelab rounds a share)."""
    pytest.importorskip("libcachesim")
    done = bench_engine("--requests", "6000", "--policies", "lru", "--share")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(given to cachelab as --capacity 0.01)" in done.stdout and "DIFFER" not in done.stdout


def test_bench_engine_times_libcachesims_own_next_access_pass_for_belady():
    """cachelab's simulate computes next accesses inside its timed seconds; libCacheSim was handed the
    oracleGeneral file whose next accesses the benchmark had computed, untimed, so the Belady ratio
    measured the two on different work. libCacheSim now computes them from the same ids with its own
    converter, timed (seen by helper-121)."""
    pytest.importorskip("libcachesim")
    done = bench_engine("--requests", "400", "--policies", "belady,lru", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    belady, lru = json.loads(done.stdout.strip().splitlines()[-1])
    assert belady["miss_counts_equal"] and lru["miss_counts_equal"]
    assert 0 < belady["libcachesim_convert_seconds"] < belady["libcachesim_seconds"]
    assert lru["libcachesim_convert_seconds"] is None  # a policy that reads no future gets its file as before
    assert belady["ratio"] == belady["libcachesim_seconds"] / belady["cachelab_seconds"]
    given = belady["libcachesim_seconds"] - belady["libcachesim_convert_seconds"]  # the old, one-sided ratio
    assert belady["ratio_given_future"] == given / belady["cachelab_seconds"] and lru["ratio_given_future"] is None


def test_bench_engine_gives_libcachesim_a_hash_table_sized_to_the_cache(tmp_path, monkeypatch):
    """libCacheSim ran with its default table of 2^24 buckets (128 MiB of pointers, missing the CPU's
    caches on every lookup), 1.5-3x its CPU time with one sized to the cache, so the benchmark
    measured a slower libCacheSim than a user can run (seen by helper-129)."""
    lcs = pytest.importorskip("libcachesim")
    sys.path.insert(0, str(BENCHMARKS))
    from bench_engine import fitted_hashpower, worker

    from cachelab.trace.keytrace import write_oracle_general

    assert (fitted_hashpower(20), fitted_hashpower(7_796), fitted_hashpower(68_476)) == (6, 14, 18)
    built = []

    class Spy(lcs.LRU):  # the class the worker builds, and what it is given
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lcs, "LRU", Spy)
    trace = write_oracle_general(tmp_path / "t.oracleGeneral", np.arange(400) % 37)
    assert worker("LRU", trace, 20, 6)["miss_ratio"] == 1.0  # a loop of 37 keys through 20 rows: LRU misses all
    assert built == [{"hashpower": 6, "default_ttl": 0}]
    done = bench_engine("--requests", "400", "--policies", "lru", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["libcachesim_hashpower"] == fitted_hashpower(row["capacity"]) and row["miss_counts_equal"]
    done = bench_engine("--requests", "400", "--policies", "lru", "--json", "--lcs-hashpower", "24")
    assert json.loads(done.stdout.strip().splitlines()[-1])[0]["libcachesim_hashpower"] == 24, done.stderr[-2000:]


def test_bench_engines_libcachesim_expires_nothing_as_the_tests_reference(tmp_path, monkeypatch):
    """The worker built libCacheSim with its default TTL (86,400 x 300 = 25,920,000), where the tests'
    reference (``lcs_reference.lcs_cache``) gives ``default_ttl=0``: in a build with TTL compiled in,
    the benchmark's libCacheSim expired rows past 25.9 M requests and missed where the tests' did not."""
    lcs = pytest.importorskip("libcachesim")
    sys.path.insert(0, str(BENCHMARKS))
    from bench_engine import worker
    from lcs_reference import lcs_cache

    from cachelab.trace.keytrace import write_oracle_general

    ttls = []

    class Spy(lcs.FIFO):
        def __init__(self, *args, **kwargs):
            ttls.append(kwargs.get("default_ttl"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lcs, "FIFO", Spy)
    trace = write_oracle_general(tmp_path / "t.oracleGeneral", np.arange(100) % 10)
    assert worker("FIFO", trace, 20, 6)["miss_ratio"] == pytest.approx(0.1)  # 10 keys in 20 rows: each misses once
    lcs_cache("FIFO", 20)
    assert ttls == [0, 0], ttls  # the worker's was None: libCacheSim's default


def test_a_stream_too_small_for_the_minimum_is_refused_by_name():
    pytest.importorskip("libcachesim")
    done = bench_engine("--requests", "15", "--policies", "s3fifo")
    assert done.returncode == 1 and "would hold them all: raise --requests" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.data
def test_bench_traces_quick_run_ends_well_and_says_it_is_quick(data_dir):
    """Builds under 10 M tokens stopped with exit status 1 after printing every figure. The build
    timed is `cachelab trace build` as a user runs it, each a process of its own (its peak memory
    its own), the ratio its tokens per CPU second over the tokenizer's measured in the same run: it
    timed the library's build() in a child, without the command line's start-up and loading (seen
    by helper-130)."""
    done = run("bench_traces.py", "--small", "5", "--large", "10", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a quick run" in done.stdout and "x the tokenizer" in done.stdout
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ref = out["reference"]
    for requests, build in zip((5, 10), out["builds"]):
        assert build["command"][:3] == ["cachelab", "trace", "build"] and "--corpus" in build["command"]
        assert build["requests"] == requests and build["peak_rss_mib"] > 0
        assert build["over_reference_cpu"] == build["tokens"] / build["cpu_s"] / (ref["tokens"] / ref["cpu_s"])
    assert out["quick"]


@pytest.mark.slow
@pytest.mark.data
def test_bench_kernels_times_a_policy_that_reads_the_future(data_dir):
    """``--policies belady`` stopped: the benchmark gave no policy its next accesses."""
    done = run("bench_kernels.py", "--requests", "20000", "--policies", "lru,belady", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "belady:" in done.stdout


def test_bench_engine_pairs_only_policies_that_are_the_same_rule():
    """``--policies all`` paired lfuda with libCacheSim's LFUDA, another rule (its miss ratios differ)."""
    pytest.importorskip("libcachesim")
    sys.path.insert(0, str(BENCHMARKS))
    from bench_engine import shared_policies

    pairs = dict(shared_policies())
    assert pairs["lfu"] == "LFU" and pairs["s3fifo"] == "S3FIFO" and "lfuda" not in pairs


def test_bench_engine_baseline_times_the_baseline_checkout(tmp_path):
    """``--baseline DIR`` ran ``python -m cachelab.cli`` in the bench's working directory, which
    ``-m`` puts first on the module path: run from the repository's root it timed this checkout
    twice. A stand-in baseline that reports 12.5 s proves which one ran."""
    pytest.importorskip("libcachesim")
    fake = tmp_path / "baseline" / "cachelab" / "cli"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(
        "import json, sys\n"
        "capacity = int(sys.argv[sys.argv.index('--capacity') + 1])\n"
        "print(json.dumps({'seconds': 12.5, 'miss_ratio': 0.5, 'capacity': capacity}))\n")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_engine.py"), "--streams", "zipf", "--repeats", "1",
                           "--requests", "400", "--policies", "lru", "--json", "--baseline", str(fake.parents[1])],
                          capture_output=True, text=True, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["baseline_seconds"] == 12.5 and row["cachelab_seconds"] != 12.5


def test_bench_client_overhead_measures_the_client_against_an_exact_stub():
    """benchmarks/bench_client_overhead.py (docs/bench.md, "The client's own overhead"): every
    request completes with the stub's output length, at about the stub's gap, and the client's
    figures are printed as ratios over what the stub measured it sent."""
    done = run("bench_client_overhead.py", "--requests", "3", "--prompt-tokens", "200", "--output-tokens", "4",
               "--request-rate", "10", "--gap-ms", "20", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert (out["completed"], out["failed"]) == (3, 0)
    assert out["median_itl_ms"] >= 15.0 and out["median_tpot_ms"] >= 15.0  # a stall may bunch a few chunks
    # the reference is the stub's own measured gaps (about 20 ms; a stall bunches its catch-up sends too:
    # 16.2 ms at load 17), and each ratio is the client's over it
    assert out["server_median_itl_ms"] >= 15.0
    for key in ("median_itl", "p99_itl", "median_ttft", "p99_ttft"):
        assert out[f"{key}_x_server"] == out[f"{key}_ms"] / out[f"server_{key}_ms"]


def test_bench_mrc_sampling_holds_sampled_curves_to_exact_ones():
    """benchmarks/bench_mrc_sampling.py (docs/engine.md, "Any policy"): per policy and rate, the
    largest gap between the sampled and the exact curve, and the CPU sampling saves."""
    done = run("bench_mrc_sampling.py", "--requests", "40000", "--keys", "4000", "--capacities", "200,1000",
               "--policies", "lru,fifo", "--rates", "0.2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["rows"]
    assert [(r["policy"], r["method"]) for r in rows] == [("lru", "shards"), ("fifo", "mini-simulation")]
    for r in rows:
        assert r["max_abs_error"] == max(abs(a - b) for a, b in zip(r["sampled"], r["exact"])) < 0.1
        assert r["speedup_cpu"] > 0


def test_bench_engram_host_path_rewrites_a_short_scale_file(tmp_path):
    """A run killed while writing the scale shard left a whole weight shard in ``--dir``: the next
    run reused the pair and died mapping the short scale file."""
    pytest.importorskip("torch")
    args = ("--dir", str(tmp_path), "--table-gib", "0.002", "--rounds", "1", "--json")
    assert run("bench_engram_host_path.py", *args).returncode == 0
    scale = tmp_path / "engram_v0_r0.scale.bin"
    size = scale.stat().st_size
    scale.write_bytes(scale.read_bytes()[:1000])
    done = run("bench_engram_host_path.py", *args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert scale.stat().st_size == size and json.loads(done.stdout)["rows"] * 8 == size


def test_bench_engram_agrees_with_the_demos_shifted_numpy_form():
    """The addresser against the spec written as DeepSeek's demo writes it (left-padded shifts,
    XOR, %), bit for bit on 11 documents of the standard library (a 7-character one among them,
    shorter than the look-back), BOS first; the bench prints its speed ratio."""
    done = run("bench_engram.py", "--chars", "20000", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(identical in both)" in done.stdout and "ratio" in done.stdout


def test_bench_engine_libcachesim_process_imports_neither_cachelab_nor_numba(tmp_path):
    """The libCacheSim child imported tests/lcs_reference.py (for ``min_capacity``), which imports
    cachelab and Numba: about 0.25 s of CPU and 0.9 s of wall on the loaded 2-core machine added to
    libCacheSim's whole-process times, which the wall and process-CPU ratios divide by."""
    pytest.importorskip("libcachesim")
    from cachelab.trace.keytrace import write_oracle_general

    trace = tmp_path / "t.oracleGeneral"
    write_oracle_general(trace, np.arange(200, dtype=np.int64) % 8)
    done = subprocess.run([sys.executable, "-X", "importtime", str(BENCHMARKS / "bench_engine.py"), "--worker", "LRU",
                           str(trace), "10", "6"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert round(json.loads(done.stdout)["miss_ratio"] * 200) == 8  # the 8 keys, once each
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "libcachesim" in imported
    assert not {m for m in imported if m.split(".")[0] in ("cachelab", "numba")}


@pytest.mark.slow
@pytest.mark.data
def test_bench_learned_times_cachelab_simulate_as_a_user_runs_it(data_dir):
    """bench_learned.py timed the learned pass inside one process only, from a stream already
    built; it also times `cachelab simulate --model` against `simulate --policy lru` in fresh
    processes (the prompts tokenized and addressed in each), whose miss ratios must be the passes'."""
    done = run("bench_learned.py", "--requests", "20", "--trees", "5", "--leaves", "7", "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["cli_learned_over_lru"] == out["cli_lru_cpu_s"] / out["cli_learned_cpu_s"]
    assert out["cli_learned_wall_s"] > 0 and out["cli_lru_wall_s"] > 0


QUOTED = [  # benchmarks whose figures the docs quote, in quick modes, and what each run must print
    (("bench_engram.py", "--chars", "100000", "--repeats", "1"), "(identical in both)"),  # README, Benchmarks
    (("bench_mooncake_import.py", "--copies", "1", "--repeat", "1"), "x the reference"),  # docs/traces.md
]


@pytest.mark.slow
@pytest.mark.data
@pytest.mark.parametrize("argv, printed", QUOTED, ids=[argv[0] for argv, _ in QUOTED])
def test_a_quoted_benchmark_runs_to_the_end_in_its_quick_mode(data_dir, argv, printed):
    """Nothing ran these, so they could rot unseen; no time is asserted."""
    done = run(*argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert printed in done.stdout


@pytest.mark.slow
@pytest.mark.data
def test_bench_online_scorer_quick_run_times_every_step_size(data_dir):
    """benchmarks/bench_online_scorer.py (docs/learned.md): decode steps of 1 to 256 sequences."""
    done = run("bench_online_scorer.py", "--rounds", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert [r["sequences"] for r in rows] == [1, 16, 64, 256] and all(r["ms_per_step"] > 0 for r in rows)


def test_bench_live_times_the_bare_forward_on_a_thread_of_its_own_as_the_server_runs_it(monkeypatch):
    """The server's engine runs its forward on the engine thread; the bare forward ran on the main
    thread, where torch's intra-op pool on 2 busy cores took 10-20x as long: without --threads 1,
    server / bare read 6.9-9.4 (the server 'faster' than its own forward)."""
    import importlib.util
    import threading

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its first import, cli_numpy, lives there
    spec = importlib.util.spec_from_file_location("bench_live", BENCHMARKS / "bench_live.py")
    bench_live = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_live)
    threads = []

    def model(*_):
        threads.append(threading.current_thread())

    monkeypatch.setattr(bench_live, "build_model", lambda cfg: model)
    tok_s, cpu_ms = bench_live.bare_decode(2, 3)
    assert len(threads) == 3 + 3 and threading.main_thread() not in threads
    assert tok_s > 0 and cpu_ms >= 0


@pytest.mark.slow
def test_bench_capture_sends_id_prompts_vllm_takes_and_no_path_warms_anothers_prefix():
    """``--prompt-tokens``: the untimed batches sent a token id of 1,000,000, which vLLM refuses ('Token
    id 1000000 is out of vocabulary', an error event in a stream), and the bench ended ('request failed:
    200'); and every path of a round sent the
    same prompts, so the second found them in the upstream's prefix cache. Every timed request now
    finds none of its prompt cached (a prompt of 48 ids: three 16-token blocks the upstream caches)."""
    from capture_upstream import ServerThread, Upstream

    upstream = Upstream()
    with ServerThread(upstream.app) as server:
        done = run("bench_capture.py", "--upstream", server.url, "--model", "tiny", "--prompt-tokens", "48",
                   "--requests", "8", "--rounds", "2", "--concurrency", "1", "--max-tokens", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "prompts of 48 token ids" in done.stdout
    timed = [cached for max_tokens, cached in upstream.cached if max_tokens == 3]
    assert len(timed) == 16 and set(timed) == {0}, timed


def test_bench_capture_runs_each_proxy_on_its_own_code_not_the_working_directorys(tmp_path):
    """The proxies' writer and planner children (``python -m``) and the upstream (``python -c``) put their
    working directory first on sys.path: started where the bench was, in a checkout, they ran its code,
    whatever PYTHONPATH a ``--proxy NAME='PYTHONPATH=DIR'`` variant gave (measuring an old proxy against a
    new one, the old proxy's writer was the new one's). Here the bench runs in a directory whose
    ``cachelab`` package cannot be imported: every process it starts still runs this checkout's."""
    fake = tmp_path / "cachelab"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise SystemExit(\"the working directory's cachelab\")\n")
    root = str(BENCHMARKS.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_capture.py"), "--requests", "4", "--concurrency",
                           "1", "--max-tokens", "2", "--rounds", "2"], capture_output=True, text=True, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"capture of proxy: (\d+) of \1 records acknowledged", done.stdout), done.stdout



@pytest.mark.slow
def test_bench_capture_gives_each_proxys_cpu_per_token_as_a_ratio_and_the_verdict_by_the_interval():
    """Two proxies in the same rounds: each one's CPU per token against the first's (the figure load moves
    least), and beside each P99 verdict the one its bootstrap interval gives (met, missed or unresolved)."""
    done = run("bench_capture.py", "--requests", "4", "--rounds", "2", "--concurrency", "1", "--max-tokens", "2",
               "--proxy", "a=", "--proxy", "b=", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"CPU per token at concurrency 1, writer included, against a \(\d+ us; event loop \d+ us\): "
                     r"b \d+ us \((\d+\.\d\dx|no ratio to 0); event loop \d+ us, (\d+\.\d\dx|no ratio to 0)\)",
                     done.stdout), done.stdout  # a run this short may count no CPU tick of a proxy
    assert re.search(r"by the interval: (met|missed|unresolved)\)", done.stdout), done.stdout
    figures = json.loads(done.stdout.strip().splitlines()[-1])["by_proxy"]["b"]["1"]
    assert {figures[m]["goal_by_interval"] for m in ("TTFT", "ITL")} <= {"met", "missed", "unresolved"}
    # the goal at the run's noise: whole rounds resampled, and the A/A spread against the allowance
    # (two rounds: one A/A pair, whose resampling has no spread, so the noise is not measured, not called 0)
    assert re.search(r"^ITL +by rounds \(2 resampled whole\): P99 delta \[[-+]\d+\.\d\d, [-+]\d+\.\d\d\] ms, goal "
                     r"(met|missed|unresolved); noise not measured", done.stdout, re.M), done.stdout
    for m in ("TTFT", "ITL"):
        low, high = figures[m]["p99_delta_round_ci_ms"]
        assert low <= high and figures[m]["goal_by_rounds"] in {"met", "missed", "unresolved"}
        assert figures[m]["rounds"] == 2 and figures[m]["noise_under_allowance"] is False
        assert figures[m]["goal_at_noise"] == "unresolved"  # a noise not measured settles nothing

@pytest.mark.slow
def test_bench_capture_pairs_runs_pinned_and_claims_no_noise_it_cannot_measure(tmp_path):
    """``--pairs``: request-level pairs after the rounds, pinned with --pin; a run of 4 pairs (2 cycles, under
    the 10 blocks a noise needs) gives its figures but resolves nothing. An odd --pairs is refused."""
    done = run("bench_capture.py", "--requests", "4", "--rounds", "2", "--concurrency", "1", "--max-tokens", "3",
               "--pairs", "4", "--pin", "--json", "--samples", str(tmp_path / "samples.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    paired = out["paired"]
    assert out["scheduling"]["policy"] == "SCHED_OTHER" and "scheduling: SCHED_OTHER, niceness" in done.stdout
    assert paired["layout"]["client"] == paired["layout"]["upstream"] != paired["layout"]["proxy"]
    for metric in ("TTFT", "ITL"):
        figures = paired["by_proxy"]["proxy"]["1"][metric]
        assert figures["pairs"] == 4 and figures["samples"] == (4 if metric == "TTFT" else 8)
        assert figures["goal_at_noise"] == figures["goal"] == "unresolved" and not figures["noise_under_allowance"]
    assert re.search(r"^TTFT +P99 direct .* noise not measured \(1 block\(s\), under 10\)", done.stdout, re.M)
    rows = [row for row in json.loads((tmp_path / "samples.json").read_text()) if "unit" in row]
    assert len(rows) == 16 and [row["path"] for row in rows[:4]] == ["direct", "proxy", "proxy", "proxy"]
    assert {row["pairs_of"] for row in rows} == {"proxy"} and [row["second"] for row in rows[:2]] == [0, 1]
    refused = run("bench_capture.py", "--pairs", "3")
    assert refused.returncode != 0 and "--pairs 3: expected an even number" in refused.stderr


# The benchmarks below had no run in the suite (seen by helper-121). Each runs in a quick mode, end to end,
# and must print its ratio against the reference it measures in the same run; no time is asserted.
ROOT = BENCHMARKS.parent


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    """Twelve requests of standard-library text with gamma arrivals: a serving benchmark's quick workload."""
    from cachelab.trace.build import build, parse_spec

    path = tmp_path_factory.mktemp("trace") / "small.parquet"
    spec = {"seed": 0, "arrivals": {"source": "gamma", "options": {"rate": 4.0, "num_requests": 12}},
            "corpus": {"source": "stdlib", "options": {"max_chars": 100_000}}}
    build(parse_spec(spec, "small_trace"), path)
    return path


@pytest.mark.slow
def test_bench_serving_quick_run_prints_the_sampled_speed_ratio(small_trace):
    done = run("bench_serving.py", "--trace", str(small_trace), "--skip-hour", "--slice-s", "1000")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "workload: 12 requests" in done.stdout and re.search(r"speed ratio \(CPU\) \d+\.\d+x", done.stdout)
    assert "largest |diff|" in done.stdout


@pytest.mark.slow
def test_bench_serve_sim_quick_run_times_a_baseline_and_compares_its_figures(small_trace):
    """The baseline is this checkout: the two trees' figures must be equal, the ratio their CPU's."""
    done = run("bench_serve_sim.py", "--trace", str(small_trace), "--baseline", str(ROOT), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["requests"] == 12 and out["differing"] == [] and out["one_side_only"] == []
    assert out["baseline_over_this_cpu"] == out["times"]["baseline"]["cpu_s"] / out["times"]["this"]["cpu_s"]


@pytest.mark.slow
@pytest.mark.data
def test_bench_studies_quick_run_times_a_baseline_and_compares_its_figures(data_dir):
    done = run("bench_studies.py", "--studies", "inferencex", "--baseline", str(ROOT), "--fit-evals", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"inferencex: baseline / this \d+\.\d+x CPU", done.stdout)
    entry = json.loads(done.stdout[done.stdout.index("{"):])["inferencex"]
    assert entry["largest_difference"][1] == 0.0  # one tree twice: the same figures
    assert entry["baseline_over_this_cpu"] == entry["times"]["baseline"]["cpu_s"] / entry["times"]["this"]["cpu_s"]


@pytest.mark.slow
def test_bench_capture_quick_run_prints_proxied_over_direct():
    done = run("bench_capture.py", "--requests", "8", "--concurrency", "1", "--max-tokens", "2", "--rounds", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 dropped" in done.stdout
    for metric in ("TTFT", "ITL"):
        assert re.search(rf"^{metric} .* \d+\.\d+x ", done.stdout, re.M), done.stdout


def test_bench_live_host_quick_run_prints_its_ratios():
    done = run("bench_live_host.py", "--answer", "512", "--prompt", "4000", "--lengths", "200", "800")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^block hashing .* rehash / incremental \d+\.\dx", done.stdout, re.M), done.stdout
    assert re.search(r"^admission of a 4000-token prompt tried at \d+ steps.* rehash / incremental \d+\.\dx",
                     done.stdout, re.M), done.stdout
    assert re.search(r"800 over 200 tokens' time a token: this \d+\.\d\dx", done.stdout), done.stdout


@pytest.mark.slow
def test_bench_live_quick_run_prints_the_server_over_the_bare_model():
    done = run("bench_live.py", "--batches", "1", "--tokens", "4", "--threads", "1", "--placements", "dram",
               "--first-layers", "1", "--stall-requests", "1", "--stall-tokens", "2", "--ttft-prompts", "1",
               "--ttft-tokens", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    [decode] = out["decode"]
    assert decode["server_over_bare"] == decode["server_tok_s"] / decode["bare_forward_tok_s"]
    assert f"ratio {decode['server_over_bare']:.2f}" in done.stdout
    [repeat] = out["repeated_prompt"]
    assert repeat["warm_cached_tokens"] > 0  # the prompt sent again found its prefix cached
    assert [(s["prefetch"], s["steps"] > 0) for s in out["stall"]] == [(True, True), (False, True)]


# Benchmarks whose own process runs nothing of cachelab's that they time, and starts a competitor
# that must keep its own NumPy default: libCacheSim's worker, vLLM's `vllm bench serve`, the host
# path of vLLM's Engram worker (a vLLM process keeps NumPy's advice); and the two helpers.
OWN_NUMPY_DEFAULT = {"bench_engine.py", "bench_serve_vs_vllm.py", "bench_engram_host_path.py", "timed_cli.py",
                     "cli_numpy.py", "capture_hop_stamps.py"}  # the last runs inside the CLI proxy, which sets NumPy


def test_bench_oracle_read_quick_run_reads_the_same_keys_and_prints_the_ratio():
    """benchmarks/bench_oracle_read.py (docs/engine.md, Key traces): both readers give the keys written."""
    done = run("bench_oracle_read.py", "--records", "50000", "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["records"] == 50_000 and figures["ratio"] == figures["whole_file_s"] / figures["streamed_s"]
    assert "ratio (whole file / streamed)" in done.stdout


def test_every_benchmark_runs_numpy_as_the_command_line_does():
    """The command line turns NumPy's huge-page advice off (cachelab/cli/__init__.py); a benchmark
    that timed cachelab's code in its own process kept it, and timed compaction stalls no user of
    the CLI meets: bench_learned's in-process learned pass 1.9-2.3 s of system time against 0.5 s,
    learned / LRU 0.09 against 0.16 (docs/bench.md). Each benchmark imports cli_numpy first,
    before anything imports NumPy, and its process goes without the advice."""
    import ast

    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.name in OWN_NUMPY_DEFAULT:
            continue
        imports = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))
                   and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        assert isinstance(imports[0], ast.Import) and imports[0].names[0].name == "cli_numpy", path.name
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_engram\n"
             "from numpy._core import multiarray; print(multiarray._get_madvise_hugepage())")
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    for given, advised in ((None, "False"), ("1", "True")):
        run_env = env if given is None else {**env, "NUMPY_MADVISE_HUGEPAGE": given}
        done = subprocess.run([sys.executable, "-c", probe, str(BENCHMARKS)], capture_output=True, text=True,
                              env=run_env)
        assert done.stdout.strip() == advised, (given, done.stdout, done.stderr[-2000:])


def test_bench_engine_runs_cachelab_from_bytecode_as_an_installed_package_has_it(tmp_path, monkeypatch):
    """Under ``PYTHONDONTWRITEBYTECODE`` (this development machine sets it) every timed ``simulate``
    compiled cachelab's modules from source, about 0.05 s of CPU that an installed cachelab (pip
    compiles its bytecode) never pays and that libCacheSim's process, whose package has its
    bytecode, did not pay either: the run after the warm-up reads bytecode kept in the run's folder."""
    sys.path.insert(0, str(BENCHMARKS))
    from bench_engine import BYTECODE, cachelab_run

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    keys = tmp_path / "k.npy"
    np.save(keys, np.arange(300, dtype=np.int64) % 17)
    first = cachelab_run("lru", keys, 5)
    assert first["miss_ratio"] == 1.0  # a loop of 17 keys through 5 rows
    kept = {p.name.split(".")[0] for p in (tmp_path / BYTECODE).rglob("*.pyc")
            if p.parent.parent.name == "cachelab"}
    assert {"cache", "replay", "lookups"} <= kept, sorted(kept)


def test_bench_store_refuses_an_unknown_section_before_building_tables(tmp_path):
    """A misspelt ``--sections`` name ran no section and printed an empty result, after building
    the tables; it is refused first, naming it and the sections there are."""
    res = run("bench_store.py", "--sections", "gathr,none", "--dir", str(tmp_path / "t"))
    assert res.returncode == 2 and "--sections: unknown 'gathr'; choose from gather, direct, modes, prefetch" \
        in res.stderr, res.stderr[-500:]
    assert not (tmp_path / "t").exists()


def test_bench_store_reports_the_scale_its_tables_were_built_at(tmp_path):
    """``dir_scale`` was the ``--scale`` argument (2e-3 by default) even when the tables already in
    ``--dir`` were built at another scale, so a result said 2e-3 of tables at 1e-5: it is the
    tables' own (their headers', checked against the manifest), and a ``--scale`` they were not
    built at is refused, naming both; one the build refuses is its error alone (it came with a traceback)."""
    from cachelab.store import build_tables

    build_tables("deepseek-v4.1-flash", 1e-5, tmp_path / "t", progress=False)
    res = run("bench_store.py", "--sections", "none", "--dir", str(tmp_path / "t"), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["dir_scale"] == 1e-5, res.stderr[-500:]
    res = run("bench_store.py", "--sections", "none", "--dir", str(tmp_path / "t"), "--scale", "2e-3", "--json")
    assert res.returncode == 1 and f"error: --scale 0.002: the tables in {tmp_path / 't'} were built at scale 1e-05" \
        in res.stderr, res.stderr[-500:]
    assert run("bench_store.py", "--sections", "none", "--dir", str(tmp_path / "t"), "--scale", "1e-5").returncode == 0
    res = run("bench_store.py", "--sections", "none", "--dir", str(tmp_path / "new"), "--scale", "5")
    assert res.returncode == 2 and "--scale must be in (0, 1], got 5.0" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_live_operator_probe_counts_the_clock_reads_of_a_step():
    """benchmarks/live_operator_probe.py (docs/live.md, "The attention term identified") gives the
    operator clock's cost a step as its reads a step times a read's cost. It derived the reads from a
    list of operators, 4 pairs a layer + wkv + head = 19 pairs on the tiny preset, where a forward
    makes 42 reads (21 pairs): 5 operators a layer, out's span starting at attention's end read. The
    count is the profiler's count of ``time.perf_counter`` calls in a forward, less one untimed."""
    import sys
    import time

    import torch

    from cachelab.live.config import PRESETS
    from cachelab.live.kv_cache import NO_CLOCK, OpClock, PagedKVCache, StepBatch
    from cachelab.live.model import build_model

    done = run("live_operator_probe.py", "--section", "clock", "--reps", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    printed = re.search(r"(\d+) clock reads a step", done.stdout)
    assert printed, done.stdout

    cfg = PRESETS["tiny"]
    model = build_model(cfg)
    kv = PagedKVCache(cfg.layers, 8 * 64, 16, cfg.kv_heads, cfg.head_dim, getattr(torch, cfg.dtype))
    rows = torch.zeros(4, len(cfg.engram_layers), 24, 256)
    ids = list(np.random.default_rng(0).integers(100, 90_000, (4, 1)))
    tables = [np.arange(i * 17, (i + 1) * 17) for i in range(4)]

    def calls(clock) -> int:
        n = 0

        def count(frame, event, arg):
            nonlocal n
            n += event == "c_call" and arg is time.perf_counter

        batch = StepBatch.build(ids, [271] * 4, tables, [True] * 4, 16, clock=clock)
        sys.setprofile(count)
        try:
            with torch.inference_mode():
                model(batch, kv, lambda: rows)
        finally:
            sys.setprofile(None)
        return n

    assert int(printed.group(1)) == calls(OpClock()) - calls(NO_CLOCK) > 0


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (scripts/setup)")
def test_bench_stores_fio_reference_runs_in_the_benchs_own_session(tmp_path, monkeypatch):
    """docs/store.md times the bench in a scheduling group of its own at -20 (a session: autogroups).
    fio forks its job, which calls setsid: the reference ran in a group of its own at the default
    weight, slowed by every other session's work while the store was not (the store 1.6-3x fio
    at QD <= 32, load 9-12). The job now runs as a thread of fio, in the caller's session; fio's
    ``exec_prerun`` reports the job's session id into ``ref.prerun.txt``."""
    import subprocess as sp

    sys.path.insert(0, str(BENCHMARKS))
    import bench_store
    from cachelab.store import build_tables

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "t", seed=1, progress=False)
    real = sp.run

    def with_prerun(args, **kw):  # fio says where the prerun's output went before its JSON
        res = real([*args, "--exec_prerun=awk '{print $6}' /proc/self/stat"], **kw)
        res.stdout = res.stdout[res.stdout.find("{"):]
        return res

    monkeypatch.setattr(bench_store.subprocess, "run", with_prerun)
    monkeypatch.chdir(tmp_path)
    assert bench_store.fio_iops(tmp_path / "t" / "layer1.tbl", 1, 16) > 0
    assert int((tmp_path / "ref.prerun.txt").read_text().split()[0]) == os.getsid(0)


@pytest.mark.data
def test_bench_floor_times_the_floor_against_belady_on_the_same_rows(data_dir):
    """The miss floor's cost beside a Belady replay (docs/learned.md, "Belady, the bound, and the floor");
    on its quick stream, as a check of the run, the floor misses no more than Belady with bypass."""
    done = run("bench_floor.py", "--requests", "2", "--capacities", "0.01,0.05", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [c["share"] for c in out["capacities"]] == [0.01, 0.05]
    assert all(0 < c["floor_misses"] <= c["belady_misses"] for c in out["capacities"])


def test_bench_ingest_quick_run_reads_polars_rows_and_prints_its_ratios():
    """benchmarks/bench_ingest.py (docs/traces.md): Ingest.csv must read the rows pl.read_csv reads."""
    done = run("bench_ingest.py", "--rows", "2000", "--repeat", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("ratio") == 2 and "peak Python memory" in done.stdout
