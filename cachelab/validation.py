"""The one strict base of every spec model, and the one way their errors are worded.

Experiment specs (``cachelab.experiment.spec``) and trace build specs
(``cachelab.trace.build``) are both TOML checked by Pydantic before any work; both reject
unknown keys and report the first error as ``<where>: <dotted.key>: <what> (got <value>)``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from cachelab.errors import CachelabError

M = TypeVar("M", bound=BaseModel)
_UNION_TAG = re.compile(r"^(int|str|float|bool|none|.*\[.*)$")  # pydantic's names of union members


class Strict(BaseModel):
    """A spec section: unknown keys are errors and values must have the type asked for (TOML's
    types are exact; only an integer passes for a float): lax coercion took ``seeds = [true]``
    for seed 1 and ``"8"`` for 8."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)


def validate(model: type[M], data: dict, where: str) -> M:
    """``data`` as a ``model``; the error names ``where``, the dotted key and the value."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = dotted(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err['input']!r})"
        raise CachelabError(f"{where}: {key}: {msg}{got}") from None


def dotted(loc) -> str:
    """A Pydantic error location as the key a user wrote (``hierarchy.tiers[0].policy``)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.match(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def read_toml(path: str | Path, what: str = "spec file") -> dict:
    """The tables of a TOML file; a missing or malformed file is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise CachelabError(f"{what} not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CachelabError(f"{path}: not valid TOML ({exc})") from None
