"""Importers under damage: rows in = rows out + rows skipped, every skip named by its line,
and without --skip-bad the error names the first damaged line.

A Hypothesis fuzz per importer (Azure, BurstGPT, Mooncake, ServeGen windows) damages a
valid file (truncation, garbage lines, stray quotes, other encodings, huge and negative
numbers, blank lines) and checks that bookkeeping exactly; then the cases the issue found:
the Azure stray quote at line 101, a BOM header, mixed UTC offsets, ServeGen window skips and
duplicate window starts, and Mooncake timestamps of 400 digits or 1e300 ms.
"""

from __future__ import annotations

import json
import re
from contextlib import nullcontext
from unittest import mock

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.trace.compressed import COMPRESSED
from cachelab.trace import ingest as ingest_module
from cachelab.trace.ingest import Ingest
from traces.azure import COLUMNS as AZURE_COLUMNS, AzureTrace
from traces.burstgpt import BurstGPTTrace
from traces.mooncake import MooncakeTrace
from traces.servegen import ServeGenWorkload, read_windows

runner = CliRunner()


def azure(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    rows = [f"2023-11-16 18:{i // 60 % 60:02d}:{i % 60:02d}.{int(rng.integers(10**7)):07d},"
            f"{int(rng.integers(1, 9000))},{int(rng.integers(1, 900))}" for i in range(n)]
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n"


def burstgpt(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    rows = [f"{i * 1.5},ChatGPT,{(a := int(rng.integers(1, 900)))},{(b := int(rng.integers(1, 90)))},{a + b},"
            "Conversation log" for i in range(n)]
    return "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "\n".join(rows) + "\n"


def mooncake(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        n_in = int(rng.integers(1, 3000))
        out.append(json.dumps({"timestamp": i * 100, "input_length": n_in, "output_length": int(rng.integers(1, 99)),
                               "hash_ids": list(range(-(-n_in // 512)))}))
    return "\n".join(out) + "\n"


def servegen(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "".join(f"{600 * i},{rng.uniform(0.1, 3):.3f},{rng.uniform(0.5, 2):.3f},Gamma,{rng.uniform(0.5, 2):.3f},"
                   f"{rng.uniform(0.1, 3):.3f}\n" for i in range(n))


def _windows(path, skip_bad):
    ingest = Ingest(path, skip_bad)
    frame = read_windows(ingest)
    return frame.height, ingest.skipped, ingest.skipped_lines


def _arrivals(cls):
    def read(path, skip_bad):
        source = cls(str(path), skip_bad=skip_bad)
        frame = source.arrivals()
        return frame.height, source.skipped, source.skipped_lines
    return read


IMPORTERS = {  # name: (file name, valid text maker, header lines, reader -> (rows out, skipped, skipped lines))
    "azure": ("AzureLLMInferenceTrace_code.csv", azure, 1, _arrivals(AzureTrace)),
    "burstgpt": ("BurstGPT_1.csv", burstgpt, 1, _arrivals(BurstGPTTrace)),
    "mooncake": ("x_trace.jsonl", mooncake, 0, _arrivals(MooncakeTrace)),
    "servegen": ("chunk-0-trace.csv", servegen, 0, _windows),
}


def _data_lines(data: bytes, header: int) -> list[int]:
    """The 1-based numbers of the lines an importer must account for: non-blank (or not UTF-8)
    lines after the header, split as a binary file iterates."""
    numbers = []
    pieces = data.split(b"\n")  # a binary file iterates on \n alone (bytes.splitlines also splits on \r)
    if pieces and not pieces[-1]:
        pieces.pop()
    for number, raw in enumerate(pieces, start=1):
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff" if number == 1 else "")
        except UnicodeDecodeError:
            numbers.append(number)
            continue
        if text.strip():
            numbers.append(number)
    return numbers[header:]


@st.composite
def damaged(draw, names=tuple(IMPORTERS)):
    name = draw(st.sampled_from(sorted(names)))
    file, make, header, _ = IMPORTERS[name]
    lines = make(draw(st.integers(1, 25)), draw(st.integers(0, 99))).encode().splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(header, len(lines)))  # never the header: a bad header is an error, tested below
        how = draw(st.sampled_from(["quote", "garbage", "huge", "negative", "latin1", "blank", "nul", "cut"]))
        line = lines[i] if i < len(lines) else b"\n"
        at = draw(st.integers(0, max(len(line) - 1, 0)))
        if how == "quote":
            line = line[:at] + b'"' + line[at:]
        elif how == "garbage":
            lines.insert(i, draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b"") + b"\n")
            continue
        elif how in ("huge", "negative"):
            digits = [k for k, c in enumerate(line) if chr(c).isdigit()]
            if digits:
                k = digits[draw(st.integers(0, len(digits) - 1))]
                line = line[:k] + (b"9" * 40 if how == "huge" else b"-") + line[k:]
        elif how == "latin1":
            line = line[:at] + "é".encode("latin-1") + line[at:]
        elif how == "blank":
            lines.insert(i, b"  \r\n")
            continue
        elif how == "nul":
            line = line[:at] + b"\x00" + line[at:]
        else:
            line = line[:at]
        if i < len(lines):
            lines[i] = line
        else:
            lines.append(line)
    data = b"".join(lines)
    if draw(st.booleans()):  # a truncated file
        data = data[:draw(st.integers(len(b"".join(lines[:header + 1])), len(data)))]
    return name, data


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(damaged())
def test_rows_in_equal_rows_out_plus_rows_skipped(tmp_path, case):
    name, data = case
    file, _, header, read = IMPORTERS[name]
    path = tmp_path / file
    path.write_bytes(data)
    expected = _data_lines(data, header)
    try:
        rows, skipped, skipped_lines = read(path, True)
    except CachelabError as exc:  # allowed only when nothing usable is left, or windows repeat
        assert file in str(exc)
        compressed = any(data.startswith(magic) for magic in COMPRESSED)  # garbage at line 1 with a magic
        assert "no usable requests" in str(exc) or "repeats line" in str(exc) or "no requests" in str(exc) \
            or compressed and "unreadable" in str(exc)
        return
    lines = [int(str(x).rsplit(":", 1)[-1]) for x in skipped_lines]
    assert rows + skipped == len(expected), "every data line is a row out or a row skipped"
    assert len(lines) == skipped and len(set(lines)) == skipped and set(lines) <= set(expected)
    assert lines == sorted(lines), "skips are named in file order"
    if lines:  # without --skip-bad, the first skipped line is the one the error names
        with pytest.raises(CachelabError, match=rf"{file}:{lines[0]}: "):
            read(path, False)
    else:
        assert read(path, False)[0] == rows


def _read_csv(path, skip_bad, by_lines):
    """What Ingest.csv gives (rows, lines, skips, first skip) or the error, through either path."""
    ingest = Ingest(path, skip_bad)
    try:
        with mock.patch.object(ingest_module, "_NOT_PLAIN", re.compile(b"")) if by_lines else nullcontext():
            raw, lines = ingest.csv(AZURE_COLUMNS)  # by_lines: every block taken for one that is not plain
        typed = ingest.convert(raw, lines, {c: (pl.col(c), "text") for c in AZURE_COLUMNS})
    except CachelabError as exc:
        return str(exc)
    return typed.rows(), lines.tolist(), ingest.skipped_lines, ingest.first_skipped


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damaged(names=("azure",)), st.booleans())
def test_a_plain_csv_split_by_polars_reads_as_line_by_line(tmp_path, case, skip_bad):
    """The vectorised split of a plain file gives what the line-by-line reader gives, errors included."""
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_bytes(case[1])
    expected = _read_csv(path, skip_bad, True)
    assert _read_csv(path, skip_bad, False) == expected
    with mock.patch.object(ingest_module, "_CHUNK", 5):  # plain and damaged blocks, each read its own way
        assert _read_csv(path, skip_bad, False) == expected


def test_a_plain_csv_is_not_read_line_by_line(tmp_path, monkeypatch):
    """Every line went through Python (about 0.7 M lines/s); a plain file is split by Polars."""
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_bytes(b"\xef\xbb\xbf" + azure(50).replace("\n", "\r\n").encode() + b"\r\n  \r\n")
    expected = _read_csv(path, False, True)
    monkeypatch.setattr(Ingest, "block_lines", lambda self, first, block: iter(()))
    assert _read_csv(path, False, False) == expected and len(expected[0]) == 50


def test_the_first_bad_line_is_named_whatever_is_wrong_with_it(tmp_path):
    """A short row (line 4) was reported while the file was read, before the bad values found
    after it (line 2): the error named line 4, and --skip-bad listed 4 before 2."""
    lines = azure(5).splitlines()
    lines[1] = lines[1].rsplit(",", 1)[0] + ",NaN"
    lines[3] = lines[3].rsplit(",", 1)[0]
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CachelabError, match=r"_code.csv:2: field 'GeneratedTokens': 'NaN'"):
        AzureTrace(str(path)).arrivals()
    res = runner.invoke(app, ["trace", "build", "--arrivals", "azure", "--arrivals-path", str(path), "--skip-bad",
                              "-o", str(tmp_path / "t.parquet"), "--json"])
    report = json.loads(res.stdout)
    assert report["skipped_rows"] == 2 and report["skipped_lines"] == [f"{path.name}:2", f"{path.name}:4"]
    assert report["skipped_first"].startswith(f"{path}:2: field 'GeneratedTokens'")
    res = runner.invoke(app, ["trace", "build", "--arrivals", "azure", "--arrivals-path", str(path), "--skip-bad",
                              "-o", str(tmp_path / "t.parquet")])
    assert "skipped 2 bad input rows" in res.output and "GeneratedTokens" in res.output


def test_azure_stray_quote_damages_its_own_line_only(tmp_path):
    """One quote at the start of line 101 used to swallow 3,823 rows and blame line 3924."""
    lines = azure(400).splitlines()
    lines[100] = '"' + lines[100]
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("\n".join(lines) + "\n")
    source = AzureTrace(str(path), skip_bad=True)
    assert source.arrivals().height == 399 and source.skipped == 1 and source.skipped_lines == [101]
    with pytest.raises(CachelabError, match=r"AzureLLMInferenceTrace_code.csv:101: malformed CSV"):
        AzureTrace(str(path)).arrivals()


@pytest.mark.data
def test_azure_stray_quote_in_the_real_code_trace(tmp_path, data_dir):
    real = data_dir / "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"
    lines = real.read_text().splitlines()
    lines[100] = '"' + lines[100]
    path = tmp_path / real.name
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "t.parquet"
    res = runner.invoke(app, ["trace", "build", "--arrivals", "azure", "--arrivals-path", str(path), "--skip-bad",
                              "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["skipped_rows"] == 1
    assert json.loads(runner.invoke(app, ["trace", "info", str(out), "--json"]).stdout)["requests"] == len(lines) - 2
    res = runner.invoke(app, ["trace", "build", "--arrivals", "azure", "--arrivals-path", str(path), "-o", str(out)])
    assert res.exit_code == 2 and f"{path}:101: malformed CSV" in res.output


def test_azure_bom_header_and_mixed_utc_offsets(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    path.write_bytes("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00+00:00,10,1\n"
                     "2024-05-10 05:00:02.5+05:00,20,2\n2024-05-09T23:00:04Z,30,3\n".encode())
    df = AzureTrace(str(path)).arrivals()  # one UTC clock: 23:00:04Z the day before comes first
    assert sorted(df["arrival_s"].to_list()) == pytest.approx([0.0, 3596.0, 3598.5])
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00+00:00,10,1\n"
                    "2024-05-10 00:00:01,20,2\n")
    with pytest.raises(CachelabError, match=r"_1week.csv:3: field 'TIMESTAMP'.*UTC offset"):
        AzureTrace(str(path)).arrivals()


def test_one_row_with_a_utc_offset_is_the_bad_one(tmp_path):
    """One offset row in a 2023 file made it a file of offsets: its 9 other rows became bad rows,
    and --skip-bad kept the odd one alone; it is the bad row now, its offset never ignored."""
    real = azure(10).splitlines()
    real[5] = real[5].split(",", 1)[0] + "+01:00," + real[5].split(",", 1)[1]
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("\n".join(real) + "\n")
    with pytest.raises(CachelabError, match=r"_code.csv:6: field 'TIMESTAMP': .*\+01:00' is not a timestamp like "
                                            r".* without a UTC offset"):
        AzureTrace(str(path)).arrivals()
    source = AzureTrace(str(path), skip_bad=True)
    assert source.arrivals().height == 9 and source.skipped_lines == [6]


@pytest.mark.parametrize("year", ["9999", "1700", "2100"])
def test_azure_far_timestamp_is_a_bad_row_naming_its_line(tmp_path, year):
    """A damaged year was taken: 9999 wrapped (a nanosecond parse) to an arrival of 6.6e9 s,
    1700 overflowed to a negative one, blamed on the output file's row 0."""
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,1\n"
                    f"{year}-11-16 18:17:04.1,20,2\n2023-11-16 18:17:05.5,30,3\n")
    with pytest.raises(CachelabError, match=rf"_code.csv:3: field 'TIMESTAMP': '{year}-11-16 18:17:04.1' is not "
                                            r"a timestamp like .* within 5e\+08 s of the file's median"):
        AzureTrace(str(path)).arrivals()
    source = AzureTrace(str(path), skip_bad=True)
    assert source.arrivals()["arrival_s"].to_list() == pytest.approx([0.0, 1.52004]) and source.skipped_lines == [3]


def _servegen_folder(tmp_path, trace: str, dataset: dict):
    folder = tmp_path / "reason" / "model"
    folder.mkdir(parents=True)
    (folder / "chunk-0-trace.csv").write_text(trace)
    (folder / "chunk-0-dataset.json").write_text(json.dumps(dataset, indent=1))
    return folder


PMF = {"input_tokens": "{100: 0.5, 200: 0.5}", "output_tokens": "{10: 1.0}"}


def test_servegen_window_skips_are_counted(tmp_path):
    """A bad length PMF used to drop its window's requests with skipped_rows: 0."""
    folder = _servegen_folder(tmp_path, "0,2.0,1.0,Gamma,1,1\n600,2.0,1.0,Gamma,1,1\n",
                              {"0": PMF, "600": {**PMF, "input_tokens": "{100: 0.7}"}})
    with pytest.raises(CachelabError, match=r"chunk-0-dataset.json:\d+: window 600, field 'input_tokens'"):
        ServeGenWorkload(str(folder), duration_s=1200).arrivals()
    source = ServeGenWorkload(str(folder), duration_s=1200, skip_bad=True)
    source.arrivals()
    assert source.skipped == 1 and source.skipped_lines[0].startswith("chunk-0-dataset.json:")
    out = tmp_path / "t.parquet"
    res = runner.invoke(app, ["trace", "build", "--arrivals", "servegen", "--arrivals-path", str(folder),
                              "--arrival-option", "duration_s=1200", "--skip-bad", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["skipped_rows"] == 1 and report["skipped_lines"] == source.skipped_lines
    assert report["skipped_first"].startswith(f"{folder / 'chunk-0-dataset.json'}:")


def test_servegen_missing_or_skipped_window_is_idle(tmp_path):
    """A window ended where the next row began, so a window missing from the file (or skipped as
    bad) took the rate of the one before it: 10 more minutes of its traffic, made up. Seen by
    helper-106."""
    rows = ["0,2.0,1.0,Gamma,1,1", "600,2.0,1.0,Gamma,1,1", "1200,2.0,1.0,Bogus,1,1", "1800,2.0,1.0,Gamma,1,1"]
    for trace, skip in (("\n".join(rows[:2] + rows[3:]) + "\n", False), ("\n".join(rows) + "\n", True)):
        folder = _servegen_folder(tmp_path / str(skip), trace, {"0": PMF})
        times = ServeGenWorkload(str(folder), duration_s=2400, skip_bad=skip).arrivals()["arrival_s"].to_numpy()
        assert ((times >= 0) & (times < 1200)).sum() > 1000 and ((times >= 1800) & (times < 2400)).sum() > 500
        assert not ((times >= 1200) & (times < 1800)).any()


def test_servegen_duplicate_window_start_is_an_error(tmp_path):
    folder = _servegen_folder(tmp_path, "0,2.0,1.0,Gamma,1,1\n600,2.0,1.0,Gamma,1,1\n600,5.0,1.0,Gamma,1,1\n",
                              {"0": PMF})
    with pytest.raises(CachelabError, match=r"chunk-0-trace.csv:3: window start 600 s repeats line 2"):
        ServeGenWorkload(str(folder), duration_s=1200, skip_bad=True).arrivals()
    dataset = folder / "chunk-0-dataset.json"
    (folder / "chunk-0-trace.csv").write_text("0,2.0,1.0,Gamma,1,1\n")
    dataset.write_text('{\n "0": ' + json.dumps(PMF) + ',\n "0": ' + json.dumps(PMF) + "\n}\n")
    with pytest.raises(CachelabError, match=r"chunk-0-dataset.json:3: window '0' appears twice"):
        ServeGenWorkload(str(folder), duration_s=600).arrivals()


@pytest.mark.parametrize("stamp", ["1" * 400, "1e300", "-1", "NaN"])
def test_mooncake_absurd_timestamps_are_bad_rows(tmp_path, stamp):
    path = tmp_path / "x_trace.jsonl"
    path.write_text(mooncake(3) + '{"timestamp": ' + stamp + ', "input_length": 1, "output_length": 1, '
                    '"hash_ids": [5]}\n')
    with pytest.raises(CachelabError, match=r"x_trace.jsonl:4: field 'timestamp'"):
        MooncakeTrace(str(path)).arrivals()
    source = MooncakeTrace(str(path), skip_bad=True)
    assert source.arrivals().height == 3 and source.skipped_lines == [4]


@pytest.mark.parametrize("name, field", [("azure", "ContextTokens"), ("burstgpt", "Request tokens"),
                                         ("mooncake", "input_length")])
def test_a_request_of_no_prompt_tokens_is_a_bad_row(tmp_path, name, field):
    """A prompt of 0 tokens imported as a request no server accepts (vLLM: "the decoder prompt
    cannot be empty"): a replay of the trace failed at that request, not the import at its line."""
    file, make, header, read = IMPORTERS[name]
    lines = make(4).splitlines()
    if name == "mooncake":
        record = json.loads(lines[2])
        lines[2] = json.dumps({**record, "input_length": 0, "hash_ids": []})
    else:
        cells = lines[2].split(",")
        cells[2 if name == "burstgpt" else 1] = "0"
        if name == "burstgpt":
            cells[4] = cells[3]
        lines[2] = ",".join(cells)
    path = tmp_path / file
    path.write_text("\n".join(lines) + "\n")
    line = 3
    with pytest.raises(CachelabError, match=rf"{file}:{line}: field '{field}'"):
        read(path, False)
    assert read(path, True)[1:] == (1, [line])


def test_servegen_input_pmf_of_empty_prompts_is_a_bad_window(tmp_path):
    folder = _servegen_folder(tmp_path, "0,2.0,1.0,Gamma,1,1\n600,2.0,1.0,Gamma,1,1\n",
                              {"0": PMF, "600": {**PMF, "input_tokens": "{0: 0.5, 100: 0.5}"}})
    with pytest.raises(CachelabError, match=r"window 600, field 'input_tokens': token count 0 \(the least is 1\)"):
        ServeGenWorkload(str(folder), duration_s=1200).arrivals()
