"""``Ingest`` reads a block of whole lines at a time: memory holds a block, not the decompressed
file, a line longer than ``LONGEST_LINE`` is an error naming it, and the lines read are the same
whatever the block size."""

from __future__ import annotations

import gzip
import tracemalloc

import pytest

from cachelab.errors import CachelabError
from cachelab.trace import ingest as ingest_module
from cachelab.trace.ingest import Ingest
from traces.azure import COLUMNS as AZURE_COLUMNS

MiB = 1 << 20


def _peak(read) -> tuple[object, int]:
    """What ``read()`` returns, and the peak of the bytes Python allocated meanwhile."""
    tracemalloc.start()
    try:
        return read(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _lines(path, skip_bad=True):
    ingest = Ingest(path, skip_bad)
    return list(ingest.lines()), ingest.skipped_lines, ingest.first_skipped


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_lines_are_the_same_whatever_the_block_size(tmp_path, monkeypatch, chunk):
    """A BOM, CRLF, a lone CR, blank lines, a line that is not UTF-8 and no final line end."""
    path = tmp_path / "t.csv"
    path.write_bytes(b"\xef\xbb\xbfa,b\r\n\n  \nx\xff,y\r\r\nmid\rdle\n\xc3\xa9,1\nlast")
    expected = ([(1, "a,b"), (2, ""), (3, "  "), (5, "mid\rdle"), (6, "\xe9,1"), (7, "last")], [4],
                f"{path}:4: not UTF-8 (byte 1: b'\\xff')")
    assert _lines(path) == expected
    monkeypatch.setattr(ingest_module, "_CHUNK", chunk, raising=False)
    assert _lines(path) == expected


def test_a_compressed_csv_is_not_held_whole_in_memory(tmp_path):
    """48 MiB of blank lines (1 KiB of blanks each) after three rows, 48 KiB gzipped: the whole text
    was read into one string before it was split (a 10 GB CSV needed 10 GB); now a block at a time."""
    path = tmp_path / "AzureLLMInferenceTrace_code.csv.gz"
    rows = b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b"2023-11-16 18:00:00.0000000,10,2\n" * 3
    path.write_bytes(gzip.compress(rows + (b" " * 1023 + b"\n") * (48 * 1024), compresslevel=1))
    (raw, lines), peak = _peak(lambda: Ingest(path).csv(AZURE_COLUMNS))
    assert raw.height == 3 and lines.tolist() == [2, 3, 4]
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB for a 48 MiB text"
    count, peak = _peak(lambda: sum(1 for _ in Ingest(path).lines()))
    assert count == 4 + 48 * 1024 and peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB for a 48 MiB text"


def test_a_line_longer_than_the_limit_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_module, "LONGEST_LINE", 1000, raising=False)
    monkeypatch.setattr(ingest_module, "_CHUNK", 64, raising=False)
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"{}\n\n" + b"x" * 1001 + b"\n{}\n")
    with pytest.raises(CachelabError, match=rf"{path.name}:3: line longer than 1,000 bytes \(it starts b'xxx"):
        list(Ingest(path, skip_bad=True).json_lines())
    path.write_bytes(b"{}\n\n" + b"x" * 999 + b"\r\n{}\n")  # at the limit: a CR counts, the LF not
    assert len(list(Ingest(path, skip_bad=True).lines())) == 4


def test_a_gzip_bomb_of_one_line_stops_at_the_limit(tmp_path):
    """A file with no line end (80 MiB of one byte, 80 KiB gzipped) was read whole as one line."""
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a": 1}\n' + b"x" * (5 * ingest_module.LONGEST_LINE), compresslevel=1))

    def read():
        with pytest.raises(CachelabError, match=rf"{path.name}:2: line longer than {ingest_module.LONGEST_LINE:,}"):
            list(Ingest(path).json_lines())

    _, peak = _peak(read)
    assert peak < 4 * ingest_module.LONGEST_LINE, f"peak {peak / MiB:.0f} MiB"
