"""The one KEY=VALUE parser: every verb's flag and spec override types a value the same way."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachelab.errors import CachelabError
from cachelab.params import parse_pair, parse_pairs, parse_value

KEYS = st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True)
WORDS = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_.\-]{0,12}", fullmatch=True).filter(
    lambda w: w.lower() not in ("true", "false", "inf", "nan", "infinity") and not _is_number(w))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@given(KEYS, st.integers())
def test_integers_round_trip(key, n):
    assert parse_pair(f"{key}={n}") == (key, n)
    assert type(parse_value(str(n))) is int


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_round_trip(x):
    value = parse_value(repr(x))  # repr always has a point or an exponent
    assert value == x and type(value) is float


@given(st.booleans(), st.sampled_from([str.lower, str.upper, str.title]))
def test_booleans_in_any_case(b, case):
    assert parse_value(case(str(b))) is b


@given(WORDS)
def test_bare_words_stay_text(word):
    assert parse_value(f"  {word} ") == word


@given(st.lists(st.integers(), max_size=5), st.lists(st.sampled_from(["lru", "fifo", "5%"]), max_size=3))
def test_lists_are_written_as_toml(ints, words):
    assert parse_value(str(ints)) == ints
    assert parse_value("[" + ", ".join(f'"{w}"' for w in words) + "]") == words


def test_documented_usages_keep_their_meaning():
    assert parse_pairs(["window=0.01", "n_estimators=200", "rate=4", "version=v0.1", "bypass=true"]) == \
        {"window": 0.01, "n_estimators": 200, "rate": 4, "version": "v0.1", "bypass": True}
    assert parse_value(".5") == 0.5 and parse_value("1_000") == 1000 and parse_value('"007"') == "007"
    assert math.isinf(parse_value("inf"))
    assert parse_value("2024-01-01") == "2024-01-01"  # a TOML date stays its text
    assert parse_value("{ a = 1 }") == {"a": 1}


@given(st.sampled_from(["--param", "--set", "--arrival-option"]),
       st.from_regex(r"[a-z0-9]{0,8}", fullmatch=True))
def test_a_pair_without_equals_names_the_flag_and_the_item(flag, item):
    with pytest.raises(CachelabError, match=f"{flag} '{item}': expected KEY=VALUE"):
        parse_pair(item, flag)
    with pytest.raises(CachelabError, match="expected KEY=VALUE"):
        parse_pair(f"={item}", flag)


def test_every_policy_refuses_a_fractional_integer_parameter_or_capacity():
    """The Python API ran ``belady-lookahead(window=2.5)`` as window 2, and ``reset(2.5, n)`` with 2
    rows, where the CLI refuses ``--param window=2.5`` (``check_params``); a whole float or a NumPy
    integer still passes."""
    import inspect

    import numpy as np

    from cachelab import registry
    from cachelab.params import _declared_kinds
    from cachelab.policy.kernel import KernelPolicy

    checked = 0
    for name in sorted(registry.resolved(registry.POLICIES)):
        cls = registry.get(registry.POLICIES, name)
        if not issubclass(cls, KernelPolicy):
            continue  # a wrapper (learned-admission) resets a kernel policy, which checks its own
        takes = {n: p for n, p in inspect.signature(cls).parameters.items() if n != "self"}
        for key, kinds in _declared_kinds(cls, takes).items():
            if kinds and int in kinds and float not in kinds and isinstance(takes[key].default, int) \
                    and not isinstance(takes[key].default, bool):
                with pytest.raises(CachelabError, match=rf"^{name}\.{key} must be an integer, got "
                                                        rf"{takes[key].default + 2.5}$"):
                    cls(**{key: takes[key].default + 2.5}).reset(64, 100)
                cls(**{key: float(takes[key].default + 1)}).reset(64, 100)
                cls(**{key: np.int64(takes[key].default + 1)}).reset(64, 100)
                checked += 1
        with pytest.raises(CachelabError, match=r"^capacity must be a whole number, got 2\.5$"):
            cls().reset(2.5, 100)
        cls().reset(np.float64(64.0), np.int32(100))
    assert checked >= 10  # window, horizon, epoch, warmup_epochs, bits, sample, seed, move_to_main_threshold, ...
