"""The Mooncake importer reads a block of whole lines at a time: memory holds the rows and one
block, not the decompressed file, and rows, skipped lines and errors are the same whatever the
block size."""

from __future__ import annotations

import gzip
import json
import tracemalloc

from hypothesis import HealthCheck, given, settings, strategies as st

from cachelab.errors import CachelabError
from cachelab.trace import ingest as ingest_module
from traces.mooncake import MooncakeTrace

MiB = 1 << 20


def test_a_compressed_trace_is_not_held_whole_in_memory(tmp_path):
    """48 MiB of JSONL (12,288 requests, each with a 4 KiB field the importer ignores), 0.2 MiB
    gzipped: the whole decompressed text was read into one bytes object for Arrow's reader (a
    multi-GB trace needed its size in memory, and more); now a block at a time."""
    path = tmp_path / "big_trace.jsonl.gz"
    rows = 12 * 1024
    line = '{"timestamp": %d, "input_length": 600, "output_length": 5, "hash_ids": [7, %d], "note": "%s"}\n'
    pad = "x" * (4096 - len(line))
    path.write_bytes(gzip.compress("".join(line % (i, i + 8, pad) for i in range(rows)).encode(), compresslevel=1))
    small = tmp_path / "small_trace.jsonl"
    small.write_text(line % (0, 8, ""))
    MooncakeTrace(str(small)).arrivals()  # the first import's own allocations (modules, compiled kernels) not counted
    tracemalloc.start()
    try:
        frame = MooncakeTrace(str(path)).arrivals()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert frame.height == rows and frame["block_hashes"][-1].to_list() == [7, rows - 1 + 8]
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB for a 48 MiB text"


GOOD = {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
LINES = st.one_of(
    st.builds(lambda t, n, k: json.dumps({"timestamp": t, "input_length": n, "output_length": 1,
                                           "hash_ids": [1] + [k * 100 + j for j in range(1, -(-n // 512))]}),
              st.integers(0, 10**6), st.integers(1, 2000), st.integers(1, 50)),  # chained: ids per prefix
    st.sampled_from(["", "  ", "{", "[1]", json.dumps({**GOOD, "timestamp": -1}), json.dumps({**GOOD, "hash_ids": [1]}),
                     json.dumps({**GOOD, "hash_ids": [2, 1]}), json.dumps(GOOD) + "\r", "\ufeff" + json.dumps(GOOD)]))


def _read(path, skip_bad: bool):
    source = MooncakeTrace(str(path), skip_bad=skip_bad)
    try:
        return source.arrivals().to_dicts(), source.skipped_lines, source.first_skipped
    except CachelabError as exc:
        return str(exc)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINES, min_size=1, max_size=25), chunk=st.integers(1, 400), skip_bad=st.booleans())
def test_rows_and_errors_are_the_same_whatever_the_block_size(tmp_path, lines, chunk, skip_bad):
    """Blocks that Arrow's reader takes and blocks read line by line, in any mix: the same rows,
    line numbers (of the rows, the bad lines and the unchained ids) and errors as the file in one
    block, as it was read before."""
    path = tmp_path / "x_trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    whole = _read(path, skip_bad)
    saved = ingest_module._CHUNK
    ingest_module._CHUNK = chunk
    try:
        assert _read(path, skip_bad) == whole
    finally:
        ingest_module._CHUNK = saved
