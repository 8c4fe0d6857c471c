"""The one ``KEY=VALUE`` parser: every verb's ``--param``, ``--set``, ``--arrival-option`` and
``--corpus-option``, and ``cachelab run --set``, type their values by the same rule.

A value is, in this order: ``true`` / ``false`` in any case (a bool); an integer in Python's
syntax (``4``, ``-3``, ``1_000``: an int); a number in Python's float syntax (``0.01``,
``.5``, ``1e-3``, ``inf``: a float); a TOML list, inline table or quoted string
(``[1, 2]``, ``["lru", "fifo"]``, ``{a = 1}``, ``"007"``); else the text itself, stripped
(``v0.1``, ``lru``). So a list is written as TOML writes it, and a quoted value stays a string.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import tomllib
import types
import typing
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


def check_params(cls, params: dict, where: str) -> None:
    """Refuse, naming ``where`` and the key, a parameter ``cls`` does not take, or a value whose
    type is not the parameter's (its annotation where that is a plain type or an optional one,
    else its default's): an integer for an int, a number for a float, ``true``/``false`` for a
    bool, text for a str. Checked before any work starts."""
    sig = inspect.signature(cls)
    takes = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    kinds_of = _declared_kinds(cls, takes)
    for key, value in params.items():
        if key not in takes:
            if takes_any:
                continue
            name = getattr(cls, "name", None) or getattr(cls, "__name__", cls)
            raise CachelabError(f"{where}: {name!r} has no parameter {key!r}; it takes {sorted(takes) or 'none'}")
        kinds = kinds_of[key]
        if kinds is None or any(_KINDS[k](value) for k in kinds):
            continue
        words = " or ".join(_WORDS[k] for k in kinds if k in _WORDS)
        raise CachelabError(f"{where}.{key} must be {words}, got {value!r}")


def check_whole(cls, params: dict, where: str) -> None:
    """Refuse, naming ``where`` and the key, a number that is not whole given to an integer
    parameter of ``cls`` (as ``check_params`` tells its type): the Python API, which takes
    ``4.0`` or a NumPy integer, ran ``window=2.5`` as 2 where the CLI refuses it."""
    for key in _integer_params(cls):
        value = params.get(key)
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
                and not (math.isfinite(value) and value == int(value)):
            raise CachelabError(f"{where}.{key} must be an integer, got {value!r}")


@functools.cache
def _integer_params(cls) -> tuple[str, ...]:
    """The parameters of ``cls`` that take an integer and no float (read once per class: a policy
    checks its own at every reset)."""
    takes = {n: p for n, p in inspect.signature(cls).parameters.items()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return tuple(key for key, kinds in _declared_kinds(cls, takes).items()
                 if kinds and int in kinds and float not in kinds)


def _declared_kinds(cls, takes: dict) -> dict:
    """The plain types (``_kinds``) of each parameter in ``takes`` (name -> ``inspect.Parameter``)."""
    try:
        hints = typing.get_type_hints(cls.__init__ if isinstance(cls, type) else cls)
    except Exception:  # an annotation that does not resolve: fall back to the defaults
        hints = {}
    return {key: _kinds(hints.get(key), p.default) for key, p in takes.items()}


def _kinds(hint, default) -> tuple | None:
    """The plain types a parameter takes, or None where they cannot be told."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,) if hint is not None else ()
    plain = tuple(m for m in members if m is not type(None))
    if plain and all(m in _KINDS for m in plain):
        return plain + ((type(None),) if len(plain) < len(members) else ())
    if not members and type(default) in _KINDS:
        return (type(default),)
    return None


_KINDS = {bool: lambda v: isinstance(v, bool), int: lambda v: type(v) is int,
          float: lambda v: type(v) in (int, float), str: lambda v: isinstance(v, str),
          type(None): lambda v: v is None}
_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text", type(None): "none"}


def seeded_params(cls, params: dict, seed: int) -> dict:
    """A plug-in's params with its ``seed`` (where it takes one) offset by a run's: an experiment
    point's or ``cachelab train --seed``. Without it every seed fitted one model init (the MLP's
    weights, HGB's binning sample) or replayed one draw of a random policy, and only drew other
    samples. Seed 0 leaves the params as written."""
    takes = inspect.signature(cls).parameters
    if not seed or "seed" not in takes:
        return dict(params)
    default = takes["seed"].default
    return {**params, "seed": params.get("seed", 0 if default is inspect.Parameter.empty else default) + seed}
