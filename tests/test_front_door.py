"""What a new user meets first (issue 20): capacities past the trace, one meaning of --trace,
80-column tables, help texts, and the small messages."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from cachelab import registry
from cachelab.cli import app
from cachelab.engine.cascade import run_policy
from cachelab.policy.unbounded import Unbounded
from cachelab.trace.keytrace import write_oracle_general
from cachelab.trace.kinds import CORPORA, KEY, LOOKUPS, REQUESTS, detect
from cachelab.trace.schema import read_trace, write_trace
from cachelab.workload.lookups import LookupStream

WIDE = {"COLUMNS": "80"}


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A small Zipf key trace: 20 000 requests over a few thousand keys."""
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("keys") / "zipf.npy"
    np.save(path, (rng.zipf(1.2, 20_000) % 5_000).astype(np.int64))
    return path


# ---- 1. memory bounded by the work: a capacity past the keys is an infinite cache ----

@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "wtinylfu", "belady", "fbgemm-lru", "lru+tinylfu"])
def test_a_capacity_past_the_keys_is_an_infinite_cache(keys, policy):
    trace = np.load(keys)
    distinct = np.unique(trace).size
    res = invoke("simulate", "--trace", keys, "--policy", policy, "--capacity", "1000000000", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["infinite"] is True and out["capacity"] == 10**9
    assert out["requests"] - out["hits"] == distinct  # each key misses once: compulsory misses only
    res = invoke("simulate", "--trace", keys, "--policy", policy, "--capacity", "1000000000")
    assert "infinite cache" in res.stdout and f"{distinct:,} distinct keys" in res.stdout
    below = json.loads(invoke("simulate", "--trace", keys, "--policy", policy, "--capacity", "100", "--json").stdout)
    assert below["infinite"] is False and below["hits"] < out["hits"]


def test_the_infinite_cache_is_what_an_evicting_policy_gives_once_it_never_fills(keys):
    """Below and at the number of keys the real policy runs; LRU, which evicts only when full,
    gives the very hits of the infinite cache once it can hold every key."""
    stream = LookupStream.from_keys(np.load(keys))
    ids = np.unique(stream.keys, return_inverse=True)[1]
    n = int(ids.max()) + 1
    offsets = stream.step_offsets
    lru = registry.make_policy("lru")
    lru.reset(n, n)
    assert np.array_equal(lru.run(ids, offsets), run_policy(registry.make_policy("lru"), ids, offsets, n, n))
    cache = Unbounded(registry.make_policy("s3fifo"))
    cache.reset(n, n)
    stepped = np.concatenate([cache.step(ids[i:i + 1000]).hits for i in range(0, ids.size, 1000)])
    again = Unbounded()
    again.reset(n, n)
    assert np.array_equal(stepped, again.run(ids, offsets)) and cache.name == "s3fifo"
    assert np.array_equal(cache.resident(), np.arange(n))


PEAK_RSS = """
import json, sys
from typer.testing import CliRunner
from cachelab.cli import app
from cachelab.serving.hardware.probe import peak_rss_mb
peaks = []
for capacity in ("1000", "1000000000"):  # the peak so far, after the small runs, then after the huge ones
    for verb in (["simulate", "--policy", "s3fifo", "--capacity"], ["mrc", "--policy", "arc", "--capacities"]):
        res = CliRunner().invoke(app, [verb[0], "--trace", sys.argv[1], *verb[1:], capacity, "--json"])
        assert res.exit_code == 0, res.output
    peaks.append(peak_rss_mb())
print(json.dumps(peaks))
"""


def test_peak_memory_does_not_grow_with_the_capacity(keys):
    """Peak RSS of ``simulate`` and ``mrc`` in a fresh process at capacity 10**9 on a trace of a
    few thousand keys: within 64 MiB of the peak the same runs reached at 1 000 rows (a
    capacity-sized state would take gigabytes)."""
    res = subprocess.run([sys.executable, "-c", PEAK_RSS, str(keys)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    small, huge = json.loads(res.stdout.splitlines()[-1])
    assert huge < small + 64, (small, huge)


def test_mrc_marks_the_capacities_that_hold_every_key(keys):
    distinct = np.unique(np.load(keys)).size
    res = invoke("mrc", "--trace", keys, "--capacities", f"10,{distinct},{10 * distinct}", "--json")
    out = json.loads(res.stdout)
    assert out["distinct_keys"] == distinct and out["trace_kind"] == KEY
    assert out["miss_ratios"][1] == out["miss_ratios"][2] == pytest.approx(distinct / np.load(keys).size)
    assert out["infinite"] == [False, True, True]
    assert invoke("mrc", "--trace", keys, "--capacities", f"10,{10 * distinct}").stdout.count("infinite") >= 2
    # a set-associative cache of as many rows as keys still has full sets: not marked, and it misses more
    res = invoke("mrc", "--trace", keys, "--policy", "fbgemm-lru", "--capacities", f"{distinct},{10 * distinct}",
                 "--workers", 1, "--json")
    out = json.loads(res.stdout)
    assert out["infinite"] == [False, True]
    assert out["miss_ratios"][0] > out["miss_ratios"][1] == pytest.approx(distinct / np.load(keys).size)
    shown = invoke("mrc", "--trace", keys, "--policy", "fbgemm-lru", "--capacities", distinct, "--workers", 1).stdout
    assert "infinite" not in shown


# ---- 4. one meaning of --trace ----

@pytest.fixture(scope="module")
def traces(tmp_path_factory, keys):
    """One trace of every kind: keys, a lookup stream, a request trace with text, one with lengths only."""
    folder = tmp_path_factory.mktemp("kinds")
    text = folder / "keys.txt"
    text.write_text("\n".join(map(str, np.load(keys)[:500])) + "\n")
    gamma = ["--arrivals", "gamma", "--arrival-option", "rate=4", "--arrival-option", "num_requests=6"]
    res = invoke("trace", "build", *gamma, "--corpus", "stdlib", "--corpus-option", "max_chars=20000",
                 "-o", folder / "text.parquet", "--json")
    assert res.exit_code == 0, res.output
    write_oracle_general(folder / "keys.oracleGeneral.bin", np.load(keys)[:50])  # imported: lengths, no tokens
    res = invoke("trace", "convert", folder / "keys.oracleGeneral.bin", folder / "lengths.parquet", "--json")
    assert res.exit_code == 0, res.output
    res = invoke("trace", "lookups", "stdlib", "--requests", "4", "-o", folder / "stream.npz", "--json")
    assert res.exit_code == 0, res.output
    made = json.loads(res.stdout)
    assert made["trace_kind"] == CORPORA and made["token_metadata"] and made["lookups"] > 0
    return {"npy": keys, "txt": text, "requests": folder / "text.parquet", "lengths": folder / "lengths.parquet",
            "stream": folder / "stream.npz"}


def test_every_kind_is_detected_and_named(traces):
    assert detect(traces["npy"]).kind == KEY and "npy" in str(detect(traces["npy"]))
    assert detect(traces["txt"]).kind == KEY
    assert detect(traces["requests"]).kind == REQUESTS
    assert detect(traces["stream"]).kind == LOOKUPS
    assert detect("gsm8k,humaneval").kind == CORPORA
    for value, message in (("nosuch.parquet", "no such file"), ("gsm8k,nosuch", "'nosuch' not a registered corpus")):
        res = invoke("simulate", "--trace", value, "--policy", "lru", "--capacity", "10")
        assert res.exit_code == 2 and message in res.output, res.output


@pytest.mark.parametrize("kind", ["npy", "txt", "requests", "stream"])
def test_simulate_and_mrc_take_every_kind_and_say_which(traces, kind):
    res = invoke("simulate", "--trace", traces[kind], "--policy", "lru", "--capacity", "1%")
    assert res.exit_code == 0, res.output
    assert detect(traces[kind]).kind in res.stdout
    res = invoke("mrc", "--trace", traces[kind], "--capacities", "1%,10%", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["trace_kind"] == detect(traces[kind]).kind


def test_a_wrong_kind_says_what_was_found_and_what_the_verb_needs(traces):
    res = invoke("serve-sim", "--trace", traces["npy"], "--hardware", "B200", "--placement", "dram-uva")
    assert res.exit_code == 2 and "found a key trace" in res.output and "needs a request trace" in res.output
    assert "cachelab trace build" in res.output
    res = invoke("pareto", "--trace", "gsm8k", "--hardware", "B200", "--placement", "dram-uva")
    assert res.exit_code == 2 and "found corpus names" in res.output and "--corpus gsm8k" in res.output
    res = invoke("train", "--trace", traces["txt"], "--out", "m")
    assert res.exit_code == 2 and "found a key trace" in res.output and "cachelab trace lookups" in res.output
    res = invoke("trace", "lookups", traces["lengths"], "-o", "x.npz")
    assert res.exit_code == 2 and "lengths only" in res.output and "--corpus" in res.output


def test_an_empty_request_trace_is_called_empty_not_lengths_only(traces, tmp_path):
    empty = tmp_path / "empty.parquet"
    write_trace(read_trace(traces["requests"]).head(0), empty)
    for verb in (["simulate", "--policy", "lru", "--capacity", "10"], ["mrc", "--capacities", "10"],
                 ["train", "--out", str(tmp_path / "m")]):
        res = invoke(*verb, "--trace", empty)
        assert res.exit_code == 2 and "holds no requests" in res.output and "lengths only" not in res.output, res.output


def test_trace_lookups_writes_the_stream_a_request_trace_holds(traces, tmp_path):
    res = invoke("trace", "lookups", traces["requests"], "--requests", "0", "-o", tmp_path / "r.npz", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["trace_kind"] == REQUESTS and out["token_metadata"]
    assert LookupStream.load(tmp_path / "r.npz").num_lookups == out["lookups"] > 0


def test_trace_lookups_of_a_key_trace_keeps_its_first_keys_and_refuses_what_does_not_apply(traces, tmp_path):
    res = invoke("trace", "lookups", traces["npy"], "--requests", "7", "-o", tmp_path / "k.npz", "--json")
    assert res.exit_code == 0, res.output
    stream = LookupStream.load(tmp_path / "k.npz")  # --requests was ignored: all 20,000 keys
    assert json.loads(res.stdout)["lookups"] == stream.num_steps == 7
    assert np.array_equal(stream.keys, np.load(traces["npy"])[:7])
    res = invoke("trace", "lookups", traces["npy"], "-o", tmp_path / "all.npz", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["lookups"] == 20_000  # the default keeps every key
    for kind, flags, named in (("npy", ["--steps", "serving"], "--steps does not apply"),
                               ("txt", ["--seed", "3", "--preset", "engram-27b-demo"], "--seed, --preset do not"),
                               ("requests", ["--seed", "3"], "--seed does not apply"),
                               ("stream", ["--requests", "3"], "saved as it is")):
        res = invoke("trace", "lookups", traces[kind], *flags, "-o", tmp_path / "x.npz")
        assert res.exit_code == 2 and named in res.output and "Traceback" not in res.output, res.output
        assert not (tmp_path / "x.npz").exists()


def test_a_negative_requests_is_refused_not_every_request_but_the_last(traces, tmp_path):
    """polars' head(-3) is every row but the last 3, and a key trace's keys[:-3] every key but the
    last 3: simulate and mrc --requests -3 replayed those, exit 0."""
    for verb in (["trace", "lookups", traces["requests"], "-o", tmp_path / "x.npz"],
                 ["simulate", "--trace", traces["requests"], "--policy", "lru", "--capacity", "10"],
                 ["trace", "lookups", traces["npy"], "-o", tmp_path / "x.npz"]):
        res = invoke(*verb, "--requests", "-3")
        assert res.exit_code == 2 and "--requests" in res.output and "Traceback" not in res.output, res.output
        assert not (tmp_path / "x.npz").exists()
    for verb in (["simulate", "--capacity", "10"], ["mrc", "--capacities", "10"]):
        for kind in ("npy", "txt"):
            res = invoke(*verb, "--trace", traces[kind], "--policy", "lru", "--requests", "-3")
            assert res.exit_code == 2 and "Traceback" not in res.output, res.output
            assert "--requests -3: a key trace takes its first N keys, N >= 1 (0: every key)" in res.output

def test_a_request_with_prompt_ids_but_no_output_ids_is_never_addressed_as_its_prompt_alone(traces, tmp_path):
    """output_len > 0 with empty output_ids: the lookups dropped its decode tokens silently."""
    table = read_trace(traces["requests"])
    assert (table["output_len"] > 0).all() and (table["output_ids"].list.len() > 0).all()
    cut = tmp_path / "cut.parquet"
    write_trace(table.with_columns(output_ids=pl.when(pl.int_range(pl.len()) == 2).then(pl.lit([], pl.List(pl.Int32)))
                                   .otherwise(pl.col("output_ids"))), cut)
    where = "row 2, field 'output_ids' = []: empty while output_len ="
    for verb in (["trace", "lookups", cut, "--requests", "0", "-o", tmp_path / "x.npz"],
                 ["trace", "convert", cut, tmp_path / "x.bin"],
                 ["simulate", "--trace", cut, "--policy", "lru", "--capacity", "10", "--requests", "0"],
                 ["serve-sim", "--trace", cut, "--hardware", "B200", "--placement", "dram-uva"]):
        res = invoke(*verb)
        assert res.exit_code == 2 and where in res.output and str(cut) in res.output, (verb, res.output)
    res = invoke("trace", "lookups", cut, "--requests", "2", "-o", tmp_path / "two.npz")  # rows 0-1 are whole
    assert res.exit_code == 0, res.output
    res = invoke("trace", "info", cut, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["engram"]["requests_without_output_ids"] == 1
    assert "prompt ids but no output ids" in invoke("trace", "info", cut).output


# ---- 5. serve-sim on a lengths-only trace ----

def test_serve_sim_on_lengths_only_points_at_corpus(traces):
    res = invoke("serve-sim", "--trace", traces["lengths"], "--hardware", "B200", "--placement", "dram-uva")
    assert res.exit_code == 2 and "lengths only" in res.output and "--corpus" in res.output


def test_serve_sim_says_unbounded_concurrency(traces):
    res = invoke("serve-sim", "--trace", traces["requests"], "--hardware", "B200", "--placement", "dram-uva",
                 "--tp", "4")
    assert res.exit_code == 0, res.output
    assert "unbounded concurrency" in res.stdout and "None" not in res.stdout


def test_serve_sim_writes_its_memory_plan_in_words(traces):
    """The HBM line printed the plan's keys: row_cache, indexer_buffer."""
    res = invoke("serve-sim", "--trace", traces["requests"], "--hardware", "B200", "--placement", "dram-uva",
                 "--tp", "4", env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    plan = next(line for line in res.stdout.splitlines() if line.startswith("HBM per GPU:"))
    assert " indexer buffer " in plan and " row cache " in plan and "_" not in plan, plan


# ---- 7. 80 columns and help texts ----

def test_policies_list_never_cuts_a_name_at_80_columns():
    res = invoke("policies", "list", env=WIDE)
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    words = set(res.stdout.replace("│", " ").split())
    names = [p.name for p in registry.discover(registry.POLICIES)]
    assert names and all(name in words for name in names), [n for n in names if n not in words]
    assert "…" not in "".join(line.split("│")[1] for line in res.stdout.splitlines() if "│" in line)
    assert "[/" not in res.stdout and "[red]" not in res.stdout
    res = invoke("plugins", "list", env=WIDE)
    assert all(p.name in res.stdout for g in registry.GROUPS for p in registry.discover(g))


def test_pareto_table_fits_80_columns_without_cutting_a_number(traces, tmp_path):
    res = invoke("pareto", "--trace", traces["requests"], "--hardware", "B200", "--placement", "dram-uva",
                 "--tp", "4", "--concurrency", "2", "--plot", tmp_path / "p.png", env=WIDE)
    assert res.exit_code == 0, res.output
    table = [line for line in res.stdout.splitlines() if "│" in line]
    assert table and max(len(line) for line in res.stdout.splitlines()) <= 80 and "…" not in res.stdout
    cells = [c.strip() for c in table[0].split("│")[2:-1]]  # the numbers of the first configuration
    assert all(c and c.replace(",", "").replace(".", "").isdigit() for c in cells), cells


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_texts_render_their_brackets():
    """Every bracketed text of every verb's help (``[position][layer][column]``, ``['npy', ...]``)
    is shown as written, not taken for Rich markup."""
    import re

    import typer

    checked = 0
    for path, command in _commands(typer.main.get_command(app)):
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        wanted = [re.sub(r"\\(\[)", r"\1", m) for t in texts for m in re.findall(r"\\?\[[^\]]*\]", t)]
        if not wanted or not path:
            continue
        shown = re.sub(r"[\s│]", "", invoke(*path, "--help", env=WIDE).stdout)
        for text in wanted:
            assert re.sub(r"\s", "", text) in shown, (path, text)
        checked += 1
    assert checked >= 4


def test_help_text_flows_in_paragraphs():
    """A docstring's line breaks are not kept in --help: at 80 columns they left a ragged line
    every other row, and the verb list showed `calibrate`'s whole docstring over 20 rows."""
    import re

    listing = invoke("--help", env=WIDE).stdout.split("Commands")[1]
    rows = re.findall(r"│ (\S*) +\S", listing)  # a verb's name, or blank on its continuation rows
    verbs = [i for i, name in enumerate(rows) if name]
    assert len(verbs) >= 15 and max(b - a for a, b in zip(verbs, verbs[1:] + [len(rows)])) <= 3, listing
    shown = " ".join(invoke("calibrate", "--help", env={"COLUMNS": "400"}).stdout.split("\n"))
    assert "the fit sets its MFU, MBU and attention MFU, and the per-step, per-sequence" in shown


def test_every_help_fits_80_columns_without_cutting_a_flag():
    """No verb's --help cuts a flag name or a default with "…" at 80 columns (Rich used to shrink
    ``--dram-cache-capacity`` to ``--dram-cache-capaci…`` beside a ``--no-...`` column), and the
    help text keeps room to be read: with ``--no-prefix-caching`` in a column of its own, serve's
    was 14 columns wide, a word or two a line."""
    import re

    import typer

    checked, narrowest = 0, {}
    for path, command in _commands(typer.main.get_command(app)):
        if not path:
            continue
        out = invoke(*path, "--help", env=WIDE).stdout
        assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80, (path, out)
        cells = set(out.replace("│", " ").replace(",", " ").split())
        flags = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
        assert all(f in cells for f in flags), (path, [f for f in flags if f not in cells])
        starts = [m.start(1) for line in out.splitlines() for m in [re.match(r"│[ *]+--\S+.*?<[^>]+> +(\S)", line)] if m]
        narrowest[" ".join(path)] = 79 - max(starts, default=0)
        checked += 1
    assert checked >= 30
    assert min(narrowest.values()) >= 28, sorted(narrowest.items(), key=lambda kv: kv[1])[:3]


def test_help_says_what_an_unset_option_does():
    """A newcomer reading --help learns what leaving a limit out means: --io-threads, serve-sim's
    --concurrency, bench serve's --max-concurrency and serve's --engram-layers said nothing of it."""
    import inspect

    from cachelab.store.backing import DirectBacking, PreadBacking

    def shown(*verb):
        return " ".join(invoke(*verb, "--help", env={"COLUMNS": "400"}).stdout.split())

    pread, direct = (inspect.signature(c.__init__).parameters["io_threads"].default for c in (PreadBacking, DirectBacking))
    assert f"Reads in flight for pread/direct (default: {pread} for pread, {direct} for direct)." in shown("store", "bench")
    assert "At most this many requests in flight (vllm bench --max-concurrency; default: no limit)." in shown("serve-sim")
    assert "At most N requests in flight (clients; default: no limit)." in shown("bench", "serve")
    assert "(the first bounds the prefetch window). Default: the preset's." in shown("serve")


def test_help_says_what_leaving_out_a_flag_does_for_every_optional_limit_and_filter():
    """--admission, --sample-rate, --max-requests, --max-lookups, --output-tokens, the API keys and
    serve's DRAM cache said nothing of what leaving them out does (an open server? no DRAM cache?)."""
    def shown(*verb):
        return " ".join(invoke(*verb, "--help", env={"COLUMNS": "400"}).stdout.split())

    assert "Default: the policy's own (always, every miss admitted, for the built-ins)." in shown("simulate")
    assert "Default: no sampling, every request." in shown("mrc")
    assert "(simulated curves; default: the policy's own)" in shown("mrc")
    assert "Replay only the first N requests (default: all)." in shown("serve-sim")
    assert "Default: the whole trace." in shown("store", "bench")
    from cachelab.trace.build import SynthesisSpec

    build, tokens = shown("trace", "build"), SynthesisSpec.model_fields["output_tokens"].default
    assert "Keep only the first N arrivals (default: all)." in build and f"(default {tokens} tokens)" in build
    assert "SOURCE; default: all)" in shown("trace", "convert")
    assert "Default: none, and --host must be a loopback address." in shown("serve")
    assert "Default: no DRAM warm cache; needs --dram-cache-capacity." in shown("serve")
    assert "Default: none, and --listen must be a loopback address." in shown("capture", "proxy")


# ---- 8. the smaller messages ----

def test_small_messages(keys):
    res = invoke("simulate", "--trace", keys, "--policy", "lru", "--capacity", "0")
    assert res.exit_code == 2 and "None" not in res.output and "less than one row" in res.output
    res = invoke("engram", "info", "--preset", "/missing.toml")
    assert res.exit_code == 2 and "not found: /missing.toml" in res.output


def test_simulate_and_mrc_say_their_counts_in_words(tmp_path, traces):
    """simulate printed "at 1 objects" and "after a warm-up of 0", and called a stream's rows objects."""
    np.save(tmp_path / "two.npy", np.array([7, 7], dtype=np.int64))
    said = " ".join(invoke("simulate", "--trace", tmp_path / "two.npy", "--policy", "lru", "--capacity", 1).stdout.split())
    assert "lru at 1 object: miss ratio 0.5000 (1 miss / 2 requests, no warm-up)" in said, said
    assert "an infinite cache: 1 object holds the 1 distinct key of the trace" in said, said
    said = " ".join(invoke("simulate", "--trace", tmp_path / "two.npy", "--policy", "lru", "--capacity", 1,
                           "--warmup", 1).stdout.split())
    assert "(0 misses / 1 request, after a warm-up of 1 request)" in said, said
    said = " ".join(invoke("simulate", "--trace", traces["stream"], "--policy", "lru", "--capacity", "1%").stdout.split())
    assert re.search(r"lru at [0-9,]+ rows: miss ratio", said) and "object" not in said, said
    said = " ".join(invoke("mrc", "--trace", traces["stream"], "--capacities", "1%").stdout.split())
    assert "; capacities in rows)" in said, said


def test_trace_build_and_info_count_one_request_in_words(tmp_path):
    """A trace of one request read "1 requests in 1 sessions"."""
    res = invoke("trace", "build", "--arrivals", "gamma", "--arrival-option", "rate=4", "--arrival-option",
                 "num_requests=1", "--corpus", "stdlib", "--corpus-option", "max_chars=20000", "-o", tmp_path / "one.parquet")
    assert res.exit_code == 0 and "1 request in 1 session," in " ".join(res.stdout.split()), res.output
    res = invoke("trace", "info", tmp_path / "one.parquet")
    assert res.exit_code == 0 and "1 request in 1 session over" in " ".join(res.stdout.split()), res.output


def test_a_sweeps_summary_reads_as_words_and_units(monkeypatch, capsys):
    """The quickstart's headers broke as "hbm. policy", bytes showed as 3.938e+07 with no unit, and the
    headline named policies by label (S3-FIFO, Belady (bypass)) beside the points' registry names."""
    from cachelab.cli import experiment
    from cachelab.experiment import report

    points = pl.DataFrame({"axis.hbm.policy": ["s3fifo"], "param.hbm.capacity_rows": [29_460],
                           "hbm.miss_ratio": [1.0], "bytes.host_to_gpu": [39_380_000.0]})
    best = pl.DataFrame([{"point": "learned", "capacity": "1%", "capacity_rows": 1473, "learned": "learned-lfu-adaptive",
                          "learned_miss_ratio": 0.98, "best_heuristic": "S3-FIFO", "best_heuristic_miss_ratio": 0.96,
                          "bound": "Belady (bypass)", "bound_miss_ratio": 0.95, "gap_closed": 0.5,
                          "floor_miss_ratio": None}])
    monkeypatch.setattr(report, "summary_tables", lambda data: {"replay": points})
    monkeypatch.setattr(report, "headline", lambda data: best)
    monkeypatch.setenv("COLUMNS", "120")
    experiment._show_all(None, "quickstart")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "policy" in line)
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == [
        "hbm policy", "hbm capacity rows", "hbm miss ratio", "host to gpu bytes"], out
    row = next(line for line in out.splitlines() if "s3fifo" in line)
    assert [cell.strip() for cell in row.strip("│").split("│")] == ["s3fifo", "29,460", "1.0000", "37.6 MiB"], out
    assert "belady-bypass" in out and "Belady (bypass)" not in out and "S3-FIFO" not in out, out
    assert "headline: learned-lfu-adaptive vs" in out, out


@pytest.mark.data
def test_output_paths_are_checked_before_the_work_and_named(tmp_path):
    """A folder that does not exist, or a folder where a file is wanted, stops the verb before
    it computes anything."""
    missing = tmp_path / "no" / "stream.npz"
    res = invoke("trace", "lookups", "gsm8k", "--requests", 2, "-o", missing)
    assert res.exit_code == 2 and f"--out {missing}: the folder {missing.parent} does not exist" in res.output
    res = invoke("study", "inferencex", "--out", tmp_path)
    assert res.exit_code == 2 and f"--out {tmp_path}: is a folder; give a file name" in res.output
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    res = invoke("study", "semianalysis", "--out", a_file / "points", "--fit-evals", 0, "--no-sensitivity")
    assert res.exit_code == 2 and f"--out {a_file / 'points'}: cannot be made a folder (Not a directory)" in res.output
    res = invoke("bench", "serve", "--trace", "t.parquet", "--base-url", "http://127.0.0.1:1", "--model", "m",
                 "--save-result", a_file / "result.json")
    assert res.exit_code == 2 and f"--save-result {a_file}: cannot be made a folder" in res.output
    res = invoke("train", "--trace", "gsm8k", "--requests", 5, "--out", a_file / "model")
    assert res.exit_code == 2 and f"--out {a_file / 'model'}: cannot be made a folder" in res.output
    # a run that fails after the check leaves no empty folder behind (the writer makes it)
    res = invoke("train", "--trace", "gsm8k", "--requests", 2, "--out", tmp_path / "new" / "model")
    assert res.exit_code == 2 and "too short for horizon" in res.output and not (tmp_path / "new").exists()
    res = invoke("trace", "lookups", "gsm8k", "--requests", 2, "-o", a_file / "stream.npz")
    assert res.exit_code == 2 and f"--out {a_file / 'stream.npz'}: the folder {a_file} does not exist" in res.output


def test_a_path_the_os_refuses_is_named_not_a_traceback(tmp_path):
    missing = tmp_path / "missing"
    res = invoke("hw", "probe", "--directory", missing, "--json")  # the probe's temp file goes there
    assert res.exit_code == 2 and f"error: {missing}/" in res.output and "No such file or directory" in res.output


def test_docs_learned_commands_work_as_written(tmp_path, data_dir):
    """docs/learned.md: write the stream, train on it, simulate a learned policy over it; train and
    evaluate count its lookups alike."""
    stream = tmp_path / "stream.npz"
    res = invoke("trace", "lookups", "gsm8k,humaneval", "--requests", "12", "-o", stream, "--json")
    assert res.exit_code == 0, res.output
    written = json.loads(res.stdout)
    res = invoke("train", "--trace", stream, "--horizon", "2048", "--param", "n_estimators=10", "--param",
                 "num_threads=1", "--out", tmp_path / "model", "--json")
    assert res.exit_code == 0, res.output
    trained = json.loads(res.stdout)
    res = invoke("evaluate", "--trace", "gsm8k,humaneval", "--requests", "12", "--model", tmp_path / "model",
                 "--capacities", "0.01", "--json")
    assert res.exit_code == 0, res.output
    assert trained["lookups"] == json.loads(res.stdout)["lookups"] == written["lookups"]
    assert trained["fetches"] < trained["lookups"]
    res = invoke("simulate", "--trace", stream, "--policy", "learned-s3fifo-adaptive", "--capacity", "1%",
                 "--model", tmp_path / "model", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["trace_kind"] == LOOKUPS
    res = invoke("simulate", "--trace", "gsm8k", "--policy", "learned-s3fifo", "--capacity", "1%")
    assert res.exit_code == 2 and "--model" in res.output  # the advice a user can follow


def test_docs_learned_simulate_names_the_keep_model_s_share():
    """docs/learned.md's `simulate --model` wrote the 1% keep model's size as rows (34574, 1% of the
    stream when the page was written) and went stale when the stream changed; it names the share `train`
    was given, whatever the stream's size. The two count different rows (`train` its training window's,
    the model's spec.capacity_rows; `simulate` the whole stream's), so that command runs the model at
    about twice its rows and notes another size, as the page says next to it."""
    import re

    from cachelab.capacity import parse_capacity
    from cachelab.paths import REPO_ROOT

    block = (REPO_ROOT / "docs" / "learned.md").read_text().split("## Commands", 1)[1].split("```", 2)[1]
    trained = parse_capacity(re.search(r"cachelab train .*?--capacity (\S+)", block, re.S).group(1))
    simulated = parse_capacity(re.search(r"cachelab simulate .*?--capacity (\S+)", block).group(1))
    for distinct in (3_450_428, 3_457_413, 1_000):
        assert trained.rows(distinct) == simulated.rows(distinct), (trained.written, simulated.written)


def test_python_dash_m_cachelab_is_the_command_line():
    """``python -m cachelab`` (what a user tries first without the script on PATH) ran nothing:
    the package had no ``__main__``; only ``python -m cachelab.cli`` did."""
    for module in ("cachelab", "cachelab.cli"):
        done = subprocess.run([sys.executable, "-m", module, "engram", "info", "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["bytes_per_token"] > 0
