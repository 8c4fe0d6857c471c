"""Importers: property-tested on generated files, and fed corrupted ones.

A corrupted file gives an error naming the file and the line, or, with skip_bad, a count
of skipped rows; never a traceback and never silently fewer rows.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.trace import validate
from traces.azure import AzureTrace
from traces.burstgpt import BurstGPTTrace
from traces.mooncake import MooncakeTrace

runner = CliRunner()
counts = st.integers(0, 100_000)


@st.composite
def mooncake_rows(draw):
    n_in = draw(st.integers(0, 5000))
    ids = draw(st.lists(st.integers(0, 2**40), min_size=-(-n_in // 512), max_size=-(-n_in // 512)))
    return {"timestamp": draw(st.integers(0, 10**7)), "input_length": n_in,
            "output_length": draw(counts), "hash_ids": ids}


def mooncake_text(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def azure_text(rows) -> str:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{m:02d}:{s:02d}.{us:07d},{a},{b}" for m, s, us, a, b in rows]
    return "\n".join(lines) + "\n"


def burstgpt_text(rows) -> str:
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    lines += [f"{t},{m},{a},{b},{a + b},{log}" for t, m, a, b, log in rows]
    return "\n".join(lines) + "\n"


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(rows=st.lists(mooncake_rows(), min_size=1, max_size=20))
def test_mooncake_reads_back_every_row(tmp_path, rows):
    path = tmp_path / "x_trace.jsonl"
    path.write_text(mooncake_text(rows))
    df = MooncakeTrace(str(path)).arrivals()
    validate(df, str(path))
    assert df.height == len(rows)
    by_id = df.sort("request_id")
    assert by_id["prompt_len"].to_list() == [r["input_length"] for r in rows]
    assert by_id["block_hashes"].to_list() == [r["hash_ids"] for r in rows]
    assert by_id["arrival_s"].to_list() == pytest.approx([r["timestamp"] / 1000 for r in rows])
    assert df["domain"][0] == "x"


@SETTINGS
@given(rows=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 59), st.integers(0, 9_999_999), counts, counts),
                     min_size=1, max_size=20))
def test_azure_reads_back_every_row(tmp_path, rows):
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text(azure_text(rows))
    df = AzureTrace(str(path)).arrivals().sort("request_id")
    assert df["prompt_len"].to_list() == [r[3] for r in rows]
    assert df["output_len"].to_list() == [r[4] for r in rows]
    seconds = [m * 60 + s + us / 1e7 for m, s, us, _, _ in rows]
    assert df["arrival_s"].to_list() == pytest.approx([x - min(seconds) for x in seconds], abs=1e-6)
    assert set(df["domain"]) == {"code"}


@SETTINGS
@given(rows=st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.sampled_from(["ChatGPT", "GPT-4"]), counts,
                               counts, st.sampled_from(["Conversation log", "API log"])), min_size=1, max_size=20))
def test_burstgpt_reads_back_every_row(tmp_path, rows):
    path = tmp_path / "BurstGPT.csv"
    path.write_text(burstgpt_text(rows))
    df = BurstGPTTrace(str(path)).arrivals().sort("request_id")
    assert df["prompt_len"].to_list() == [r[2] for r in rows]
    assert df["domain"].to_list() == [r[4].split()[0].lower() for r in rows]
    gpt4 = BurstGPTTrace(str(path), models=["GPT-4"])
    if any(r[1] == "GPT-4" for r in rows):
        assert gpt4.arrivals().height == sum(r[1] == "GPT-4" for r in rows)


GOOD = {
    "mooncake": ("c_trace.jsonl", MooncakeTrace, mooncake_text(
        [{"timestamp": i * 10, "input_length": 600, "output_length": 5, "hash_ids": [0, i + 1]} for i in range(4)])),
    "azure": ("conv.csv", AzureTrace, azure_text([(0, i, 0, 100 + i, 10) for i in range(4)])),
    "burstgpt": ("b.csv", BurstGPTTrace, burstgpt_text([(float(i), "ChatGPT", 100, 10, "API log") for i in range(4)])),
}
# (name, how to corrupt line 3 of the file (the second data row for CSV, the third row for JSONL))
CORRUPTIONS = {
    "truncated line": lambda line: line[: len(line) // 2],
    "wrong type": lambda line: (line.replace('"output_length": 5', '"output_length": "five"') if "{" in line
                                 else line.replace(",10", ",ten", 1)),
    "missing field": lambda line: line.replace(', "output_length": 5', "") if "{" in line else line.rsplit(",", 1)[0],
    "non-UTF-8 bytes": lambda line: line[:3] + "\udcff" + line[3:],
}


def write_corrupt(tmp_path, fmt: str, corruption: str):
    name, cls, text = GOOD[fmt]
    lines = text.splitlines()
    lines[2] = CORRUPTIONS[corruption](lines[2])
    path = tmp_path / name
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    return path, cls, len(lines) - (0 if fmt == "mooncake" else 1)


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@pytest.mark.parametrize("fmt", GOOD)
def test_corrupted_line_is_named_or_counted(tmp_path, fmt, corruption):
    path, cls, rows = write_corrupt(tmp_path, fmt, corruption)
    with pytest.raises(CachelabError, match=f"{path.name}:3: "):
        cls(str(path)).arrivals()
    source = cls(str(path), skip_bad=True)
    df = source.arrivals()
    assert source.skipped == 1 and df.height == rows - 1


@pytest.mark.parametrize("fmt", GOOD)
def test_empty_and_header_only_files_are_errors(tmp_path, fmt):
    name, cls, text = GOOD[fmt]
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(CachelabError, match="empty file"):
        cls(str(path), skip_bad=True).arrivals()
    path.write_text(text.splitlines()[0] + "\n" if fmt != "mooncake" else "\n")
    with pytest.raises(CachelabError, match="no usable requests"):
        cls(str(path), skip_bad=True).arrivals()


def test_cli_reports_corruption_without_traceback_and_counts_skips(tmp_path):
    path, _, rows = write_corrupt(tmp_path, "mooncake", "wrong type")
    out = tmp_path / "out.parquet"
    res = runner.invoke(app, ["trace", "build", "--arrivals", "mooncake", "--arrivals-path", str(path), "-o", str(out)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"{path}:3:" in res.output and not out.exists()
    res = runner.invoke(app, ["trace", "build", "--arrivals", "mooncake", "--arrivals-path", str(path),
                              "--skip-bad", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["skipped_rows"] == 1
    assert json.loads(runner.invoke(app, ["trace", "info", str(out), "--json"]).stdout)["requests"] == rows - 1
