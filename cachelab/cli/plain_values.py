"""Typer's conversion of plain option values (text, whole and decimal numbers, flags), without pydantic.

Typer 0.2x converts each option's value through a pydantic ``TypeAdapter`` that it builds as the
option is parsed, a missing one too (``--model`` of ``simulate``, absent, built a ``Path``
adapter to convert nothing): importing pydantic and building them took 0.06-0.08 s of CPU in every
``simulate`` run, a quarter of its LRU kernel's time on 10 M requests (docs/engine.md). ``install`` gives each
option a conversion that returns what the adapter returns where the conversion is plain (a ``str``
kept; digits to an ``int``; digits with a decimal point to a ``float``; numbers and flags that are
already parsed; a list of ``str``), for plain types only (no parser, bounds, clamp or file), and
hands any other value to Typer's own adapter, built then: a wrong value gets Typer's message and
exit status as before. Under a Typer release not in ``CHECKED_TYPER`` it does nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import typer

# The Typer releases whose private conversion layer (``typer._coercion``) this mirrors, as the tests
# compare it; under any other release Typer converts every value itself, slower and as it always does.
CHECKED_TYPER = ((0, 29),)

RuntimeParam = None
if tuple(int(part) for part in typer.__version__.split(".")[:2] if part.isdigit()) in CHECKED_TYPER:
    from typer._coercion import RuntimeParam, build_runtime_param
    from typer.core import _TyperParameter

WHOLE = re.compile(r"-?[0-9]{1,18}")  # int(s) is pydantic's int here (pydantic also takes "-0.0" as 0)
DECIMAL = re.compile(r"-?[0-9]{1,18}(\.[0-9]{1,18})?")  # float(s) and pydantic both round correctly


def plain(annotation: Any, value: Any) -> Any:
    """``value`` converted as Typer's adapter for ``annotation`` converts it, or ``None`` where the
    conversion is not plain (the adapter decides)."""
    if annotation is bool:  # a flag's own value (text from an environment variable: the adapter)
        return value if type(value) is bool else None
    if annotation is str:
        return value if type(value) is str else None
    if annotation is int:
        if type(value) is int:
            return value
        return int(value) if type(value) is str and WHOLE.fullmatch(value) else None
    if annotation is float:
        if type(value) is float:
            return value
        return float(value) if type(value) is str and DECIMAL.fullmatch(value) else None
    if annotation == list[str] and isinstance(value, (list, tuple)) and all(type(v) is str for v in value):
        return list(value)
    return None


def is_plain(descriptor) -> bool:
    """Whether Typer's adapter for ``descriptor`` converts as ``plain`` does: no file, parser, bounds
    or clamp (a ``str`` with path flags is still converted as text: Typer checks ``str`` first)."""
    info = descriptor.parameter_info
    if descriptor.file_annotation is not None or info.parser is not None:
        return False
    if descriptor.annotation in (int, float):
        return info.min is None and info.max is None and not info.clamp
    return descriptor.annotation in (str, bool) or descriptor.annotation == list[str]


if RuntimeParam is not None:

    @dataclass(frozen=True)
    class _Plain(RuntimeParam):
        """An option's conversion: ``plain`` where it is, else Typer's adapter (built then)."""

        descriptor: Any = None
        simple: bool = False

        def _coerce_value(self, value, param, ctx):
            converted = plain(self.annotation, value) if self.simple else None
            if converted is not None:
                return converted
            return build_runtime_param(self.descriptor)._coerce_value(value, param=param, ctx=ctx)


def install(params) -> None:
    """Give every Typer option of ``params`` (a command's, its help flag included) that conversion,
    where Typer has not converted a value of it yet."""
    if RuntimeParam is None:
        return
    for param in params:
        if isinstance(param, _TyperParameter) and getattr(param, "_runtime_param", 0) is None:
            described = param.type_descriptor
            param._runtime_param = _Plain(parameter_info=described.parameter_info, annotation=described.annotation,
                                          descriptor=described, simple=is_plain(described))
