"""Results as strict JSON: NaN and infinities become ``null``.

RFC 8259 has no NaN; Python's ``json`` writes a bare ``NaN`` that jq, JavaScript and most
other parsers refuse. A figure with no values (a TPOT of one-token answers, a front that never
reaches the read-off) is ``null`` in every ``--json`` output and every JSON file cachelab writes.
NumPy scalars and other numbers ``json`` does not know are written as floats.
"""

from __future__ import annotations

import json
import math


def json_safe(value):
    """``value`` with every non-finite float (nested in dicts, lists, tuples) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _number(value):
    number = float(value)
    return number if math.isfinite(number) else None


def dumps(value, *, default=_number, **kwargs) -> str:
    """``json.dumps`` that never writes NaN or Infinity (``kwargs`` as ``json.dumps`` takes them)."""
    return json.dumps(json_safe(value), allow_nan=False, default=default, **kwargs)
