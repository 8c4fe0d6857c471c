"""Reading foreign text files line by line, with errors that name the file and the line.

Importers parse each line themselves and call ``Ingest.bad`` on anything they cannot use:
by default that raises a CachelabError ``FILE:LINE: what is wrong``; with ``skip_bad`` the
line is skipped and counted, so a damaged file never yields silently fewer rows: every
non-blank line is a row out or a row skipped, ``skipped_lines`` names each skipped one (in file
order) and ``first_skipped`` says what was wrong with the first.
A CSV is read one physical line per record (these traces hold no quoted line breaks), so a
stray quote damages its own line only, and the error names that line. Gzip, bzip2, xz and zstd
input is opened by ``cachelab.trace.compressed``; a UTF-8 byte-order mark is dropped. The text is
read a block of whole lines at a time (``line_blocks``), so memory holds the rows kept and one
block, never the whole decompressed file; a line of more than ``LONGEST_LINE`` bytes (a file with
no line ends, a gzip bomb) is an error naming it, whatever ``skip_bad`` says.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.errors import CachelabError
from cachelab.trace.compressed import DECOMPRESS_ERRORS, compression, line_blocks, open_binary, stream_damage

LONGEST_LINE = 1 << 24  # bytes of a line (its LF not counted): 16 MiB, a prompt of millions of tokens
_CHUNK = 1 << 20  # decompressed bytes read at a time
_NOT_PLAIN = re.compile(rb"[^\t\n\r\x20\x21\x23-\x7e]")  # a byte other than printable ASCII (no quote), tab, CR, LF


def _fields(text: str) -> list[str]:
    """One physical line's CSV fields: a plain split unless the line quotes something."""
    if '"' not in text and "\x00" not in text:
        return text.split(",")
    return next(csv.reader((text,), strict=True), [])


class JsonObject(dict):
    """A parsed JSON object that remembers the keys it was given more than once (``json`` keeps
    the last value, Arrow's reader refuses the object), so an importer can refuse a repeated field
    it reads and ignore one it does not, as the Arrow fast path does. An object without a repeated
    key stays a plain ``dict`` (a third less parse time than building a subclass of every one)."""

    repeated: frozenset[str] = frozenset()

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, object]]) -> dict:
        value = dict(pairs)
        if len(value) == len(pairs):
            return value
        seen: set[str] = set()
        value = cls(pairs)
        value.repeated = frozenset(k for k, _ in pairs if k in seen or seen.add(k))
        return value


@dataclass
class Ingest:
    """One foreign file being read: its lines, and the bad ones skipped or reported."""

    path: Path
    skip_bad: bool = False
    skippable: bool = True  # the reader's bad lines can be skipped (--skip-bad: an arrival file, not a corpus)
    skipped: int = 0
    first_skipped: str | None = None
    lines_read: int = field(default=0)
    skipped_lines: list[int] = field(default_factory=list)
    held: dict[int, str] | None = field(default=None, init=False)  # see hold

    def hold(self) -> None:
        """Hold the bad lines found from now on until ``convert``, which reports them with the bad
        values in file order, so the error (or ``first_skipped``) names the first bad line."""
        self.held = {}

    def __post_init__(self) -> None:
        self.path = Path(os.fspath(self.path))
        if not self.path.is_file():
            raise CachelabError(f"file not found: {self.path}")

    def bad(self, line: int, message: str) -> None:
        """Report line ``line`` (1-based) as unusable: raise, or count it under ``skip_bad``."""
        if self.held is not None:
            self.held.setdefault(line, message)
            return
        where = f"{self.path}:{line}: {message}"
        if not self.skip_bad:
            raise self._error(line, message + (" (pass --skip-bad to skip such rows and count them)"
                                               if self.skippable else ""))
        self.skipped += 1
        self.skipped_lines.append(line)
        self.first_skipped = self.first_skipped or where

    def blocks(self) -> Iterator[tuple[int, bytes]]:
        """(number of its first line, bytes of whole lines) for each block of the file, decompressed
        as it is read (``line_blocks``); a line longer than ``LONGEST_LINE`` is an error naming it."""
        number = 1
        try:
            with open_binary(self.path) as fh:
                for block in line_blocks(iter(lambda: fh.read1(_CHUNK), b""), LONGEST_LINE, cr=False):
                    self._refuse_long_line(number, block)
                    yield number, block
                    number += block.count(b"\n")
        except DECOMPRESS_ERRORS as exc:  # a truncated or corrupt compressed stream, an unreadable file
            raise CachelabError(f"{self.path}:{number}: {self._unreadable(exc)}") from None

    def _error(self, line: int, message: str) -> CachelabError:
        """``FILE:LINE: message``; or, where the file is compressed and its stream damaged, that damage:
        the line is garbage the stream decompressed to before its check (``stream_damage``) failed."""
        damage = stream_damage(self.path)
        if damage is not None:
            return CachelabError(f"{self.path}:{line}: {self._unreadable(damage)} (line {line} read as: {message})")
        return CachelabError(f"{self.path}:{line}: {message}")

    def _unreadable(self, why) -> str:
        """The words for a file that cannot be read to its end: what failed, and for a compressed
        one its format, so every format's damage reads the same."""
        kind = compression(self.path) if self.path.is_file() else None
        return f"unreadable ({why})" + (f": damaged or truncated {kind} data" if kind else "")

    def _refuse_long_line(self, number: int, block: bytes) -> None:
        """An error naming the first line of ``block`` (line ``number`` first) over ``LONGEST_LINE`` bytes."""
        if len(block) <= LONGEST_LINE:  # no longer line fits in it
            return
        for i, line in enumerate(block.split(b"\n")):
            if len(line) > LONGEST_LINE:
                raise CachelabError(f"{self.path}:{number + i}: line longer than {LONGEST_LINE:,} bytes "
                                    f"(it starts {line[:40]!r}): a damaged file, or not a text trace")

    def block_lines(self, first: int, block: bytes) -> Iterator[tuple[int, str]]:
        """(line number, text without the line end) for every line of a block that is valid UTF-8:
        the block decoded at once, or where it is not UTF-8 each line alone (the bad ones named)."""
        try:
            pieces: list = block.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            pieces = block.split(b"\n")
        if block.endswith(b"\n"):
            pieces.pop()
        for number, text in enumerate(pieces, start=first):
            self.lines_read = number
            if type(text) is bytes:
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as exc:
                    self.bad(number, f"not UTF-8 (byte {exc.start}: {text[exc.start:exc.start + 1]!r})")
                    continue
            if number == 1:
                text = text.removeprefix("\ufeff")
            yield number, text.rstrip("\r")

    def lines(self) -> Iterator[tuple[int, str]]:
        """(line number, text without the line end) for every line that is valid UTF-8."""
        for first, block in self.blocks():
            yield from self.block_lines(first, block)
        if self.lines_read == 0:
            raise CachelabError(f"{self.path}: empty file (no requests)")

    def json_lines(self, lines: Iterator[tuple[int, str]] | None = None) -> Iterator[tuple[int, object]]:
        """(line number, parsed value) of every non-blank line of a JSONL file (or of ``lines``, as
        ``lines()`` or ``block_lines`` give them); an object with a repeated key is a ``JsonObject``."""
        for number, text in self.lines() if lines is None else lines:
            if not text.strip():
                continue
            try:
                value = json.loads(text, object_pairs_hook=JsonObject.from_pairs)
            except json.JSONDecodeError as exc:
                self.bad(number, f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            except (ValueError, RecursionError) as exc:  # a number of thousands of digits, deep nesting
                self.bad(number, f"not usable JSON ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            yield number, value

    def csv(self, required: Sequence[str]) -> tuple[pl.DataFrame, np.ndarray]:
        """The ``required`` columns of a CSV with a header, as strings, and each row's line number.

        Rows with the wrong number of fields (a truncated or run-on line) are bad rows. A block of
        printable ASCII without quotes (every published trace) is split by Polars; any other is
        read line by line, so each damaged line is named.
        """
        header: list[str] | None = None
        frames: list[pl.DataFrame] = []
        numbers: list[np.ndarray] = []
        for first, block in self.blocks():
            if first == 1:
                block = block.removeprefix(b"\xef\xbb\xbf")
                self.lines_read = 1  # a file of a BOM alone is a line, blank
            if _NOT_PLAIN.search(block) is None:
                header, fields, lines = self._csv_plain(first, block, header, required)
            else:
                header, fields, lines = self._csv_lines(first, block, header, required)
            frames.append(fields)
            numbers.append(lines)
        if self.lines_read == 0:
            raise CachelabError(f"{self.path}: empty file (no requests)")
        if header is None:
            raise CachelabError(f"{self.path}: empty file (no header, no requests)")
        return pl.concat(frames), np.concatenate(numbers)

    def _csv_plain(self, first: int, block: bytes, header: list[str] | None,
                   required: Sequence[str]) -> tuple[list[str] | None, pl.DataFrame, np.ndarray]:
        """A plain block's rows (``csv``) split by Polars, its first row the header if none was read."""
        pieces = pl.Series("text", [block.decode("ascii")]).str.split("\n").explode()
        frame = (pl.DataFrame({"text": pieces.str.strip_chars_end("\r")}).with_row_index("line", offset=first)
                 .filter(pl.col("text").str.strip_chars() != ""))
        if header is None and frame.height:
            header = self._header(frame["line"][0], frame["text"][0], required)
            self.hold()
            frame = frame.slice(1)
        if header is None:
            return None, pl.DataFrame({c: pl.Series([], dtype=pl.String) for c in required}), np.zeros(0, np.int64)
        body = frame.with_columns(pl.col("text").str.split(","))
        width = body["text"].list.len()
        for line, count in zip(body["line"].filter(width != len(header)), width.filter(width != len(header))):
            self.bad(line, f"{count} fields, expected {len(header)} ({', '.join(header)})")
        body = body.filter(width == len(header))
        fields = body.select(pl.col("text").list.get(header.index(c)).str.strip_chars().alias(c) for c in required)
        return header, fields, body["line"].to_numpy().astype(np.int64)

    def _header(self, line: int, text: str, required: Sequence[str]) -> list[str]:
        """The header's column names; a required one missing, or a header no CSV reader parses, is an
        error naming the line."""
        try:
            header = [h.strip() for h in _fields(text)]
        except csv.Error as exc:  # a quote left open, a quoted name past the field limit
            raise self._error(line, f"malformed CSV header ({exc})") from None
        missing = [c for c in required if c not in header]
        if missing:
            raise self._error(line, f"missing column(s) {missing}; the header has {header}")
        return header

    def _csv_lines(self, first: int, block: bytes, header: list[str] | None,
                   required: Sequence[str]) -> tuple[list[str] | None, pl.DataFrame, np.ndarray]:
        """``_csv_plain`` one line at a time, for a block that is not plain."""
        columns: list[list[str]] = [[] for _ in required]
        lines: list[int] = []
        index = None if header is None else [header.index(c) for c in required]
        for number, text in self.block_lines(first, block):
            if not text.strip():
                continue
            if header is None:
                self.hold()
                header = self._header(number, text, required)
                index = [header.index(c) for c in required]
                continue
            try:
                row = _fields(text)
            except csv.Error as exc:  # a NUL byte, a quote where none may be
                self.bad(number, f"malformed CSV ({exc})")
                continue
            if len(row) != len(header):
                self.bad(number, f"{len(row)} fields, expected {len(header)} ({', '.join(header)})")
                continue
            for out, i in zip(columns, index):
                out.append(row[i].strip())
            lines.append(number)
        frame = pl.DataFrame({c: pl.Series(v, dtype=pl.String) for c, v in zip(required, columns)})
        return header, frame, np.asarray(lines, dtype=np.int64)

    def convert(self, raw: pl.DataFrame, lines: np.ndarray, conversions: dict[str, tuple[pl.Expr, str]]) -> pl.DataFrame:
        """Apply each column's conversion; a row whose value converts to null is a bad row. The
        bad values and the lines held since ``hold`` are reported together, in file order.

        Args:
            conversions: column -> (expression giving the typed value or null, what was expected).
        """
        typed = raw.select(expr.alias(col) for col, (expr, _) in conversions.items())
        bad = np.zeros(raw.height, dtype=bool)
        reasons, self.held = self.held or {}, None
        for col, (_, expected) in conversions.items():
            failed = typed[col].is_null().to_numpy()
            for row in np.flatnonzero(failed & ~bad):
                reasons[int(lines[row])] = f"field {col!r}: {raw[col][int(row)]!r} is not {expected}"
            bad |= failed
        for line in sorted(reasons):
            self.bad(line, reasons[line])
        if not bad.any():
            return typed
        return typed.filter(pl.Series(~bad))


MAX_COUNT = 2**31 - 1  # token counts are int32 in the trace schema


def count_field(col: str, least: int = 0) -> tuple[pl.Expr, str]:
    """A token count: an integer from ``least`` to 2^31 - 1 (a prompt's least is 1: a request of no
    prompt tokens is one no server accepts, vLLM's "the decoder prompt cannot be empty")."""
    value = pl.col(col).cast(pl.Int64, strict=False)
    return pl.when((value >= least) & (value <= MAX_COUNT)).then(value), f"an integer from {least} to 2^31 - 1"


MAX_SECONDS = 1e9  # about 31.7 years: a longer trace clock is damage, not data


def seconds_field(col: str) -> tuple[pl.Expr, str]:
    """A time in seconds: a number from 0 to ``MAX_SECONDS``."""
    value = pl.col(col).cast(pl.Float64, strict=False)
    return (pl.when(value.is_finite() & (value >= 0) & (value <= MAX_SECONDS)).then(value),
            f"a number of seconds from 0 to {MAX_SECONDS:g}")
