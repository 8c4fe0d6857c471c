"""The request-table contract: round trip, validation naming file/row/field, atomic writes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from cachelab.errors import CachelabError
from cachelab.workload.prefix_cache.hashing import DistinctCounter, chained_block_hashes
from cachelab.trace.schema import SCHEMA, conform, read_trace, scan_trace, validate, write_trace


def table(**overrides) -> pl.DataFrame:
    base = {"request_id": [0, 1], "session_id": [0, 0], "turn": [0, 1], "arrival_s": [0.0, 1.5],
            "domain": ["code", "code"], "prompt_ids": [[1, 2, 3], [1, 2, 3, 9, 4]], "output_ids": [[9], [5, 6]],
            "prompt_len": [3, 5], "output_len": [1, 2], "block_hashes": [None, None], "block_size": [None, None],
            "source": ["test", "test"]}
    base.update(overrides)
    return conform(pl.DataFrame(base))


def test_round_trip_keeps_values_and_version(tmp_path):
    path = tmp_path / "t.parquet"
    write_trace(table(), path)
    assert read_trace(path).equals(table())
    assert scan_trace(path).collect().height == 2
    assert pq.read_schema(path).metadata[b"cachelab.trace.schema_version"] == b"1"


@pytest.mark.parametrize("field, value, message", [
    ("turn", [0, -1], "row 1, field 'turn'"),
    ("arrival_s", [2.0, 1.0], "row 1, field 'arrival_s'"),
    ("request_id", [4, 4], "row 1, field 'request_id'"),
    ("prompt_len", [3, 7], "row 1, field 'prompt_ids'"),
    ("output_ids", [[9], [-5, 6]], "row 1, field 'output_ids'"),
])
def test_validation_names_row_and_field(field, value, message):
    with pytest.raises(CachelabError, match=message):
        validate(table(**{field: value}), "x.parquet")


def test_content_less_rows_and_block_hash_counts():
    ok = table(prompt_ids=[[], []], output_ids=[[], []], prompt_len=[1024, 1025],
               block_hashes=[[1, 2], [1, 2, 3]], block_size=[512, 512])
    validate(ok, "x")
    with pytest.raises(CachelabError, match="row 1, field 'block_hashes'"):
        validate(table(prompt_ids=[[], []], output_ids=[[], []], prompt_len=[1024, 1025],
                       block_hashes=[[1, 2], [1, 2]], block_size=[512, 512]), "x")


def test_cached_tokens_is_an_optional_column(tmp_path):
    from cachelab.trace.stats import summarize

    # A file without the column (written before it existed) reads back with it null.
    old = table().drop("cached_tokens").to_arrow()
    pq.write_table(old.replace_schema_metadata(SCHEMA.metadata), tmp_path / "old.parquet")
    assert read_trace(tmp_path / "old.parquet")["cached_tokens"].to_list() == [None, None]
    assert scan_trace(tmp_path / "old.parquet").select("cached_tokens").collect().height == 2
    assert summarize(tmp_path / "old.parquet", engram_tokens=0)["server_prefix_hit_ratio"] is None
    # With values: kept, summarised over the requests that reported one, bounded by the prompt.
    write_trace(table(cached_tokens=[None, 4]), tmp_path / "new.parquet")
    assert read_trace(tmp_path / "new.parquet")["cached_tokens"].to_list() == [None, 4]
    info = summarize(tmp_path / "new.parquet", engram_tokens=0)
    assert info["server_cached_tokens"] == 4 and info["server_prefix_hit_ratio"] == pytest.approx(4 / 5)
    with pytest.raises(CachelabError, match="row 1, field 'cached_tokens'"):
        validate(table(cached_tokens=[0, 6]), "x")


def test_read_refuses_foreign_and_mistyped_files(tmp_path):
    plain = tmp_path / "plain.parquet"
    pl.DataFrame({"a": [1]}).write_parquet(plain)
    with pytest.raises(CachelabError, match="not a cachelab trace"):
        read_trace(plain)
    typed = table().to_arrow().cast(SCHEMA)
    wrong = typed.set_column(2, "turn", pa.array(["0", "1"]))
    bad = tmp_path / "bad.parquet"
    pq.write_table(wrong.replace_schema_metadata(SCHEMA.metadata), bad)
    with pytest.raises(CachelabError, match="field 'turn' has type String"):
        read_trace(bad)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(CachelabError, match="not a Parquet file"):
        read_trace(tmp_path / "junk.parquet")


def test_failed_write_keeps_the_existing_file(tmp_path):
    path = tmp_path / "t.parquet"
    write_trace(table(), path)
    with pytest.raises(CachelabError):
        write_trace(table(turn=[0, -1]), path)
    assert read_trace(path).equals(table())
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def naive_hit_ratio(prompts: list[list[int]], block: int) -> float | None:
    seen, hits, total = set(), 0, 0
    for p in prompts:
        for end in range(block, len(p) + block, block):
            key = tuple(p[:min(end, len(p))])
            hits += key in seen
            total += 1
            seen.add(key)
    return hits / total if total else None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=12), st.integers(1, 5))
def test_chained_hashes_count_exactly_the_shared_prefixes(prompts, block):
    tokens = np.asarray([t for p in prompts for t in p], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int64)
    hashes, hash_off = chained_block_hashes(tokens, offsets, block)
    assert np.array_equal(np.diff(hash_off), [-(-len(p) // block) for p in prompts])
    counter = DistinctCounter()
    for lo in range(0, len(prompts), 3):  # fed in chunks, as trace info does
        counter.add(hashes[hash_off[lo]:hash_off[min(lo + 3, len(prompts))]])
    expected = naive_hit_ratio(prompts, block)
    assert counter.hit_ratio == (None if expected is None else pytest.approx(expected))


def test_two_writers_of_one_trace_at_once_each_write_their_own_scratch_file(tmp_path):
    """Two processes writing one output (two sweeps, a rerun beside a run) each leave it whole:
    with one shared scratch name the second writer truncated the first's half-written file and
    renamed it away under it."""
    from cachelab.trace.schema import TraceWriter

    path = tmp_path / "t.parquet"
    first, second = TraceWriter(path), TraceWriter(path)
    first.write(table())
    second.write(table(request_id=[7, 8]))
    second.close()
    first.close()
    assert read_trace(path).equals(table())
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def test_replacing_gives_each_writer_its_own_scratch_file(tmp_path):
    from cachelab.paths import replacing

    path = tmp_path / "out.csv"
    with replacing(path) as outer:
        outer.write_text("outer, whole\n")
        with replacing(path) as inner:
            inner.write_text("inner\n")
    assert path.read_text() == "outer, whole\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]


def test_a_killed_writers_scratch_file_is_removed_by_the_next_write(tmp_path):
    """Each writer's scratch name is its own, so a writer killed mid-write would leave one hidden
    file per kill; the next write of that output removes those of processes that are gone, and
    leaves a live writer's alone, and another host's (a shared file system)."""
    import subprocess
    import sys

    from cachelab.owners import owner
    from cachelab.paths import replacing

    gone = subprocess.run([sys.executable, "-c", "from cachelab.owners import owner; print(owner())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    path = tmp_path / "out.csv"
    stale = tmp_path / f".out.csv.{gone}.0badc0de.partial"
    live = tmp_path / f".out.csv.{owner()}.00000000.partial"
    elsewhere = tmp_path / f".out.csv.another-host:{gone.split(':')[1]}:1.00000000.partial"
    for f in (stale, live, elsewhere):
        f.write_text("cut")
    with replacing(path) as tmp:
        tmp.write_text("whole\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name, "out.csv"])


@pytest.mark.parametrize("fault, message", [
    ("back", "row 256, field 'arrival_s' = 1.0: goes back in time"),
    ("repeat", "row 300, field 'request_id' = 3: is a duplicate"),
])
def test_batch_readers_refuse_what_spans_two_batches_as_read_trace_does(tmp_path, fault, message):
    """``trace info`` and ``trace convert`` validate a file batch by batch (256 rows): a step back in
    time or a repeated request id between two batches passed both (a foreign writer's file), and
    ``read_trace`` refused it."""
    from cachelab.trace.convert import trace_keys
    from cachelab.trace.stats import summarize

    n = 600
    arrival = np.arange(n, dtype=np.float64)
    ids = np.arange(n)
    if fault == "back":
        arrival[256:] -= 255.0  # row 255 at 255 s, row 256 at 1 s: the first row of the second batch
    else:
        ids[300] = 3
    frame = conform(pl.DataFrame({
        "request_id": ids, "session_id": np.arange(n), "turn": np.zeros(n, np.int32), "arrival_s": arrival,
        "domain": ["chat"] * n, "prompt_ids": [[]] * n, "output_ids": [[]] * n, "prompt_len": np.full(n, 600),
        "output_len": np.ones(n, np.int64), "block_hashes": [[i, i + 1] for i in range(n)],
        "block_size": np.full(n, 512), "source": ["test"] * n}))
    path = tmp_path / "t.parquet"
    pq.write_table(frame.to_arrow().cast(SCHEMA), path)  # not through write_trace, which refuses it
    for read in (read_trace, summarize, lambda p: trace_keys(p, "blocks")):
        with pytest.raises(CachelabError, match=message):
            read(path)
    assert trace_keys(path, "blocks", max_requests=256 if fault == "back" else 300).size  # the rows before it
