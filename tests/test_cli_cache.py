"""The simulate / mrc CLI contract: JSON keys, warm-up, stream input, errors with exit status 2."""

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
from experiment_helpers import install_site
from piped_cli import run_piped
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.workload.lookups import LookupStream

runner = CliRunner()
KEYS = (np.random.default_rng(5).zipf(1.2, 5_000) % 300).astype(np.int64)


def _json(args):
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("verb, flag", [("simulate", "--capacity"), ("mrc", "--capacities")])
def test_bytes_of_a_key_trace_are_refused_for_its_sizes_are_not_read(tmp_path, verb, flag):
    """A key trace's objects counted one byte each: --capacity 4MiB of the cloudPhysics oracleGeneral
    file (blocks of 512 B to 68 KiB) was 4,194,304 objects, an infinite cache missing 0.430, where
    libCacheSim's LRU of 4 MiB misses 0.845: a silent wrong answer. An object count or a share still runs."""
    np.save(tmp_path / "k.npy", KEYS)
    base = [verb, "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--json"]
    res = runner.invoke(app, [*base, flag, "4MiB"])
    assert res.exit_code == 2, res.output
    assert f"{flag}: 4MiB is bytes, but a key trace's capacity counts objects" in " ".join(res.output.split())
    assert _json([*base, flag, "50"])["miss_ratio" if verb == "simulate" else "miss_ratios"]


def test_mrc_text_names_its_columns(tmp_path):
    np.save(tmp_path / "k.npy", KEYS)
    res = runner.invoke(app, ["mrc", "--trace", str(tmp_path / "k.npy"), "--capacities", "10,50"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    header = next(i for i, line in enumerate(lines) if "miss-ratio curve" in line) + 1
    assert lines[header].split() == ["capacity", "miss", "ratio"], res.output
    assert lines[header + 1].split()[0] == "10", res.output


def test_simulate_json_contract_and_warmup(tmp_path):
    np.save(tmp_path / "k.npy", KEYS)
    out = _json(["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", "50", "--json"])
    assert {"policy", "capacity", "requests", "hits", "miss_ratio", "seconds"} <= set(out)
    assert out["requests"] == KEYS.size and out["miss_ratio"] == 1 - out["hits"] / KEYS.size
    warm = _json(["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", "50",
                  "--warmup", "0.2", "--json"])
    assert warm["requests"] == 4_000 and warm["warmup_requests"] == 1_000
    assert warm["miss_ratio"] < out["miss_ratio"]  # the cold start is left out
    derived = _json(["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru+tinylfu", "--capacity", "50",
                     "--json"])
    flag = _json(["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--admission", "tinylfu",
                  "--capacity", "50", "--json"])
    assert derived["admission"] == flag["admission"] == "tinylfu" and derived["hits"] == flag["hits"]



def test_simulate_piped_prints_its_result_on_one_line(tmp_path):
    """Piped with no COLUMNS, the result line (114 characters here) broke at 80 columns, its
    warm-up and time on a second line."""
    np.save(tmp_path / "k.npy", KEYS)
    args = ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", "50", "--warmup", "0.2"]
    out = _json([*args, "--json"])
    [line] = [line for line in run_piped(*args).stdout.splitlines() if line.startswith("lru at 50 objects: ")]
    assert f"miss ratio {out['miss_ratio']:.4f} (" in line and ", after a warm-up of 1,000 requests) in " in line \
        and line.endswith(" s"), line

def test_simulate_lookup_stream_counts_lookups_with_step_dedup(tmp_path):
    keys = np.array([1, 1, 2, 1, 3, 3], dtype=np.int64)
    path = LookupStream(keys, np.array([0, 3, 6]), 264).save(tmp_path / "s.npz")
    out = _json(["simulate", "--trace", str(path), "--policy", "lru", "--capacity", "4", "--json"])
    # step 0 fetches 1 and 2 (both miss; the second lookup of 1 shares the miss); step 1 hits 1, misses 3
    assert out["requests"] == 6 and out["hits"] == 1 and out["unique_requests"] == 4


def test_a_stream_of_no_lookups_misses_neither_per_lookup_nor_per_row(tmp_path):
    """Both ratios of no requests are 0, as mrc reports them: unique_miss_ratio was 1.0 beside a
    miss_ratio of 0.0 (1 minus the hit ratio a level that saw nothing reports)."""
    path = LookupStream(np.zeros(0, np.int64), np.array([0, 0, 0]), 264).save(tmp_path / "none.npz")
    out = _json(["simulate", "--trace", str(path), "--policy", "lru", "--capacity", "4", "--json"])
    assert out["requests"] == out["unique_requests"] == 0
    assert out["miss_ratio"] == out["unique_miss_ratio"] == 0.0
    curve = _json(["mrc", "--trace", str(path), "--policy", "lru", "--capacities", "4", "--json"])
    assert curve["miss_ratios"] == [out["miss_ratio"]]


def test_mrc_exact_matches_simulate(tmp_path):
    np.save(tmp_path / "k.npy", KEYS)
    curve = _json(["mrc", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacities", "10,50,200", "--json"])
    assert curve["method"] == "exact-stack" and curve["capacities"] == [10, 50, 200]
    for cap, ratio in zip(curve["capacities"], curve["miss_ratios"]):
        sim = _json(["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", str(cap), "--json"])
        assert sim["miss_ratio"] == ratio


def test_errors_exit_2_with_message(tmp_path):
    np.save(tmp_path / "k.npy", KEYS)
    res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "nope", "--capacity", "5"])
    assert res.exit_code == 2 and "unknown policy 'nope'" in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", "5",
                              "--param", "colour=red"])
    assert res.exit_code == 2 and "has no parameter 'colour'" in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "s3fifo", "--capacity", "5",
                              "--param", "small_size_ratio=abc"])  # was blamed on s3fifo as a failing plug-in
    assert res.exit_code == 2 and "--param.small_size_ratio must be a number, got 'abc'" in res.output
    assert "plug-in" not in res.output
    for flags in (["--policy", "lru", "--admission", "scores"], ["--policy", "lru+scores"]):
        # the filter compares scores only a learned policy writes: unfed, the cache froze once full
        res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--capacity", "5", *flags])
        assert res.exit_code == 2, res.output
        assert "policy 'lru' writes no predictor scores into the scores admission filter" in res.output
        assert "learned-admission --param base=lru" in res.output
    res = runner.invoke(app, ["mrc", "--trace", str(tmp_path / "k.npy"), "--capacities", "10,x"])
    assert res.exit_code == 2 and "'x' is not a capacity" in res.output
    for warmup in ("nan", "inf"):  # were a ValueError / OverflowError traceback
        res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", "5",
                                  "--warmup", warmup])
        assert res.exit_code == 2 and f"--warmup must be a number >= 0, got {warmup}" in res.output


def test_a_bad_warmup_is_refused_naming_the_flag_before_the_trace_loads(tmp_path):
    """--warmup was checked once the trace had loaded (seconds for a large one), its error naming
    no flag ('a warm-up of 1 or more is a step count ...')."""
    missing = str(tmp_path / "not-yet.npy")  # the warm-up is refused first
    for verb in (["simulate", "--capacity", "5"], ["mrc", "--capacities", "5"]):
        for warmup, why in (("-0.5", "must be a number >= 0, got -0.5"),
                            ("1.5", "of 1 or more is a step count and must be whole, got 1.5")):
            res = runner.invoke(app, [*verb, "--trace", missing, "--policy", "lru", "--warmup", warmup])
            assert res.exit_code == 2 and f"--warmup {why}" in res.output, (verb, warmup, res.output)


def test_json_says_which_policy_parameters_and_filter_ran(tmp_path):
    """mrc --json named the policy alone: `--policy lru --admission tinylfu` read as a plain LRU curve, and
    neither verb said which --param values (or a model's) the policy ran with."""
    np.save(tmp_path / "k.npy", KEYS)
    trace = ["--trace", str(tmp_path / "k.npy")]
    for policy, flags, admission in (("lru", ["--admission", "tinylfu"], "tinylfu"), ("lru+tinylfu", [], "tinylfu"),
                                     ("s3fifo", ["--param", "small_size_ratio=0.2"], "always")):
        curve = _json(["mrc", *trace, "--policy", policy, "--capacities", "20,100", "--workers", "1", *flags, "--json"])
        sim = _json(["simulate", *trace, "--policy", policy, "--capacity", "20", *flags, "--json"])
        assert curve["admission"] == sim["admission"] == admission
        assert curve["params"] == sim["params"] and curve["params"]["admission"] == admission
        assert sim["miss_ratio"] == curve["miss_ratios"][0]
    assert curve["params"]["small_size_ratio"] == 0.2
    plain = _json(["mrc", *trace, "--capacities", "20", "--json"])
    assert plain["method"] == "exact-stack" and plain["admission"] == "always"


def test_a_filter_named_twice_two_ways_is_refused(tmp_path):
    """`--policy lru+tinylfu --admission always` ran plain LRU: the flag won and the name's filter was
    dropped in silence. The same filter named twice still runs."""
    np.save(tmp_path / "k.npy", KEYS)
    trace = ["--trace", str(tmp_path / "k.npy")]
    for verb in (["simulate", "--capacity", "20"], ["mrc", "--capacities", "20"]):
        for flag in (["--admission", "always"], ["--param", "admission=always"]):
            res = runner.invoke(app, [verb[0], *trace, "--policy", "lru+tinylfu", *verb[1:], *flag])
            assert res.exit_code == 2, res.output
            assert "policy lru+tinylfu names the admission filter 'tinylfu', and admission='always' another" in res.output
    same = _json(["simulate", *trace, "--policy", "lru+tinylfu", "--admission", "tinylfu", "--capacity", "20", "--json"])
    assert same["params"]["admission"] == "tinylfu"


def test_mrc_sample_rate_help_says_what_it_samples():
    """The help said 'LRU only'; every other policy runs sampled too, as mini-simulations."""
    res = runner.invoke(app, ["mrc", "--help"], env={"COLUMNS": "200"})
    text = " ".join(re.sub(r"[│\s]+", " ", res.output).split())
    assert "LRU only" not in text and "any other policy by mini-simulations at rate x capacity" in text


def test_mrc_checks_params_before_the_trace_loads(tmp_path):
    """As simulate: a wrong --param name or type was found only once the trace had loaded."""
    missing = str(tmp_path / "not-yet.npy")
    for param, why in (("colour=red", "has no parameter 'colour'"),
                       ("small_size_ratio=abc", "--param.small_size_ratio must be a number, got 'abc'")):
        res = runner.invoke(app, ["mrc", "--trace", missing, "--policy", "s3fifo", "--capacities", "10", "--param", param])
        assert res.exit_code == 2 and why in res.output, res.output


@pytest.mark.parametrize("verb", [["simulate", "--capacity", "10"], ["mrc", "--capacities", "10"]])
@pytest.mark.parametrize("policy, flags, why", [
    ("s3fifo", ["--param", "small_size_ratio=2"], "s3fifo small_size_ratio must be in (0, 1), got 2"),
    ("belady-lookahead", ["--param", "window=-1"], "belady-lookahead: window must be >= 0 steps, got -1"),
    ("wtinylfu", ["--param", "window=1.5"], "wtinylfu: window must be in [0, 1), got 1.5"),
    ("lru", ["--admission", "bogus"], "unknown --admission 'bogus'; choose one of ['always', 'scores', 'tinylfu']")])
def test_parameter_values_are_checked_before_the_trace_loads(tmp_path, verb, policy, flags, why):
    """A value out of range (or an unknown filter) was found as the policy built its state, once the
    trace had loaded: here the trace does not exist, and the value is named first (a filter by its
    flag: the refusal said "unknown admission", where the others name theirs)."""
    missing = str(tmp_path / "not-yet.npy")
    res = runner.invoke(app, [verb[0], "--trace", missing, "--policy", policy, *verb[1:], *flags])
    assert res.exit_code == 2 and why in res.output and "not-yet" not in res.output, res.output


def test_mrc_sampled_and_simulated_methods(tmp_path):
    np.save(tmp_path / "k.npy", KEYS)
    shards = _json(["mrc", "--trace", str(tmp_path / "k.npy"), "--capacities", "20,100", "--sample-rate", "0.5", "--json"])
    assert shards["method"] == "shards" and shards["sample_rate"] == 0.5
    sim = _json(["mrc", "--trace", str(tmp_path / "k.npy"), "--policy", "fifo", "--capacities", "20,100",
                 "--workers", "1", "--json"])
    assert sim["method"] == "simulation" and sim["miss_ratios"][0] > sim["miss_ratios"][1]


def test_a_bad_sample_rate_is_refused_naming_the_flag_before_the_trace_loads(tmp_path):
    """``--sample-rate`` was checked only once the trace had loaded, with no flag named; a rate
    under the hash's resolution was read as an empty sample of this trace; ``--workers`` below 1
    passed in silence."""
    missing = str(tmp_path / "not-yet.npy")  # the rate is refused first
    for rate, why in (("nan", "must be in \\(0, 1\\], got nan"), ("inf", "must be in \\(0, 1\\], got inf"),
                      ("-inf", "must be in \\(0, 1\\], got -inf"), ("0", "must be in \\(0, 1\\], got 0.0"),
                      ("-0.1", "must be in \\(0, 1\\], got -0.1"), ("1.5", "must be in \\(0, 1\\], got 1.5"),
                      ("1e-9", "1e-09 is under half the sampling hash's resolution \\(2\\^-25 = 2.98e-08, where its "
                       "threshold rounds to 0\\): it keeps no key"),
                      ("2.9e-8", "2.9e-08 is under half the sampling hash's resolution \\(2\\^-25 = 2.98e-08")):
        res = runner.invoke(app, ["mrc", "--trace", missing, "--capacities", "10", "--sample-rate", rate, "--json"])
        assert res.exit_code == 2 and re.search(f"--sample-rate {why}", res.output), (rate, res.output)
    # under 2^-24 but over 2^-25 the threshold rounds to 1: a sample of 2^-24, not refused (the trace is)
    res = runner.invoke(app, ["mrc", "--trace", missing, "--capacities", "10", "--sample-rate", "5e-8"])
    assert res.exit_code == 2 and "no such file" in res.output and "sample-rate" not in res.output, res.output
    for workers in (0, -2):  # ran on all cores, on one
        res = runner.invoke(app, ["mrc", "--trace", missing, "--capacities", "10", "--workers", str(workers)])
        assert res.exit_code == 2 and f"--workers must be at least 1, got {workers}" in res.output, res.output
    np.save(tmp_path / "k.npy", KEYS)
    out = _json(["mrc", "--trace", str(tmp_path / "k.npy"), "--capacities", "20,1000", "--sample-rate", "1", "--json"])
    exact = _json(["mrc", "--trace", str(tmp_path / "k.npy"), "--capacities", "20,1000", "--json"])
    assert out["sample_rate"] == 1.0 and out["miss_ratios"] == pytest.approx(exact["miss_ratios"], rel=1e-12)
    assert out["infinite"] == exact["infinite"] == [False, True]


def test_an_empty_sample_is_refused_naming_the_flag(tmp_path):
    """A rate that keeps none of this trace's keys is found once the trace has loaded; the refusal
    said "sample rate", where the others name ``--sample-rate`` (the library's still says "sample rate")."""
    np.save(tmp_path / "k.npy", np.array([1, 2, 3, 1, 2, 3, 4]))
    for policy in ("lru", "fifo"):  # SHARDS and mini-simulations
        res = runner.invoke(app, ["mrc", "--trace", str(tmp_path / "k.npy"), "--policy", policy, "--capacities", "1,2",
                                  "--sample-rate", "0.001", "--workers", "1"])
        assert res.exit_code == 2, res.output
        assert "--sample-rate 0.001 keeps none of the 4 distinct keys' requests after the warm-up" in res.output, res.output


def test_capacities_a_sample_cannot_resolve_are_refused_naming_the_flag(tmp_path):
    """``mrc --capacities 10,1000 --sample-rate 0.01``: the refusal said "sample at a rate of at least
    0.10000002", naming neither the flag nor the value given; now both, and the value to give."""
    np.save(tmp_path / "k.npy", np.arange(5_000) % 2_000)
    for policy in ("lru", "fifo"):  # SHARDS and mini-simulations
        res = runner.invoke(app, ["mrc", "--trace", str(tmp_path / "k.npy"), "--policy", policy, "--capacities",
                                  "10,1000", "--sample-rate", "0.01", "--workers", "1"])
        assert res.exit_code == 2, res.output
        said = " ".join(res.output.split())
        assert "capacities 10 hold under one row of a sample at --sample-rate 0.01 (its hash keeps" in said, said
        assert "drop them, or give --sample-rate 0.10000002 or more" in said, said


@pytest.mark.parametrize("verb", [["simulate", "--capacity", "10"], ["mrc", "--capacities", "10"],
                                  ["policies", "check", "lru"],
                                  ["store", "bench", "--capacity", "10", "--backing", "dram", "--dir", "no-store"]])
def test_an_unknown_admission_param_is_refused_naming_the_param(tmp_path, verb):
    """``--param admission=bogus`` reached the policy, whose refusal said "unknown admission 'bogus'"
    (no flag) once it built its state, and ``policies check`` ran all its checks into it (9 of 11
    failed, exit 1); now every verb refuses it before any work, naming ``--param admission`` and
    the filters there are."""
    np.save(tmp_path / "k.npy", np.arange(50) % 20)
    trace = [] if verb[0] == "policies" else ["--trace", str(tmp_path / "k.npy"), "--policy", "lru"]
    res = runner.invoke(app, [*verb, *trace, "--param", "admission=bogus"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "unknown --param admission 'bogus'; choose one of ['always', 'scores', 'tinylfu']" in said, said


def test_requests_and_steps_apply_where_the_trace_takes_them(tmp_path):
    """simulate/mrc --requests N on a key trace replays its first N keys (default: all), as `trace lookups`
    does; --steps on a key trace and either flag on a lookup stream are refused, naming the flag. (The
    key trace's --requests was ignored, every key replayed, exit 0; --steps serving likewise.)"""
    np.save(tmp_path / "k.npy", KEYS)
    key = str(tmp_path / "k.npy")
    first = _json(["simulate", "--trace", key, "--policy", "lru", "--capacity", "50", "--requests", "1000", "--json"])
    assert first["requests"] == 1_000
    head = tmp_path / "head.npy"
    np.save(head, KEYS[:1000])
    assert first["hits"] == _json(["simulate", "--trace", str(head), "--policy", "lru", "--capacity", "50",
                                   "--json"])["hits"]
    curve = _json(["mrc", "--trace", key, "--capacities", "10,50", "--requests", "1000", "--json"])
    assert curve["requests"] == 1_000
    stream = LookupStream.from_keys(KEYS).save(tmp_path / "s.npz")
    for verb in (["simulate", "--policy", "lru", "--capacity", "50"], ["mrc", "--capacities", "10,50"]):
        for trace, flags, named in ((key, ["--steps", "serving"], "--steps does not apply"),
                                    (str(stream), ["--requests", "3"], "--requests does not apply")):
            res = runner.invoke(app, [*verb, "--trace", trace, *flags])
            assert res.exit_code == 2 and named in res.output, res.output


def test_a_model_beside_a_policy_that_reads_no_scores_is_refused(tmp_path):
    """simulate --model with a heuristic scored the whole stream and replayed without the
    scores, saying nothing (serve refuses it); refused now before the trace or model is read."""
    res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "not-yet.npz"), "--policy", "lru",
                              "--capacity", "5", "--model", str(tmp_path / "no-model")])
    assert res.exit_code == 2 and ("--policy lru reads no predictor scores; --model is for a learned policy"
                                   in res.output), res.output


def test_mrc_of_a_learned_policy_says_mrc_takes_no_model(tmp_path):
    """mrc --policy learned-lfu read the trace, then failed in the replay with 'none were given to
    the replay', a flag it does not have left unsaid."""
    res = runner.invoke(app, ["mrc", "--trace", str(tmp_path / "not-yet.npz"), "--policy", "learned-lfu",
                              "--capacities", "5,10"])
    assert res.exit_code == 2 and ("--policy learned-lfu needs predictor scores, and mrc takes no model: "
                                   "`cachelab simulate --model DIR`") in res.output, res.output


STALL = {  # a plug-in policy that says when the replay is under way, then takes 10 ms a miss
    "stallpolicy/__init__.py": """
        import os
        import time
        from pathlib import Path

        from cachelab.policy import PythonPolicy

        class Stall(PythonPolicy):
            name = "stall"

            def victim(self, key):
                Path(os.environ["STALL_MARK"]).touch()
                time.sleep(0.01)
                return 0
        """,
    "cachelab_stall-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-stall\nVersion: 0.1\n",
    "cachelab_stall-0.1.dist-info/entry_points.txt": "[cachelab.policies]\nstall = stallpolicy:Stall\n",
}


@pytest.mark.parametrize("verb, args, whole_group", [
    ("simulate", ["--capacity", "10"], True),
    ("mrc", ["--capacities", "10,20,30", "--workers", "2"], True),
    ("mrc", ["--capacities", "10,20,30", "--workers", "2"], False)])
def test_ctrl_c_mid_replay_says_nothing_was_written_and_exits_130(tmp_path, monkeypatch, verb, args, whole_group):
    """Only the trace's read said what Ctrl-C left; in the replay simulate exited 130 saying nothing,
    and mrc never ended: its process pool's exit ran every queued capacity first (each a whole
    simulation here), and Ctrl-C at a terminal reached its workers too. The whole run now ends at
    once with one line; a worker leaves Ctrl-C to mrc, which ends the pool."""
    install_site(tmp_path, STALL, monkeypatch)
    np.save(tmp_path / "k.npy", np.arange(100_000, dtype=np.int64))  # every request a miss: 1000 s a capacity
    mark = tmp_path / "replaying"
    proc = subprocess.Popen([sys.executable, "-m", "cachelab", verb, "--trace", str(tmp_path / "k.npy"), "--policy",
                             "stall", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, "STALL_MARK": str(mark), "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 240
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, proc.communicate()
        if whole_group:  # as a terminal's Ctrl-C: the process and the workers it forked
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of a run that did not end
        except ProcessLookupError:
            pass
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"{verb} interrupted: nothing was written", err
    assert "Traceback" not in err and out == "", err


COMPILING = """
import os, signal, sys
from llvmlite.binding import executionengine

plain, sent = executionengine.ExecutionEngine.set_object_cache, []


def set_object_cache(self, notify_func=None, getbuffer_func=None):
    def getbuffer(module):  # LLVM asks for a kept object as it starts compiling: Ctrl-C lands here
        if not sent:  # once: the handler runs as soon as kill returns
            sent.append(module)
            os.kill(os.getpid(), signal.SIGINT)
        return getbuffer_func(module)

    return plain(self, notify_func, getbuffer)


executionengine.ExecutionEngine.set_object_cache = set_object_cache
from cachelab.cli import main

main(sys.argv[1:])
"""


def test_ctrl_c_while_numba_compiles_says_nothing_was_written_and_exits_130(tmp_path):
    """Ctrl-C while LLVM compiled a kernel (a fresh Numba cache's first seconds) was taken by
    Python in LLVM's object-cache callback, where ctypes prints it as ignored: simulate either
    finished and exited 0, or Numba found no object code to cache and died with a traceback
    (RuntimeError: no compiled object yet). It is now raised once LLVM returns."""
    np.save(tmp_path / "k.npy", KEYS)
    proc = subprocess.run([sys.executable, "-c", COMPILING, "simulate", "--trace", str(tmp_path / "k.npy"),
                           "--policy", "lru", "--capacity", "50"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
                               "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["simulate interrupted: nothing was written"], proc.stderr
    assert proc.stdout == "", proc.stdout
