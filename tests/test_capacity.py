"""The one capacity grammar: every form resolves as the five grammars it replaces did, and a
bad value is an error naming it and the accepted forms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachelab.capacity import UNITS, Capacity, capacity_rows, parse_capacities, parse_capacity
from cachelab.errors import CachelabError

ROW_BYTES = st.integers(1, 4096)
UNIQUE = st.integers(1, 10**9)


def _old_spec_rows(text: str, unique: int, row_bytes: int) -> int:
    """The experiment spec's grammar before this one: 'N%' and bytes."""
    amount, unit = float(text.rstrip("%").split()[0]), text.split()[-1].lower() if " " in text else "%"
    return int(round(unique * amount / 100)) if unit == "%" else int(amount * UNITS[unit]) // row_bytes


def _old_learning_rows(capacity: float, unique: int) -> int:
    """The learning CLI's grammar before this one: a fraction below 1, else rows."""
    return max(1, int(round(capacity * unique))) if capacity < 1 else int(capacity)


@given(st.integers(1, 10**12), UNIQUE, ROW_BYTES)
def test_rows_round_trip_in_every_spelling(n, unique, row_bytes):
    for written in (n, str(n), f"{n} rows", f" {n}rows ", float(n)):
        cap = parse_capacity(written)
        assert cap.kind == "rows" and cap.written == written
        assert cap.rows(unique, row_bytes) == n
    assert cap.bytes(row_bytes) == n * row_bytes


@given(st.floats(1e-6, 1 - 1e-9), UNIQUE)
def test_fractions_resolve_as_the_learning_cli_did(f, unique):
    assert parse_capacity(f).kind == "fraction" and parse_capacity(repr(f)).kind == "fraction"
    assert capacity_rows(f, unique) == _old_learning_rows(f, unique)
    assert capacity_rows(repr(f), unique) == _old_learning_rows(f, unique)


@given(st.integers(1, 10**9).map(float), UNIQUE)
def test_whole_numbers_of_one_or_more_are_rows_as_the_learning_cli_did(x, unique):
    assert capacity_rows(x, unique) == _old_learning_rows(x, unique)


@given(st.floats(1.0, 1e9).filter(lambda x: x != int(x)), UNIQUE)
def test_a_number_of_rows_with_a_fraction_is_refused_not_cut(x, unique):
    """``--capacity 1.5`` ran as 1 row (the learning CLI's ``int``), where its writer most likely
    meant 1.5%; it is refused, naming both ways to write a share."""
    for value in (x, repr(x)):
        with pytest.raises(CachelabError, match="is not a whole number of rows; a share of the distinct rows"):
            capacity_rows(value, unique)


@given(st.floats(0.001, 100).map(lambda p: round(p, 3)).filter(lambda p: p > 0), UNIQUE)
def test_percentages_resolve_as_the_spec_did(p, unique):
    text = f"{p:g}%"
    cap = parse_capacity(text)
    assert cap.kind == "percent" and cap.is_share
    assert cap.rows(unique) == max(1, _old_spec_rows(text, unique, 1))


@given(st.integers(1, 10**6), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]),
       st.sampled_from([str.lower, str.upper, lambda u: u[:-1].upper() + u[-1:]]), ROW_BYTES)
def test_bytes_with_any_unit_spelling(k, unit, space, case, row_bytes):
    text = f"{k}{space}{case(unit)}"
    cap = parse_capacity(text)
    assert cap.kind == "bytes" and cap.bytes(row_bytes) == k * UNITS[unit]
    if k * UNITS[unit] >= row_bytes:
        assert cap.rows(row_bytes=row_bytes) == _old_spec_rows(f"{k} {unit}", 1, row_bytes)
    else:
        with pytest.raises(CachelabError, match=f"{text!r} is less than one row"):
            cap.rows(row_bytes=row_bytes)


def test_the_documented_examples():
    assert capacity_rows("512MiB", row_bytes=264) == 512 * 2**20 // 264
    assert capacity_rows("2 GiB", row_bytes=264) == 2 * 2**30 // 264
    assert capacity_rows("1.5GB", row_bytes=264) == int(1.5e9) // 264
    assert capacity_rows("5%", unique_rows=1000) == 50
    assert capacity_rows("100%", unique_rows=1000) == 1000
    assert [c.written for c in parse_capacities("100, 1%,64MiB")] == ["100", "1%", "64MiB"]
    assert parse_capacity(Capacity("rows", 3.0, 3)) == Capacity("rows", 3.0, 3)


BAD = st.one_of(st.from_regex(r"[a-z]{1,6}", fullmatch=True).filter(lambda w: w not in ("row", "rows")),
                st.from_regex(r"-[0-9]{1,4}", fullmatch=True),
                st.from_regex(r"[0-9]{1,4} ?(PiB|bits|lines)", fullmatch=True))


@given(BAD)
def test_a_bad_value_is_named_with_the_accepted_forms(text):
    with pytest.raises(CachelabError) as err:
        parse_capacity(text, "hierarchy.tiers[0].capacity")
    message = str(err.value)
    assert message.startswith(f"hierarchy.tiers[0].capacity: {text!r} is not a capacity")
    assert "rows (1000)" in message and "'5%'" in message and "MiB" in message


@pytest.mark.parametrize("value, message", [
    (0, "0 is less than one row"), (-3, "-3 is less than one row"), (0.0, "0.0 is less than one row"),
    ("150%", "'150%': a share of the distinct rows must be in (0%, 100%]"), ("0%", "a share of the distinct rows must"),
    ("0 MiB", "bytes must be positive"), (True, "True is not a capacity"), (float("nan"), "not a capacity"),
    ([1], "[1] is not a capacity"),
])
def test_out_of_range_values(value, message):
    with pytest.raises(CachelabError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        parse_capacity(value)


def test_a_share_needs_the_workload_and_bytes_need_the_row_size():
    with pytest.raises(CachelabError, match="'1%' is a share of the distinct rows"):
        capacity_rows("1%", row_bytes=264, where="--capacity")
    with pytest.raises(CachelabError, match="'64MiB' is bytes; here the row size is unknown"):
        capacity_rows("64MiB", unique_rows=10)
    with pytest.raises(CachelabError, match="not a share"):
        parse_capacity("1%").bytes(264)


def test_whole_numbers_in_text_are_exact():
    """A count in text went through a float: 2^53 + 1 rows ran (and were reported) as 2^53, and
    bytes past 2^53 likewise."""
    for n in (2**53 + 1, 2**63 - 1, 10**30 + 7):
        assert capacity_rows(str(n)) == capacity_rows(f"{n} rows") == capacity_rows(n) == n
        assert parse_capacity(f"{n} B").bytes(row_bytes=1) == n
        assert capacity_rows(f"{n}KiB", row_bytes=3) == n * 1024 // 3
    assert capacity_rows("2.5e3") == 2500 and capacity_rows("2000.0") == 2000

