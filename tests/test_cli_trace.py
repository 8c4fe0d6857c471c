"""The trace build spec (TOML or flags): what it accepts, what it refuses, and how it says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from piped_cli import run_piped

from cachelab.cli import app

runner = CliRunner()

SPEC = """
seed = 4
[arrivals]
source = "gamma"
options = { rate = 3.0, burstiness = 0.5, num_requests = 25 }
[corpus]
source = "stdlib"
options = { max_chars = 200000 }
[synthesis]
output_tokens = 16
turn_gap_s = 2.0
chunk_tokens = 5000
"""


def run(*args):
    return runner.invoke(app, ["trace", *map(str, args)])


def test_spec_and_equal_flags_build_the_same_trace(tmp_path):
    spec = tmp_path / "w.toml"
    spec.write_text(SPEC)
    res = run("build", spec, "-o", tmp_path / "a.parquet", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["requests"] == 25 and report["tokens_out"] > 0
    res = run("build", "--arrivals", "gamma", "--arrival-option", "rate=3.0", "--arrival-option", "burstiness=0.5",
              "--arrival-option", "num_requests=25", "--corpus", "stdlib", "--corpus-option", "max_chars=200000",
              "--seed", "4", "-o", tmp_path / "b.parquet", "--json")
    assert res.exit_code == 0, res.output
    spec.write_text(SPEC.replace("output_tokens = 16", "output_tokens = 256").replace("turn_gap_s = 2.0", "")
                    .replace("chunk_tokens = 5000", ""))
    res = run("build", spec, "-o", tmp_path / "c.parquet")
    assert res.exit_code == 0
    assert (tmp_path / "b.parquet").read_bytes() == (tmp_path / "c.parquet").read_bytes()
    info = json.loads(run("info", tmp_path / "a.parquet", "--json", "--engram-tokens", "20000").stdout)
    assert info["requests"] == 25 and set(info["domains"]) <= {"code", "docstring"}
    assert info["engram"]["tokens"] == 20000 and len(info["engram"]["skew"]) == 8
    assert 0 <= info["block_hit_ratio"]["16"] < 1
    text = run("info", tmp_path / "a.parquet", "--engram-tokens", "0")
    assert text.exit_code == 0 and "prefix-block hit ratio at 16 tokens" in text.output


@pytest.mark.parametrize("spec, message", [
    ('[arrivals]\nsource = "gamma"\nrate = 2', "arrivals.rate: unknown key"),
    ('seed = "x"\n[arrivals]\nsource = "gamma"', "seed: Input should be a valid integer"),
    ('[arrivals]\nsource = "gamma"\noptions = { speed = 2 }', "takes no option(s) ['speed']"),
    # an option of the wrong type reached the source: a plug-in's TypeError, or true read as 1 request
    ('[arrivals]\nsource = "gamma"\noptions = { num_requests = 2.5 }\n[corpus]\nsource = "gsm8k"',
     "arrivals.options.num_requests must be an integer or none, got 2.5"),
    ('[arrivals]\nsource = "gamma"\noptions = { num_requests = true }\n[corpus]\nsource = "gsm8k"',
     "arrivals.options.num_requests must be an integer or none, got True"),
    ('[arrivals]\nsource = "gamma"\noptions = { rate = "2", num_requests = 3 }\n[corpus]\nsource = "gsm8k"',
     "arrivals.options.rate must be a number, got '2'"),
    ('[arrivals]\nsource = "gamma"\noptions = { duration_s = inf }\n[corpus]\nsource = "gsm8k"',
     "duration_s must be a finite number of seconds > 0"),
    ('[arrivals]\nsource = "gamma"\noptions = { num_requests = 3 }\n[corpus]\nsource = "stdlib"\n'
     'options = { max_chars = "many" }', "corpus.options.max_chars must be an integer or none, got 'many'"),
    ('[arrivals]\nsource = "nope"', "unknown workload 'nope'"),
    ('[arrivals]\nsource = "arena-hard"', "is a corpus, not an arrival source"),
    ('[arrivals]\nsource = "gamma"\noptions = { num_requests = 3 }', "carry no lengths: give a [corpus]"),
    ('[arrivals\nsource = "gamma"', "not valid TOML"),
    ('[arrivals]\nsource = "mooncake"\n[corpus]\nsource = "gsm8k"',
     "workload 'mooncake' needs path (the arrivals file or folder: --arrivals-path, or arrivals.path in a spec)"),
])
def test_bad_specs_are_clear_errors(tmp_path, spec, message):
    path = tmp_path / "bad.toml"
    path.write_text(spec)
    res = run("build", path, "-o", tmp_path / "o.parquet")
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o.parquet").exists()


MOONCAKE = ["--arrivals", "mooncake", "--arrivals-path", "traces/mooncake_fast25/conversation_trace.jsonl",
            "--max-requests", "5"]


@pytest.mark.parametrize("flags, message", [
    (["--prefixes", "3"], "synthesis.prefixes (--prefixes): apply to synthesis, and this build imports 'mooncake'"),
    (["--output-tokens", "9", "--no-lengths"], "synthesis.output_tokens (--output-tokens), arrivals.use_lengths = "
                                                "false (--no-lengths): apply to synthesis"),
    (["--seed", "4"], "seed (--seed): apply to synthesis"),
    (["--corpus", "gsm8k", "--prompt-tokens", "64"], "synthesis.prompt_tokens (--prompt-tokens): apply to a "
                                                     "shared-prefix workload only"),
])
def test_build_settings_it_would_not_read_are_refused(tmp_path, data_dir, flags, message):
    """Each was ignored: the import wrote the very trace it writes without them, exit 0."""
    res = run("build", *MOONCAKE, *flags, "-o", tmp_path / "o.parquet")
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "o.parquet").exists()
    spec = tmp_path / "s.toml"  # a spec is held to it too
    spec.write_text('seed = 1\n[arrivals]\nsource = "azure"\npath = "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"'
                    '\n[synthesis]\nturn_gap_s = 2.0\n')
    res = run("build", spec, "-o", tmp_path / "o.parquet")
    assert res.exit_code == 2 and "synthesis.turn_gap_s, seed (--seed): apply to synthesis" in res.output, res.output
    res = run("build", *MOONCAKE, "-o", tmp_path / "o.parquet", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["requests"] == 5

def test_from_capture_and_a_source_without_input_refuse_the_flags_they_ignore(tmp_path):
    """--from-capture DIR --max-requests 3 wrote every request of the capture; --skip-bad on
    gamma arrivals (no input file) did nothing; both exit 0."""
    res = run("build", "--from-capture", tmp_path, "--max-requests", "3", "--seed", "1", "-o", tmp_path / "o.parquet")
    assert res.exit_code == 2 and "(--seed, --max-requests given)" in res.output, res.output
    res = run("build", "--arrivals", "gamma", "--arrival-option", "rate=2", "--arrival-option", "num_requests=3",
              "--corpus", "gsm8k", "--skip-bad", "-o", tmp_path / "o.parquet")
    assert res.exit_code == 2 and "arrivals.skip_bad (--skip-bad): 'gamma' reads no input rows" in res.output
    assert not (tmp_path / "o.parquet").exists()

def test_info_on_a_non_trace_is_a_clear_error(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1 nonsense")
    res = run("info", tmp_path / "x.parquet")
    assert res.exit_code == 2 and "not a Parquet file" in res.output
    (tmp_path / "keys.txt").write_text("1\n2\n")
    res = run("info", tmp_path / "keys.txt")  # another kind of trace is named as what it is
    assert res.exit_code == 2 and "found a key trace" in res.output and "needs a request trace (.parquet)" in res.output


def test_info_refuses_a_negative_engram_token_count(tmp_path):
    """--engram-tokens -3 reported no skew, as 0 does, exit 0."""
    res = run("build", "--arrivals", "gamma", "--arrival-option", "rate=2", "--arrival-option", "num_requests=2",
              "--corpus", "gsm8k", "-o", tmp_path / "g.parquet")
    assert res.exit_code == 0, res.output
    res = run("info", tmp_path / "g.parquet", "--engram-tokens", "-3")
    assert res.exit_code == 2 and "--engram-tokens" in res.output, res.output


@pytest.mark.parametrize("name", ["t.csv", "t.jsonl", "t"])
def test_a_trace_out_not_named_parquet_is_refused_before_any_work(tmp_path, name):
    """It was written as Parquet under any name: `-o t.csv` made a Parquet file called t.csv."""
    out = tmp_path / name
    res = runner.invoke(app, ["trace", "build", "--arrivals", "gamma", "--arrival-option", "rate=2",
                              "--arrival-option", "num_requests=3", "--corpus", "gsm8k", "-o", str(out)])
    assert res.exit_code == 2 and f"--out {out}: a trace is written as Parquet" in res.output, res.output
    assert not out.exists()


def test_token_totals_past_int32_are_exact(tmp_path):
    """The schema's counts are int32; their sum over a large trace is not (two rows wrapped to -2)."""
    csv = tmp_path / "AzureLLMInferenceTrace_code.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:17:03.0,2147483647,2147483647\n2023-11-16 18:17:04.0,2147483647,1\n")
    res = run("build", "--arrivals", "azure", "--arrivals-path", csv, "-o", tmp_path / "t.parquet", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["tokens_in"] == 2 * (2**31 - 1) and report["tokens_out"] == 2**31


def test_the_build_says_how_many_sessions_its_requests_form(tmp_path, data_dir):
    """gamma's num_requests counts sessions: 3 of mt-bench's two-turn conversations are 6 requests,
    which the build said without a word of the 3 asked for."""
    args = ("build", "--arrivals", "gamma", "--arrival-option", "rate=2", "--arrival-option", "num_requests=3",
            "--corpus", "mt-bench")
    report = json.loads(run(*args, "-o", tmp_path / "a.parquet", "--json").stdout)
    assert report["requests"] == 6 and report["sessions"] == 3
    text = run(*args, "-o", tmp_path / "b.parquet")
    assert text.exit_code == 0 and "6 requests in 3 sessions" in " ".join(text.output.split()), text.output
    imported = json.loads(run("build", *MOONCAKE, "-o", tmp_path / "m.parquet", "--json").stdout)
    assert imported["requests"] == 5 and 1 <= imported["sessions"] <= 5


def test_info_skew_addresses_what_serving_feeds_through_the_model(tmp_path):
    """Each request's prompt and every output token but the last (emitted, never fed back: the
    serving streams have no lookups for it), so the skew counts the rows serving reads."""
    import polars as pl

    from cachelab.trace.schema import conform, write_trace

    write_trace(conform(pl.DataFrame({
        "request_id": [0, 1], "session_id": [0, 1], "turn": [0, 0], "arrival_s": [0.0, 1.0], "domain": ["code"] * 2,
        "prompt_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "output_ids": [[9], [10, 11]], "prompt_len": [3, 5],
        "output_len": [1, 2], "block_hashes": [None, None], "block_size": [None, None], "source": ["test"] * 2})),
        tmp_path / "t.parquet")
    info = json.loads(run("info", tmp_path / "t.parquet", "--json").stdout)
    assert info["engram"]["tokens"] == 3 + 0 + 5 + 1


def test_a_corpus_path_option_is_read_under_the_data_root(tmp_path, monkeypatch):
    """corpus.options.path (`--corpus-option path=...`, a plug-in corpus's file) went to the corpus as
    written, read from the working directory, while arrivals.path, the docs and an experiment point's
    hash took it under the data root (seen by helper-130)."""
    from cachelab.errors import CachelabError
    from cachelab.trace import build as trace_build
    from cachelab.trace.corpus import Document

    class Lines:  # a plug-in corpus that reads the file it is given
        def __init__(self, path):
            self.path = path

        def documents(self):
            with open(self.path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    yield Document(doc_id=str(i), domain="lines", text=line)

    real = trace_build.registry.get
    monkeypatch.setattr(trace_build.registry, "get", lambda group, name: Lines if name == "lines" else real(group, name))
    (tmp_path / "data" / "prompts").mkdir(parents=True)
    (tmp_path / "data" / "prompts" / "lines.txt").write_text("the cat sat on the mat\n" * 50)
    monkeypatch.setenv("CACHELAB_DATA", str(tmp_path / "data"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    def spec(path):
        return trace_build.parse_spec({"arrivals": {"source": "gamma", "options": {"rate": 2.0, "num_requests": 3}},
                                       "corpus": {"source": "lines", "options": {"path": path}}}, "test")

    assert trace_build.build(spec("prompts/lines.txt"), tmp_path / "t.parquet").requests == 3
    with pytest.raises(CachelabError, match="corpus.options.path: data file not found: .*prompts/none.txt"):
        trace_build.build(spec("prompts/none.txt"), tmp_path / "u.parquet")


def test_the_spec_format_example_builds_as_written(tmp_path, data_dir):
    """docs/traces.md sends readers to cachelab/trace/build.py for the spec format: its example,
    copied as it stands, builds (it set turn_gap_s beside prefix_overlap, which a build refuses)."""
    import cachelab.trace.build as build

    spec = tmp_path / "w.toml"
    spec.write_text(build.__doc__.split("```toml")[1].split("```")[0])
    res = run("build", spec, "--max-requests", 20, "-o", tmp_path / "w.parquet", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["requests"] == 20


def test_an_output_the_file_system_refuses_is_an_error_naming_it(tmp_path):
    """A full disk or a file size limit ended `trace build`, `trace lookups` and `trace convert` in
    pyarrow's or NumPy's traceback (docs/robustness.md: none); each is `error: FILE: reason`, exit
    2, the file the name held before kept whole."""
    import resource

    spec = tmp_path / "w.toml"
    spec.write_text(SPEC)
    trace = tmp_path / "t.parquet"
    commands = {trace: ("build", spec, "-o", trace), tmp_path / "s.npz": ("lookups", trace, "-o", tmp_path / "s.npz"),
                tmp_path / "k.bin": ("convert", trace, tmp_path / "k.bin")}
    for out, args in commands.items():  # whole first (and the compiled kernels cached, whose writes the limit hits too)
        res = run(*args)
        assert res.exit_code == 0 and out.stat().st_size > 1024, res.output
    before = {out: out.read_bytes() for out in commands}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # Python ignores SIGXFSZ: a write gets EFBIG
    try:
        results = {out: run(*args) for out, args in commands.items()}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    for out, res in results.items():
        assert res.exit_code == 2 and f"error: {out}: File too large" in res.output, res.output
        assert out.read_bytes() == before[out]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.bin", "s.npz", "t.parquet", "w.toml"]


def test_ctrl_c_while_writing_says_the_old_trace_is_kept_whole(tmp_path):
    """Ctrl-C mid-build exited 130 saying nothing: whether --out held a cut file, the old trace or
    the new was left to guess. Interrupted as its scratch file is written: the old bytes stay, the
    scratch file goes, and one line says so."""
    out = tmp_path / "t.parquet"
    out.write_bytes(b"the trace before")
    proc = subprocess.Popen([sys.executable, "-m", "cachelab", "trace", "build", "--arrivals", "gamma",
                             "--arrival-option", "rate=2", "--arrival-option", "num_requests=20000",
                             "--corpus", "stdlib", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".t.parquet.*.partial")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # -SIGINT where the interrupt came inside exec'd code (a dataclass made by a lazy import): CPython 3.11 then
    # marks it unhandled, though caught, and ends the process by SIGINT at exit; a shell reads both as 130
    assert proc.returncode in (130, -signal.SIGINT), err
    assert err.strip().splitlines()[-1] == f"trace build interrupted: {out} keeps its previous trace, " \
                                           "whole; the partial file was removed"
    assert out.read_bytes() == b"the trace before" and sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_build_and_info_piped_keep_each_line_whole(tmp_path):
    """Piped with no COLUMNS, Rich broke every line at 80 columns: a script reading ``wrote OUT: ...``
    got the path on one line and the counts on the next."""
    spec = tmp_path / "w.toml"
    spec.write_text(SPEC)
    out = tmp_path / "a-folder-with-a-name-long-enough-to-take-a-line-past-eighty-columns" / "t.parquet"
    out.parent.mkdir()
    built = run_piped("trace", "build", str(spec), "-o", str(out)).stdout.splitlines()
    assert built[0].startswith(f"wrote {out}: 25 requests in ") and built[0].endswith(" output tokens"), built
    shown = run_piped("trace", "info", str(out), "--engram-tokens", "0").stdout.splitlines()
    assert shown[0].startswith(f"{out}: 25 requests in ") and shown[0].endswith(" out"), shown
