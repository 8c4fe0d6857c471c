"""How the text output writes a count and a size for a person ("1 object", "37.6 MiB"); --json keeps the numbers.

The text said "at 1 objects", and a sweep's summary showed bytes as ``3.938e+07`` with no unit.
"""

from __future__ import annotations

BINARY = ("KiB", "MiB", "GiB", "TiB", "PiB")  # units the capacity grammar reads back (cachelab.capacity)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` with thousands separators and ``noun``, plural unless ``n`` is 1 (``plural``: an irregular form)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def byte_text(n: float) -> str:
    """A byte count in binary units, three significant figures ("512 B", "37.6 MiB", "1.05 GiB")."""
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    value, unit = float(n), "B"
    for unit in BINARY:
        value /= 1024
        if abs(value) < 1023.5:  # not "1024 KiB" once rounded
            break
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"
