"""Importers: property-tested on generated files, and fed corrupted ones.

A corrupted file gives an error naming the file and the line, or, with skip_bad, a count
of skipped rows; never a traceback and never silently fewer rows.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.trace.ingest import Ingest
from cachelab.trace.keytrace import read_keys
from cachelab.trace.schema import validate
from traces.azure import AzureTrace
from traces.burstgpt import BurstGPTTrace
from traces.mooncake import MooncakeTrace, infer_sessions
from traces.mooncake import _read_block

runner = CliRunner()
counts = st.integers(0, 100_000)
prompts = st.integers(1, 100_000)  # a request of no prompt tokens is a bad row


@st.composite
def mooncake_rows(draw):
    """A request whose ids are chained as Mooncake's are: each names its whole prefix (blocks of
    few distinct contents, so prefixes repeat; ids up to 2^63 - 1)."""
    n_in = draw(st.integers(1, 5000))
    blocks = draw(st.lists(st.integers(0, 3), min_size=-(-n_in // 512), max_size=-(-n_in // 512)))
    ids = [int.from_bytes(hashlib.blake2b(repr(blocks[:k + 1]).encode(), digest_size=8).digest()) >> 1
           for k in range(len(blocks))]
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
@given(rows=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 59), st.integers(0, 9_999_999), prompts, counts),
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
@given(rows=st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.sampled_from(["ChatGPT", "GPT-4"]), prompts,
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



def test_burstgpt_models_take_one_bare_name_and_refuse_one_no_row_has(tmp_path):
    """--arrival-option models=GPT-4 arrives as text: it was taken for a column name (a plug-in
    failure), and a misspelt model in a list silently gave a smaller trace."""
    path = tmp_path / "BurstGPT.csv"
    path.write_text(burstgpt_text([(0.0, "ChatGPT", 5, 1, "API log"), (1.0, "GPT-4", 6, 2, "API log")]))
    assert BurstGPTTrace(str(path), models="GPT-4").arrivals()["prompt_len"].to_list() == [6]
    with pytest.raises(CachelabError, match=r"BurstGPT.csv: field 'Model': no row has 'GPT4'; the file's models are "
                                            r"\['ChatGPT', 'GPT-4'\]"):
        BurstGPTTrace(str(path), models=["ChatGPT", "GPT4"]).arrivals()
    with pytest.raises(CachelabError, match="models = 3: expected a list of model names"):
        BurstGPTTrace(str(path), models=3).arrivals()


@pytest.mark.parametrize("plain", [True, False])
def test_burstgpt_total_that_is_not_request_plus_response_is_a_bad_row(tmp_path, plain):
    """The BurstGPT README defines Total tokens as request plus response tokens; a row where it is
    not was read as if whole (which count is damaged cannot be told). On the Polars and the line
    reader (a quoted label sends the file there). Seen by helper-106."""
    path = tmp_path / "BurstGPT.csv"
    text = burstgpt_text([(0.0, "ChatGPT", 5, 1, "API log"), (1.0, "ChatGPT", 6, 2, "API log")])
    path.write_text(text.replace(",6,2,8,", ",6,2,9,").replace("ChatGPT", "ChatGPT" if plain else '"ChatGPT"'))
    with pytest.raises(CachelabError, match=r"BurstGPT.csv:3: field 'Total tokens': '9' is not an integer from 0 to "
                                            r"2\^31 - 1 equal to 'Request tokens' \+ 'Response tokens'"):
        BurstGPTTrace(str(path)).arrivals()
    source = BurstGPTTrace(str(path), skip_bad=True)
    assert source.arrivals()["prompt_len"].to_list() == [5] and source.skipped_lines == [3]

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


@pytest.mark.parametrize("fmt", ["azure", "burstgpt"])
@pytest.mark.parametrize("damage", ['"', '"' + "x" * 200_000 + '"'], ids=["open quote", "name past the field limit"])
def test_a_header_no_csv_reader_parses_is_named_by_its_line(tmp_path, fmt, damage):
    """The header was parsed outside the guard each data row has: csv.Error's traceback
    ("unexpected end of data", "field larger than field limit (131072)"), --skip-bad or not."""
    name, cls, text = GOOD[fmt]
    path = tmp_path / name
    header, *rows = text.splitlines(keepends=True)
    path.write_text("\n" + header.rstrip("\n") + "," + damage + "\n" + "".join(rows))
    for skip_bad in (False, True):
        with pytest.raises(CachelabError, match=rf"{name}:2: malformed CSV header \("):
            cls(str(path), skip_bad=skip_bad).arrivals()


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


def test_sessions_are_inferred_from_contained_prompts(tmp_path):
    rows = [  # block 0 is a shared system prompt: sharing only it makes no session
        {"timestamp": 0, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 700, "output_length": 9, "hash_ids": [0, 3]},
        {"timestamp": 9, "input_length": 1600, "output_length": 9, "hash_ids": [0, 1, 4, 5]},  # turn 2 of request 0
        {"timestamp": 12, "input_length": 2100, "output_length": 9, "hash_ids": [0, 1, 4, 6, 7]},  # turn 3
        {"timestamp": 13, "input_length": 1200, "output_length": 9, "hash_ids": [0, 1, 8]},  # again after turn 1
    ]
    path = tmp_path / "s_trace.jsonl"
    path.write_text(mooncake_text(rows))
    df = MooncakeTrace(str(path)).arrivals()
    assert df["session_id"].to_list() == [0, 1, 0, 0, 0]
    assert df["turn"].to_list() == [0, 0, 1, 2, 1]
    plain = MooncakeTrace(str(path), infer_sessions=False).arrivals()
    assert plain["session_id"].to_list() == [0, 1, 2, 3, 4]


def test_a_retried_or_edited_prompt_is_no_new_turn(tmp_path):
    """A request repeating an earlier prompt (same blocks and length: a retry) or cutting its last
    block short (an edit) continued it as its next turn, though a next turn's prompt holds the
    earlier prompt and more: 87 of the conversation trace's 12,031 requests were chained onto an
    identical prompt. They join its session at its turn. Seen by helper-106."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 1600, "output_length": 9, "hash_ids": [0, 1, 3, 4]},  # turn 1
        {"timestamp": 6, "input_length": 1600, "output_length": 9, "hash_ids": [0, 1, 3, 4]},  # its retry
        {"timestamp": 7, "input_length": 1550, "output_length": 9, "hash_ids": [0, 1, 3, 5]},  # an edit of it
        {"timestamp": 9, "input_length": 2100, "output_length": 9, "hash_ids": [0, 1, 3, 4, 6]},  # turn 2
        {"timestamp": 10, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 2]},  # the first, again
    ]
    path = tmp_path / "r_trace.jsonl"
    path.write_text(mooncake_text(rows))
    df = MooncakeTrace(str(path)).arrivals()
    assert df["session_id"].to_list() == [0] * 6
    assert df["turn"].to_list() == [0, 1, 1, 1, 2, 0]



def sessions_one_request_at_a_time(arrival, input_length, offsets, flat, block_size):
    """The prefix rule of traces/mooncake.py as a plain loop over requests in arrival order: the
    reference the vectorised ``infer_sessions`` must equal."""
    n = arrival.size
    session, turn = np.arange(n), np.zeros(n, dtype=np.int64)
    ends = {}  # id of the last full block of a request -> that request
    for i in np.argsort(arrival, kind="stable").tolist():
        ids = flat[offsets[i]:offsets[i + 1]].tolist()
        for j in range(len(ids) - 1, 1, -1):  # a proper prefix of at least two blocks
            parent = ends.get(ids[j - 1])
            if parent is not None:  # a prompt no longer than its parent's is a retry or an edit: no new turn
                session[i], turn[i] = session[parent], turn[parent] + (input_length[i] > input_length[parent])
                break
        full = len(ids) if input_length[i] % block_size == 0 else len(ids) - 1
        if full > 0:
            ends[ids[full - 1]] = i
    return session, turn


@st.composite
def conversations(draw):
    """Requests that often continue an earlier one's prompt (a shared first block, turns, forks,
    equal arrival times, partial and full last blocks, block sizes 1 to 4)."""
    block = draw(st.integers(1, 4))
    prompts, rows, fresh = [], [], 1
    for _ in range(draw(st.integers(1, 30))):
        base = draw(st.sampled_from(prompts)) if prompts and draw(st.booleans()) else [0]
        keep = draw(st.integers(1, len(base)))
        new = draw(st.integers(0 if keep > 1 else 1, 4))
        ids = base[:keep] + list(range(fresh, fresh + new))
        fresh += new
        tokens = (len(ids) - 1) * block + draw(st.integers(1, block))
        prompts.append(ids)
        rows.append({"timestamp": draw(st.integers(0, 20)), "input_length": tokens, "output_length": 1,
                     "hash_ids": ids})
    return block, rows


@SETTINGS
@given(case=conversations())
def test_vectorised_sessions_equal_the_loop_over_requests(case):
    block, rows = case
    arrival = np.array([r["timestamp"] for r in rows], dtype=np.float64)
    n_in = np.array([r["input_length"] for r in rows])
    offsets = np.concatenate([[0], np.cumsum([len(r["hash_ids"]) for r in rows])]).astype(np.int32)
    flat = np.array([h for r in rows for h in r["hash_ids"]], dtype=np.int64)
    got = infer_sessions(arrival, n_in, offsets, flat, block)
    want = sessions_one_request_at_a_time(arrival, n_in, offsets, flat, block)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def read_all(path, block_size: int):
    """Arrow's reader on the whole file as one block."""
    return _read_block(path.read_bytes(), 1, block_size)


def test_real_mooncake_takes_the_arrow_reader_and_reads_as_line_by_line(data_dir, tmp_path, monkeypatch):
    """Arrow's reader reads every block of the published files (not a silent fall back to the
    line reader); the same rows with CRLF line ends, which it leaves to the line reader, give the
    same table, and its sessions are the loop's."""
    source = data_dir / "traces/mooncake_fast25/conversation_trace.jsonl"
    rows = read_all(source, 512)
    assert rows is not None and rows[0].size == 12_031
    with monkeypatch.context() as patch:
        patch.setattr(MooncakeTrace, "_read_lines", lambda *_: pytest.fail("a block read line by line"))
        assert MooncakeTrace(str(source)).arrivals().height == 12_031
    crlf = tmp_path / "crlf" / source.name
    crlf.parent.mkdir()
    crlf.write_bytes(source.read_bytes().replace(b"\n", b"\r\n"))
    assert read_all(crlf, 512) is None
    whole, lines = MooncakeTrace(str(source)).arrivals(), MooncakeTrace(str(crlf)).arrivals()
    assert whole.equals(lines)
    session, turn = sessions_one_request_at_a_time(rows[0] / 1000, rows[1], rows[3], rows[4], 512)
    by_id = whole.sort("request_id")
    assert by_id["session_id"].to_list() == session.tolist() and by_id["turn"].to_list() == turn.tolist()
    assert whole["session_id"].n_unique() == 8_056 and whole["turn"].max() == 42


@SETTINGS
@given(rows=st.lists(mooncake_rows(), min_size=1, max_size=20), spaced=st.booleans())
def test_arrow_reader_and_line_reader_give_the_same_rows(tmp_path, rows, spaced):
    path = tmp_path / "x_trace.jsonl"
    text = mooncake_text(rows)
    path.write_text(text if spaced else text.replace(", ", ",").replace(": ", ":"))
    whole = read_all(path, 512)
    assert whole is not None
    by_line = MooncakeTrace(str(path))._read_lines(ingest := Ingest(path), ingest.lines())
    for a, b in zip(whole, by_line):
        assert a.tolist() == b.tolist()

@SETTINGS
@given(data=st.binary(max_size=400), fmt=st.sampled_from(sorted(GOOD)), skip=st.booleans())
def test_arbitrary_bytes_give_rows_or_a_clean_error(tmp_path, data, fmt, skip):
    """Whatever the bytes, an importer returns a valid table or raises CachelabError."""
    name, cls, text = GOOD[fmt]
    path = tmp_path / name
    header = b"" if fmt == "mooncake" else text.splitlines()[0].encode() + b"\n"
    path.write_bytes(header + data)
    source = cls(str(path), skip_bad=skip)
    try:
        df = source.arrivals()
    except CachelabError:
        return
    validate(df, str(path))
    lines = [ln for ln in (header + data).splitlines() if ln.strip()]
    data_lines = len(lines) - (0 if fmt == "mooncake" else 1)
    assert df.height + source.skipped >= min(data_lines, 1) and df.height <= data_lines


@pytest.mark.parametrize("fmt, line", [
    ("mooncake", '{"timestamp": 1, "input_length": 3000000000, "output_length": 1, "hash_ids": []}'),
    ("mooncake", '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [99999999999999999999]}'),
    ("azure", "2023-11-16 18:00:00.0,3000000000,1"),
])
def test_out_of_range_values_are_bad_rows(tmp_path, fmt, line):
    name, cls, text = GOOD[fmt]
    path = tmp_path / name
    path.write_text(text + line + "\n")
    with pytest.raises(CachelabError, match=f"{path.name}:{len(text.splitlines()) + 1}: "):
        cls(str(path)).arrivals()


@pytest.mark.parametrize("field", ["timestamp", "output_length", "hash_ids"])
def test_mooncake_field_given_twice_is_a_bad_line_on_both_readers(tmp_path, field):
    """A line naming a field twice took its last value (json's rule) while Arrow's reader refused
    the file: which value counts is a guess, so the line is bad, named by line and field, and
    --skip-bad counts it. Seen by helper-106."""
    name, cls, text = GOOD["mooncake"]
    row = {"timestamp": 9, "input_length": 10, "output_length": 5, "hash_ids": [1]}
    line = json.dumps(row)[:-1] + f", {json.dumps(field)}: {json.dumps(row[field])}}}"
    path = tmp_path / name
    path.write_text(text + line + "\n")
    assert read_all(path, 512) is None
    with pytest.raises(CachelabError, match=f"{path.name}:5: field\\(s\\) \\['{field}'\\] given more than once"):
        cls(str(path)).arrivals()
    source = cls(str(path), skip_bad=True)
    assert source.arrivals().height == 4 and source.skipped_lines == [5]


def test_mooncake_unread_field_given_twice_is_ignored_by_both_readers(tmp_path):
    """A repeated field the importer does not read is ignored, as Arrow's reader ignores it."""
    name, cls, text = GOOD["mooncake"]
    path = tmp_path / name
    path.write_text(text.replace('"hash_ids"', '"x": {"a": 1, "a": 2}, "x": 3, "hash_ids"'))
    whole = read_all(path, 512)
    assert whole is not None
    for a, b in zip(whole, cls(str(path))._read_lines(ingest := Ingest(path), ingest.lines())):
        assert a.tolist() == b.tolist()


@pytest.mark.parametrize("second, message", [
    ([4, 2, 5], "id 2 is block 1 after id 4, but at line 1 block 1 after id 1"),  # ids of blocks, not prefixes
    ([1, 3, 2], "id 2 is block 2 after id 3, but at line 1 block 1 after id 1"),
    ([2, 6, 7], "id 2 is block 0, but at line 1 block 1 after id 1"),
])
def test_mooncake_ids_that_are_not_chained_are_refused(tmp_path, second, message):
    """An id that ends two different prefixes is no Mooncake id (each names its whole prefix): such
    hash_ids (a hash per block's own tokens) were read as chained, so an equal block after other
    blocks counted as a shared prefix and could chain sessions. Both readers name the two lines.
    Seen by helper-106."""
    first = {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}
    path = tmp_path / "c_trace.jsonl"
    for sep in ("\n", "\n\n"):  # the blank line sends the file to the line reader
        path.write_text(json.dumps(first) + sep + json.dumps({**first, "timestamp": 5, "hash_ids": second}) + "\n")
        line = sep.count("\n") + 1
        with pytest.raises(CachelabError, match=rf"c_trace.jsonl:{line}: field 'hash_ids': {message}; Mooncake ids"):
            MooncakeTrace(str(path)).arrivals()
    path.write_text(json.dumps(first) + "\n" + json.dumps({**first, "hash_ids": [1, 2, 8]}) + "\n")
    assert MooncakeTrace(str(path)).arrivals().height == 2


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_a_damaged_second_stream_is_an_error_not_fewer_rows(tmp_path, compress):
    """Concatenated streams are read whole (and NUL padding after them ignored), but bytes after
    a stream that are no valid stream were dropped by Python's bz2 and xz readers: a file whose
    second stream was damaged gave the first stream's 4 rows of 8, and its keys, silently.
    Seen by helper-106."""
    name, cls, text = GOOD["mooncake"]
    one = compress(text.encode())
    path = tmp_path / "z_trace.jsonl.z"
    path.write_bytes(one + one + b"\0" * 16)
    assert cls(str(path)).arrivals().height == 8
    for damaged in (b"X" + one[1:], one[:20] + bytes([one[20] ^ 0xFF]) + one[21:], b"garbage"):
        path.write_bytes(one + damaged)
        with pytest.raises(CachelabError, match="z_trace.jsonl.z:5: "):
            cls(str(path)).arrivals()
        keys = tmp_path / "keys.txt.z"
        keys.write_bytes(compress(b"1\n2\n") + damaged)
        with pytest.raises(CachelabError, match="keys.txt.z: corrupt compressed data"):
            read_keys(keys)


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_compressed_input_and_a_truncated_stream(tmp_path, compress):
    """bzip2 and xz were read as bytes: 'line 1: not UTF-8', though key traces read them."""
    name, cls, text = GOOD["mooncake"]
    path = tmp_path / "z_trace.jsonl.z"
    path.write_bytes(compress(text.encode()))
    assert cls(str(path)).arrivals().height == 4
    path.write_bytes(compress(text.encode())[:-12])
    with pytest.raises(CachelabError, match="z_trace.jsonl.z:.*unreadable"):
        cls(str(path)).arrivals()


def test_every_damaged_byte_of_a_gzip_stream_is_its_rows_or_an_error_naming_the_file(tmp_path):
    """Damaged deflate data raised zlib.error, which no reader caught: a traceback from read_keys, the
    line reader and the CSV importers ("Error -3 while decompressing data: invalid bit length repeat").
    Damage that decompressed to garbage keys, or a garbage header, was named as a bad line before the
    CRC at the end was read; it is the stream's damage too."""
    text = "".join(f"{k}\n" for k in np.random.default_rng(0).integers(0, 10**6, 150).tolist())
    stream = gzip.compress(text.encode(), mtime=0)
    path = tmp_path / "keys.txt.gz"
    errors = set()
    for at in range(10, len(stream)):  # past the header
        path.write_bytes(stream[:at] + bytes([stream[at] ^ 0x55]) + stream[at + 1:])
        for read in (read_keys, lambda p: list(Ingest(p).lines()), lambda p: Ingest(p).csv([text.split()[0]])):
            try:
                got = read(path)
            except CachelabError as exc:  # the stream's damage, not a line of its garbage ('line 3: b'9x' is not ...')
                assert str(path) in str(exc) and ("corrupt compressed data" in str(exc) if read is read_keys
                                                  else "damaged or truncated gzip data" in str(exc)), exc
                errors.add(str(exc).split(": ", 1)[1][:40])
            else:  # gzip's CRC leaves no damage unseen
                assert read is not read_keys or got.tolist() == [int(k) for k in text.split()], at
    assert any("corrupt compressed data: Error -3" in e for e in errors), errors


def test_azure_2024_timestamps_with_utc_offset(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.009930+00:00,4808,10\n"
                    "2024-05-10 00:00:01.509930+00:00,3180,8\n")
    df = AzureTrace(str(path)).arrivals()
    assert df["arrival_s"].to_list() == pytest.approx([0.0, 1.5]) and df["domain"][0] == "conversation"


CORPORA = {  # corpus: (file under the root, a good record)
    "arena-hard": ("prompts/arena_hard/arena-hard-v2.0_question.jsonl",
                   {"uid": "a1", "category": "hard", "subcategory": "coding", "prompt": "Write a sort."}),
    "mt-bench": ("prompts/mt_bench/question.jsonl",
                 {"question_id": 81, "category": "writing", "turns": ["Hi.", "More."], "reference": ["A.", "B."]}),
    "gsm8k": ("prompts/gsm8k/test.jsonl", {"question": "What is 2+2?", "answer": "4"}),
    "humaneval": ("prompts/humaneval/HumanEval.jsonl.gz",
                  {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n"}),
    "alpaca-seed": ("prompts/alpaca_seed/seed_tasks.jsonl",
                    {"id": "seed_task_0", "instruction": "Say hi.", "instances": [{"input": "", "output": "Hi."}]}),
}


@pytest.mark.parametrize("corpus, field, value", [
    ("arena-hard", "prompt", 5), ("arena-hard", "subcategory", ["coding"]), ("mt-bench", "turns", "Hi."),
    ("mt-bench", "turns", []), ("mt-bench", "reference", "A."), ("mt-bench", "category", None),
    ("gsm8k", "question", None), ("gsm8k", "answer", 4), ("humaneval", "canonical_solution", {"code": 1}),
    ("alpaca-seed", "instruction", 1.5), ("alpaca-seed", "instances", [{"input": 3, "output": "x"}]),
    ("alpaca-seed", "instances", "Hi."),
])
def test_a_corpus_record_of_the_wrong_type_is_named_by_file_line_and_field(tmp_path, corpus, field, value):
    """A prompt of 5, a string of turns or a null answer reached the tokenizer (a TypeError traceback), or
    was read letter by letter (a reference "A." became the answers 'A' and '.')."""
    from cachelab import registry

    name, good = CORPORA[corpus]
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    text = json.dumps(good) + "\n" + json.dumps({**good, field: value}) + "\n"
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    with pytest.raises(CachelabError, match=rf"{path.name}:2: field {field!r}: expected .*, got ") as error:
        list(registry.get(registry.WORKLOADS, corpus)(root=str(tmp_path)).documents())
    assert "--skip-bad" not in str(error.value)  # it skips arrival rows; a corpus's error said to pass it
    path.write_bytes(gzip.compress((text.splitlines()[0] + "\n").encode()) if name.endswith(".gz")
                     else (text.splitlines()[0] + "\n").encode())
    docs = list(registry.get(registry.WORKLOADS, corpus)(root=str(tmp_path)).documents())
    assert len(docs) == 1 and all(isinstance(t, str) for t in (docs[0].text, *docs[0].turns, *docs[0].answers))


@pytest.mark.parametrize("corpus, field", [("arena-hard", "prompt"), ("mt-bench", "turns"), ("gsm8k", "answer")])
def test_a_corpus_field_given_twice_is_named_by_file_line_and_field(tmp_path, corpus, field):
    """json kept the last of a repeated field's values, so a record naming its prompt twice gave one of them
    silently; a field the corpus does not read may repeat. Seen by helper-106."""
    from cachelab import registry

    name, good = CORPORA[corpus]
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    unread = json.dumps(good)[:-1] + ', "x": 1, "x": 2'
    path.write_text(json.dumps(good) + "\n" + unread + f", {json.dumps(field)}: {json.dumps(good[field])}}}\n")
    with pytest.raises(CachelabError, match=rf"{path.name}:2: field\(s\) \['{field}'\] given more than once"):
        list(registry.get(registry.WORKLOADS, corpus)(root=str(tmp_path)).documents())
    path.write_text(json.dumps(good) + "\n" + unread + "}\n")
    assert len(list(registry.get(registry.WORKLOADS, corpus)(root=str(tmp_path)).documents())) == 2


@pytest.mark.parametrize("corpus, field", [("arena-hard", "prompt"), ("mt-bench", "turns"), ("gsm8k", "answer")])
def test_a_corpus_record_missing_a_field_is_named_by_file_line_and_field(tmp_path, corpus, field):
    """A record without a field the corpus reads named every required field, not the one missing
    (docs/traces.md: the error names the file, the line and the field)."""
    from cachelab import registry

    name, good = CORPORA[corpus]
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != field}) + "\n")
    with pytest.raises(CachelabError, match=rf"{path.name}:2: missing field\(s\) \['{field}'\]"):
        list(registry.get(registry.WORKLOADS, corpus)(root=str(tmp_path)).documents())


def test_mooncake_timestamp_of_another_type_is_shown_as_given(tmp_path):
    """A timestamp given as text ("0") was reported as 'got 0', a value in range: the type at
    fault did not show."""
    path = tmp_path / "c_trace.jsonl"
    path.write_text('{"timestamp": "0", "input_length": 10, "output_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(CachelabError, match=r"c_trace.jsonl:1: field 'timestamp': expected milliseconds from 0 to "
                                            r"1e\+12, got '0'"):
        MooncakeTrace(str(path)).arrivals()
