"""Reading foreign text files line by line, with errors that name the file and the line.

Importers parse each line themselves and call ``Ingest.bad`` on anything they cannot use:
by default that raises a CachelabError ``FILE:LINE: what is wrong``; with ``skip_bad`` the
line is skipped and counted, so a damaged file never yields silently fewer rows: every
non-blank line is a row out or a row skipped, ``skipped_lines`` names each skipped one (in file
order) and ``first_skipped`` says what was wrong with the first.
A CSV is read one physical line per record (these traces hold no quoted line breaks), so a
stray quote damages its own line only, and the error names that line. Gzip, bzip2 and xz
input is opened by ``cachelab.trace.compressed``; a UTF-8 byte-order mark is dropped.
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
from cachelab.trace.compressed import DECOMPRESS_ERRORS, open_binary

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
            raise CachelabError(where + (" (pass --skip-bad to skip such rows and count them)" if self.skippable else ""))
        self.skipped += 1
        self.skipped_lines.append(line)
        self.first_skipped = self.first_skipped or where

    def lines(self) -> Iterator[tuple[int, str]]:
        """(line number, text without the line end) for every line that is valid UTF-8."""
        try:
            with open_binary(self.path) as fh:
                for number, raw in enumerate(fh, start=1):
                    self.lines_read = number
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        self.bad(number, f"not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})")
                        continue
                    if number == 1:
                        text = text.removeprefix("\ufeff")
                    yield number, text.rstrip("\r\n")
        except DECOMPRESS_ERRORS as exc:  # a truncated or corrupt compressed stream, an unreadable file
            raise CachelabError(f"{self.path}:{self.lines_read + 1}: unreadable ({exc})") from None
        if self.lines_read == 0:
            raise CachelabError(f"{self.path}: empty file (no requests)")

    def json_lines(self) -> Iterator[tuple[int, object]]:
        """(line number, parsed value) of every non-blank line of a JSONL file; an object with a
        repeated key is a ``JsonObject``."""
        for number, text in self.lines():
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

        Rows with the wrong number of fields (a truncated or run-on line) are bad rows. A file of
        printable ASCII without quotes (every published trace) is split by Polars; any other is
        read line by line, so each damaged line is named.
        """
        text = self._plain_text()
        if text is None:
            return self._csv_lines(required)
        pieces = pl.Series("text", [text]).str.split("\n").explode()
        frame = (pl.DataFrame({"text": pieces.str.strip_chars_end("\r")}).with_row_index("line", offset=1)
                 .filter(pl.col("text").str.strip_chars() != ""))
        if frame.height == 0:
            raise CachelabError(f"{self.path}: empty file (no header, no requests)")
        header = self._header(frame["line"][0], frame["text"][0], required)
        self.hold()
        body = frame.slice(1).with_columns(pl.col("text").str.split(","))
        width = body["text"].list.len()
        for line, count in zip(body["line"].filter(width != len(header)), width.filter(width != len(header))):
            self.bad(line, f"{count} fields, expected {len(header)} ({', '.join(header)})")
        body = body.filter(width == len(header))
        fields = body.select(pl.col("text").list.get(header.index(c)).str.strip_chars().alias(c) for c in required)
        return fields, body["line"].to_numpy().astype(np.int64)

    def _plain_text(self) -> str | None:
        """The whole file as text if it is plain (see ``csv``), else None."""
        try:
            with open_binary(self.path) as fh:
                data = fh.read().removeprefix(b"\xef\xbb\xbf")
        except DECOMPRESS_ERRORS:
            return None  # read line by line, the damage is named where it is
        return data.decode("ascii") if data and _NOT_PLAIN.search(data) is None else None

    def _header(self, line: int, text: str, required: Sequence[str]) -> list[str]:
        """The header's column names; a required one missing, or a header no CSV reader parses, is an
        error naming the line."""
        try:
            header = [h.strip() for h in _fields(text)]
        except csv.Error as exc:  # a quote left open, a quoted name past the field limit
            raise CachelabError(f"{self.path}:{line}: malformed CSV header ({exc})") from None
        missing = [c for c in required if c not in header]
        if missing:
            raise CachelabError(f"{self.path}:{line}: missing column(s) {missing}; the header has {header}")
        return header

    def _csv_lines(self, required: Sequence[str]) -> tuple[pl.DataFrame, np.ndarray]:
        """``csv`` one line at a time, for a file that is not plain."""
        rows = ((number, text) for number, text in self.lines() if text.strip())
        first = next(rows, None)
        self.hold()
        if first is None:
            raise CachelabError(f"{self.path}: empty file (no header, no requests)")
        header = self._header(first[0], first[1], required)
        index = [header.index(c) for c in required]
        columns: list[list[str]] = [[] for _ in required]
        lines: list[int] = []
        for number, text in rows:
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
        return frame, np.asarray(lines, dtype=np.int64)

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
