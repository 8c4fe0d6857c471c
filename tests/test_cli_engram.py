"""The engram CLI contract: JSON keys, text-file fidelity, errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from piped_cli import run_piped

from cachelab.cli import app

runner = CliRunner()


def test_rows_json_matches_worked_example():
    res = runner.invoke(app, ["engram", "rows", "--preset", "deepseek-v4.1-flash", "--bos", "--json",
                              "--text", "Only Alexander the Great could tame the horse Bucephalus."])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"preset", "token_ids", "compressed_ids", "rows"}
    assert data["token_ids"][:3] == [0, 22898, 19737]
    assert data["rows"][3][0][10] == 164060325
    assert len(data["rows"][0]) == 2 and len(data["rows"][0][0]) == 24


def test_text_file_is_read_as_stored(tmp_path):
    crlf, lf = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    crlf.write_bytes(b"a\r\nb")
    lf.write_bytes(b"a\nb")
    ids = []
    for f in (crlf, lf):
        res = runner.invoke(app, ["engram", "rows", "--text-file", str(f), "--json"])
        assert res.exit_code == 0
        ids.append(json.loads(res.stdout)["token_ids"])
    assert ids[0] != ids[1]


def test_info_json():
    res = runner.invoke(app, ["engram", "info", "--json"])
    data = json.loads(res.stdout)
    assert data["table_rows"] == {"1": 384006168, "14": 384016682}
    assert data["rows_per_token"] == 48 and data["row_bytes"] == 264
    demo = json.loads(runner.invoke(app, ["engram", "info", "--preset", "engram-27b-demo", "--json"]).stdout)
    assert "V4 compressed map" in demo["note"]



def test_piped_rows_and_info_print_each_layer_s_ids_on_one_line():
    """rows' table was printed 200 columns wide whatever the output: piped, a layer's 24 row ids
    wrapped over two lines, and info's 80 columns of a pipe broke each layer's primes."""
    data = json.loads(runner.invoke(app, ["engram", "rows", "--text", "hi there", "--json"]).stdout)
    shown = run_piped("engram", "rows", "--text", "hi there").stdout
    for position in data["rows"]:
        for ids in position:
            assert [line for line in shown.splitlines() if " ".join(map(str, ids)) in line], shown
    primes = json.loads(runner.invoke(app, ["engram", "info", "--json"]).stdout)["primes"]
    shown = run_piped("engram", "info").stdout.splitlines()
    for layer, values in primes.items():
        assert [line for line in shown if line.startswith(f"  layer {layer}: ") and line.endswith(f"{values}")], shown

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cachelab.cli", *args], capture_output=True, text=True)


def test_errors_exit_nonzero_naming_the_value(tmp_path):
    res = _cli("engram", "rows", "--preset", "no-such", "--text", "x")
    assert res.returncode == 2 and "no-such" in res.stderr and "Traceback" not in res.stderr
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\xff")
    res = _cli("engram", "rows", "--text-file", str(bad))
    assert res.returncode == 2 and "bad.txt is not UTF-8" in res.stderr


def test_preset_help_names_the_layout_files_each_verb_takes(tmp_path):
    """``--preset`` takes a layout .toml/.json too; the help of rows, info and page-cache named the
    two presets only."""
    for verb in ("rows", "info", "page-cache"):
        res = runner.invoke(app, ["engram", verb, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0 and "layout .toml/.json file" in res.stdout, res.stdout
    spec = tmp_path / "tiny.toml"
    spec.write_text('layers = [3]\nmax_ngram = 3\nheads = 2\nbase_sizes = [1000, 2000]\nrow_dim = 64\nrow_dtype = "bf16"\n')
    res = runner.invoke(app, ["engram", "info", "--preset", str(spec), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["table_rows"] == {"3": 1009 + 1013 + 2003 + 2011}


def test_page_cache_of_a_workload_that_is_no_text_corpus_names_the_corpora():
    """``--corpus azure`` (an arrival trace, built with a path) was built without one before being
    asked for documents: a TypeError traceback, where ``gamma`` got 'not a text corpus'."""
    for name in ("azure", "gamma"):
        res = _cli("engram", "page-cache", "--corpus", name, "--max-tokens", "10")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert f"--corpus '{name}' is not a text corpus" in res.stderr and "stdlib" in res.stderr


def test_text_argument_not_utf8_is_refused_like_a_text_file():
    """A shell argument with an undecodable byte reaches Python as a lone surrogate; the tokenizer
    raised a TypeError traceback for it, where --text-file says the file is not UTF-8."""
    res = subprocess.run([sys.executable, "-m", "cachelab.cli", "engram", "rows", "--text", "ab\udcffc"],
                         capture_output=True, text=True, errors="surrogateescape")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "--text is not UTF-8 (character 2: b'\\xff')" in res.stderr


def test_page_cache_json_counts_pages_as_an_integer():
    """``pages`` is a count of the tables' 4 KiB pages: an int in the JSON (it printed 12345.0), and
    every page of every column of the layout, whichever rows the text read."""
    import numpy as np

    from cachelab.engram import get_preset
    from cachelab.serving.page_popularity import PAGE_BYTES

    res = runner.invoke(app, ["engram", "page-cache", "--max-tokens", "2000", "--json"])
    assert res.exit_code == 0, res.output
    pages = json.loads(res.stdout)["pages"]
    cfg = get_preset("deepseek-v4.1-flash")
    starts, primes, rb = np.asarray(cfg.offsets, np.int64), np.asarray(cfg.primes, np.int64), cfg.row_bytes
    expected = int((((starts + primes) * rb) // PAGE_BYTES - (starts * rb) // PAGE_BYTES + 1).sum())
    assert type(pages) is int and pages == expected
