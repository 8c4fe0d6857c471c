"""The one capacity grammar: every verb and spec that sizes a cache reads it here.

A capacity is written as

- rows: an integer (``1000``, ``"1000"``, ``"1000 rows"``); a whole number of 1 or more counts
  rows too (``2000.0``), one with a fraction (``1.5``) is refused rather than cut to 1 row;
- a fraction of the distinct rows the workload touches: a number with ``0 < f < 1``
  (``0.01``, ``"0.01"``);
- a percentage of them: ``"5%"`` (``0% < p <= 100%``);
- bytes with a unit, decimal or binary, any case, space optional: ``"512MiB"``,
  ``"2 GiB"``, ``"1.5GB"``, ``"4096 B"``.

A share counts the distinct rows of the workload in the simulator and the learning verbs, and
the table's rows in the live store (which has no workload to count): each reader says which
(``share_of``), and its errors name that. ``parse_capacity`` checks the text once;
``Capacity.rows`` resolves it when those rows and the row size are known. A share rounds to the nearest row and is never less
than one row; rows, or bytes, below one row are an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from cachelab.errors import CachelabError

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DISTINCT = "the distinct rows"  # what a share counts, unless its reader says otherwise (``share_of``)
TABLE_ROWS = "the table's rows"  # the live store's share: no workload to count


def forms(share_of: str = DISTINCT) -> str:
    """The forms a capacity takes, for an error; ``share_of``: what a share counts there."""
    return (f"rows (1000), a fraction of {share_of} (0.01), a percentage of them ('5%') "
            f"or bytes with a unit ('512MiB', '2 GiB'; units {', '.join(UNITS)})")


_TEXT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(%|[a-zA-Z]+)?\s*$")

Kind = Literal["rows", "fraction", "percent", "bytes"]


@dataclass(frozen=True, slots=True)
class Capacity:
    """A cache size as written; ``rows`` turns it into rows for one workload."""

    kind: Kind
    amount: float  # rows, a fraction in (0, 1), a percentage in (0, 100], or bytes
    written: int | float | str  # the value as the user gave it (what reports show)

    @property
    def is_share(self) -> bool:
        """A fraction or percentage: it needs the workload's distinct rows to resolve."""
        return self.kind in ("fraction", "percent")

    def rows(self, unique_rows: int | None = None, row_bytes: int | None = None,
             where: str = "capacity", share_of: str = DISTINCT) -> int:
        """Rows of a tier holding this capacity, for a workload of ``unique_rows`` distinct
        rows (``share_of`` says what they are where a share counts others) of ``row_bytes``
        bytes each (each needed only by the forms that use it)."""
        if self.is_share:
            if unique_rows is None:
                raise CachelabError(f"{where}: {self.written!r} is a share of {share_of}; "
                                    "here only rows or bytes can be resolved")
            share = unique_rows * self.amount / 100 if self.kind == "percent" else self.amount * unique_rows
            return max(1, int(round(share)))
        if self.kind == "bytes":
            if row_bytes is None:
                raise CachelabError(f"{where}: {self.written!r} is bytes; here the row size is unknown, "
                                    "give rows or a share")
            rows = int(self.amount) // row_bytes
        else:
            rows = int(self.amount)
        if rows < 1:
            raise CachelabError(f"{where}: {self.written!r} is less than one row")
        return rows

    def bytes(self, row_bytes: int, where: str = "capacity") -> int:
        """Bytes of this capacity: bytes as written, or rows times ``row_bytes``; a share has none."""
        if self.is_share:
            raise CachelabError(f"{where}: give bytes ('8 GiB') or rows, not a share ({self.written!r})")
        return int(self.amount) if self.kind == "bytes" else int(self.amount) * row_bytes


def parse_capacity(value: int | float | str | Capacity, where: str = "capacity",
                   share_of: str = DISTINCT) -> Capacity:
    """``value`` read by the grammar above; the error names ``where``, the value and the forms
    (a share of ``share_of``: the live store's is ``TABLE_ROWS``, it said 'distinct rows' there too)."""
    if isinstance(value, Capacity):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise CachelabError(f"{where}: {value!r} is not a capacity; write {forms(share_of)}")
    if isinstance(value, str):
        m = _TEXT.match(value)
        unit = (m.group(2) or "").lower() if m else None
        if m is None or unit not in ("", "%", "row", "rows", *UNITS):
            raise CachelabError(f"{where}: {value!r} is not a capacity; write {forms(share_of)}")
        number = m.group(1)  # whole digits stay an exact int: 9007199254740993 rows were 9007199254740992 as a float
        amount = int(number) if number.isdigit() else float(number)
        if unit == "%":
            if not 0 < amount <= 100:
                raise CachelabError(f"{where}: {value!r}: a share of {share_of} must be in (0%, 100%]")
            return Capacity("percent", amount, value)
        if unit in UNITS:
            if amount <= 0:
                raise CachelabError(f"{where}: {value!r}: bytes must be positive")
            return Capacity("bytes", amount * UNITS[unit], value)
        if unit in ("row", "rows"):
            return _number(amount, value, where, False, share_of)
        return _number(amount, value, where, "." in m.group(1) or "e" in m.group(1).lower(), share_of)
    return _number(value, value, where, isinstance(value, float), share_of)


def _number(amount: float, written, where: str, fraction: bool, share_of: str) -> Capacity:
    if amount != amount or amount in (float("inf"), float("-inf")):
        raise CachelabError(f"{where}: {written!r} is not a capacity; write {forms(share_of)}")
    if fraction and 0 < amount < 1:
        return Capacity("fraction", float(amount), written)
    if amount < 1:
        raise CachelabError(f"{where}: {written!r} is less than one row")
    if amount != int(amount):  # '1.5' ran as 1 row, where its writer most likely meant a share
        raise CachelabError(f"{where}: {written!r} is not a whole number of rows; a share of {share_of} "
                            f"is a fraction below 1 (0.015) or a percentage ('1.5%')")
    return Capacity("rows", amount, written)


def capacity_rows(value: int | float | str | Capacity, unique_rows: int | None = None,
                  row_bytes: int | None = None, where: str = "capacity") -> int:
    """Rows of ``value`` for a workload (``parse_capacity(value).rows(...)``)."""
    return parse_capacity(value, where).rows(unique_rows, row_bytes, where)


def parse_capacities(text: str, where: str = "--capacities") -> list[Capacity]:
    """Comma-separated capacities (``100,1%,64MiB``), each checked."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise CachelabError(f"{where}: no capacity in {text!r}; write {forms()}, comma-separated")
    return [parse_capacity(item, f"{where} {text!r}") for item in items]
