"""The one ``KEY=VALUE`` parser: every verb's ``--param``, ``--set``, ``--arrival-option`` and
``--corpus-option``, and ``cachelab run --set``, type their values by the same rule.

A value is, in this order: ``true`` / ``false`` in any case (a bool); an integer in Python's
syntax (``4``, ``-3``, ``1_000``: an int); a number in Python's float syntax (``0.01``,
``.5``, ``1e-3``, ``inf``: a float); a TOML list, inline table or quoted string
(``[1, 2]``, ``["lru", "fifo"]``, ``{a = 1}``, ``"007"``); else the text itself, stripped
(``v0.1``, ``lru``). So a list is written as TOML writes it, and a quoted value stays a string.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable

from cachelab.errors import CachelabError

Value = bool | int | float | str | list | dict


def parse_value(text: str) -> Value:
    """One value typed by the rule above."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, (str, list, dict)) else text  # a TOML date stays its text


def parse_pair(item: str, flag: str = "--param", example: str = "window=0.01") -> tuple[str, Value]:
    """``KEY=VALUE`` to ``(key, value)``; the error names the flag and the item."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise CachelabError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example}")
    return key.strip(), parse_value(text)


def parse_pairs(items: Iterable[str], flag: str = "--param", example: str = "window=0.01") -> dict[str, Value]:
    """Repeated ``KEY=VALUE`` items to a dict (a later key wins)."""
    return dict(parse_pair(item, flag, example) for item in items)
