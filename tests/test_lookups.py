"""The lookup stream: flattening order, step semantics, dedup, compaction and .npz round trips."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab.errors import CachelabError
from cachelab.workload.compaction import (StepDeduper, _bits_for, _compact_steps_kernel, _start_bits, compact,
                                          compact_steps, count_distinct, dedup_steps)
from cachelab.workload.lookups import LookupStream, first_tokens, global_key, split_key


def test_from_rows_flattens_token_layer_column_with_meta():
    rows = np.arange(2 * 2 * 3, dtype=np.int32).reshape(2, 2, 3)
    s = LookupStream.from_rows(rows, np.array([0, 2]), 264, (1, 14), {"request": np.array([7, 8])})
    layer, row = split_key(s.keys)
    assert layer.tolist() == [0, 0, 0, 1, 1, 1] * 2
    assert row.tolist() == list(range(12))
    assert s.step_offsets.tolist() == [0, 6, 6, 12]  # step 1 is empty
    assert s.meta["column"].tolist() == [0, 1, 2] * 4
    assert s.meta["request"].tolist() == [7] * 6 + [8] * 6


def test_from_rows_rejects_decreasing_steps():
    with pytest.raises(CachelabError, match="non-decreasing"):
        LookupStream.from_rows(np.zeros((2, 1, 1), np.int32), np.array([1, 0]), 264, (1,))


def test_metadata_that_its_dtype_cannot_hold_is_refused_not_wrapped():
    # a layout of 8 heads x 17 orders: 136 columns per layer; int8 wrapped column 128 to -128
    with pytest.raises(CachelabError, match="136 columns per layer; the column metadata holds at most 128"):
        LookupStream.from_rows(np.zeros((1, 1, 136), np.int32), np.array([0]), 264, (1,))
    assert LookupStream.from_rows(np.zeros((1, 1, 128), np.int32), np.array([0]), 264, (1,)).meta["column"][-1] == 127
    keys, steps = np.array([1, 2]), np.array([0, 2])
    with pytest.raises(CachelabError, match="meta field 'request' holds 4294967296, not an integer that its int32"):
        LookupStream(keys, steps, 264, meta={"request": np.array([0, 2**32])})
    with pytest.raises(CachelabError, match="meta field 'phase' holds 0.5"):
        LookupStream(keys, steps, 264, meta={"phase": np.array([0.5, 1.0])})
    assert LookupStream(keys, steps, 264, meta={"phase": np.array([0.0, 1.0])}).meta["phase"].tolist() == [0, 1]
    with pytest.raises(CachelabError, match="32769 distinct domains; the domain metadata holds at most 32768"):
        LookupStream.from_request_rows(_FakeAddresser.config, np.zeros((32769, 1, 2), np.int32), np.zeros(32769),
                                       {"request": np.arange(32769)}, [str(i) for i in range(32769)], 32769)


class _FakeAddresser:
    """Row = token id + column, one layer of 2 columns: enough to check step bookkeeping."""

    class config:  # noqa: N801
        row_bytes, layers = 264, (1,)

    def rows(self, tokens, offsets):
        return (np.asarray(tokens)[:, None, None] + np.arange(2)[None, None, :]).astype(np.int32)


def test_from_sequences_chunks_prefill_then_decodes_one_token_per_step():
    seqs = [np.arange(5), np.arange(100, 103)]
    s = LookupStream.from_sequences(_FakeAddresser(), seqs, tokens_per_step=2, prompt_lengths=[3, 3],
                                    domains=["code", "math"])
    # request 0: prefill [0,1] [2], decode [3] (4, the last output, is never fed back); request 1: prefill
    # [100,101] [102]
    assert (np.diff(s.step_offsets) // 2).tolist() == [2, 1, 1, 2, 1]
    tok_phase = s.meta["phase"][::2].tolist()
    assert tok_phase == [0, 0, 0, 1, 0, 0, 0]
    assert s.meta["position"][::2].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert s.domains == ("code", "math") and s.meta["domain"][::2].tolist() == [0] * 4 + [1] * 3


def test_save_load_round_trip_and_errors(tmp_path):
    rows = np.random.default_rng(0).integers(0, 1000, (10, 2, 4), dtype=np.int32)
    s = LookupStream.from_rows(rows, np.arange(10) // 3, 264, (1, 14), {"request": np.arange(10)}, ("a",))
    back = LookupStream.load(s.save(tmp_path / "s.npz"))
    assert np.array_equal(back.keys, s.keys) and np.array_equal(back.step_offsets, s.step_offsets)
    assert back.layers == (1, 14) and back.row_bytes == 264 and back.domains == ("a",)
    assert set(back.meta) == {"column", "request"} and back.meta["column"].dtype == np.int8
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(CachelabError, match="bad.npz"):
        LookupStream.load(tmp_path / "bad.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(CachelabError, match="'version' missing"):
        LookupStream.load(tmp_path / "other.npz")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=8), min_size=1, max_size=12))
def test_dedup_matches_a_plain_python_reading(steps):
    keys = np.array([k for s in steps for k in s], dtype=np.int64) << 33  # sparse keys: compaction matters
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])])
    ids, uniq = compact(keys)
    assert np.array_equal(uniq[ids], keys)
    dd = dedup_steps(ids, offsets, uniq.size)
    for s, step in enumerate(steps):
        distinct = list(dict.fromkeys(step))
        got = uniq[dd.keys[dd.offsets[s]:dd.offsets[s + 1]]] >> 33
        assert got.tolist() == distinct
        for i in range(offsets[s], offsets[s + 1]):
            assert uniq[dd.keys[dd.inverse[i]]] == keys[i]
    assert dd.counts.sum() == keys.size


def test_an_entrys_lookup_count_takes_no_int64_copy_of_where_each_lookup_went():
    """``StepDedup.counts`` was ``np.bincount(inverse)``, which first casts the int32 ``inverse``
    to a new intp array, 8 B a lookup: the peak of ``cachelab mrc`` (1.86 GB on 80 Mooncake
    requests, 30 B a lookup between 40 and 80). Now the counts alone, 8 B an entry."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 50_000, 3_000_000) << 20
    dd, _ = compact_steps(keys, np.arange(0, keys.size + 1, 6))
    assert dd.inverse.dtype == np.int32
    compact_steps(keys[:12], np.arange(0, 13, 6))[0].counts  # compiled outside the count
    tracemalloc.start()
    try:
        counts = dd.counts
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * dd.keys.size + (1 << 16), f"{peak / keys.size:.1f} B a lookup"
    assert counts.dtype == np.int64 and np.array_equal(counts, np.bincount(dd.inverse.astype(np.int64)))


def test_global_key_round_trip():
    layer, row = split_key(global_key([0, 1, 1], [5, 0, 2**31 - 1]))
    assert layer.tolist() == [0, 1, 1] and row.tolist() == [5, 0, 2**31 - 1]


def test_from_texts_cuts_requests_and_caps_tokens():
    from cachelab.engram import Addresser

    addresser = Addresser("deepseek-v4.1-flash")
    texts = ["The quick brown fox jumps over the lazy dog. " * 20, "Hello world."]
    full = LookupStream.from_texts(addresser, texts, request_tokens=50, tokens_per_step=None,
                                   domains=["prose", "greeting"])
    tokens = full.num_lookups // 48
    assert full.num_steps == int(full.meta["request"].max()) + 1  # one step per request
    assert np.bincount(full.meta["request"][::48]).max() == 50
    assert full.domains == ("greeting", "prose") and full.meta["domain"][-1] == 0
    capped = LookupStream.from_texts(addresser, texts, request_tokens=50, max_tokens=120)
    assert capped.num_lookups == 120 * 48 and np.array_equal(capped.keys, full.keys[:120 * 48])
    assert LookupStream.from_texts(addresser, texts, max_tokens=10**9).num_lookups == tokens * 48


@pytest.mark.parametrize("kwargs, message", [
    ({"request_tokens": -5}, "request_tokens must be at least 1 .* got -5"),  # was an empty stream
    ({"request_tokens": 0}, "request_tokens must be at least 1 .* got 0"),  # was the whole text, as None
    ({"max_tokens": -2}, "max_tokens must be at least 0 .* got -2"),  # kept the text less its last 2 tokens
    ({"domains": ["prose"]}, "domains has 1 labels for 2 texts"),  # an IndexError
])
def test_from_texts_refuses_bad_arguments_by_name(kwargs, message):
    from cachelab.engram import Addresser

    with pytest.raises(CachelabError, match=message):
        LookupStream.from_texts(Addresser("deepseek-v4.1-flash"), ["hello world", "and more"], **kwargs)


def test_a_workload_budget_above_its_tokens_keeps_them_all():
    """An experiment workload of 10 tokens under ``max_tokens = 12`` kept 7: the last sequence was
    cut to the budget less the others' tokens (12 - 10) even where nothing had to be cut."""
    from cachelab.experiment.workload import _clip

    seqs = [np.arange(5), np.arange(5, 10)]
    for budget, sizes in ((12, [5, 5]), (10, [5, 5]), (7, [5, 2]), (5, [5]), (3, [3])):
        kept, prompts, domains = _clip(seqs, np.array([4, 4]), ["a", "b"], budget)
        assert [k.size for k in kept] == sizes and domains == ["a", "b"][:len(sizes)]
        assert prompts.tolist() == [min(4, n) for n in sizes]
        assert np.array_equal(np.concatenate(kept), np.arange(sum(sizes)))
    assert first_tokens([], 5) == [] and [s.size for s in first_tokens([np.arange(0), np.arange(4)], 2)] == [0, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=8), min_size=1, max_size=12))
def test_compact_steps_is_compact_then_dedup_in_one_pass(steps):
    keys = np.array([k for s in steps for k in s], dtype=np.int64) << 33
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])])
    ids, uniq = compact(keys)
    want = dedup_steps(ids, offsets, uniq.size)
    got, got_uniq = compact_steps(keys, offsets)
    assert np.array_equal(got_uniq, uniq)
    for name in ("keys", "offsets", "inverse"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    # 4 B a lookup each, not 8, under 2^31 lookups (int64 past that: index_dtype); a key trace's
    # are its ids and offsets, as test_a_key_trace_dedups_without_arrays_of_its_size says
    assert want.keys.dtype == want.inverse.dtype == np.int32
    if any(len(step) != 1 for step in steps):
        assert got.keys.dtype == got.inverse.dtype == np.int32


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-3, 40), max_size=60))
def test_a_key_trace_dedups_without_arrays_of_its_size(keys):
    """One lookup per step: the general pass's answer, its offsets and inverse the steps' own."""
    keys = np.array(keys, dtype=np.int64) << 33
    offsets = np.arange(keys.size + 1, dtype=np.int64)
    got, uniq = compact_steps(keys, offsets)
    ids, want_uniq = compact(keys)
    assert np.array_equal(uniq, want_uniq) and np.array_equal(got.keys, ids)
    assert np.array_equal(got.offsets, offsets) and np.array_equal(got.inverse, offsets[:-1])
    assert np.shares_memory(got.offsets, offsets) and (keys.size == 0 or np.shares_memory(got.inverse, offsets))
    if keys.size > 1:  # two lookups in one step, once: the general pass
        merged = np.concatenate([[0], offsets[2:]])
        dd, _ = compact_steps(keys, merged)
        assert dd.offsets[1] == (1 if keys[0] == keys[1] else 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 60), max_size=40), st.sampled_from([0, 1, 40, 2**62]))
def test_dense_and_hashed_keys_get_the_same_first_occurrence_ids(keys, spread):
    """Keys within a small range take the array-indexed pass, spread ones the hash table; both
    number the keys in the order they first occur."""
    keys = np.array(keys, dtype=np.int64) * max(spread, 1)
    first = list(dict.fromkeys(keys.tolist()))
    ids, uniq = compact(keys)
    assert uniq.tolist() == first and ids.tolist() == [first.index(k) for k in keys.tolist()]


def test_compaction_grows_its_table_past_a_repetitive_prefix():
    """A prefix of one key sizes the table small; the distinct keys after it make it grow."""
    keys = np.concatenate([np.zeros(1 << 20, np.int64), np.arange(1, 300_001, dtype=np.int64) * 7919 << 20])
    ids, uniq = compact(keys)
    assert uniq.size == 300_001 and np.array_equal(uniq[ids], keys)
    dd, uniq_steps = compact_steps(keys, np.arange(keys.size + 1))
    assert np.array_equal(uniq_steps, uniq) and np.array_equal(dd.keys, ids)


@pytest.mark.parametrize("per_step", [1, 4])
def test_a_table_grown_mid_pass_is_not_held_beside_its_double(per_step):
    """Callers without an exact count (evaluate's view, store bench, byte and row capacities) start
    the table at a prefix's guess, too small on 30-40 standard-library requests: it grew mid-pass,
    the old table held while its double was filled, 1.5x the final table at the peak. The ids and
    keys so far rebuild the larger table once the old one is freed."""
    keys = np.concatenate([np.zeros(1 << 20, np.int64), np.arange(1, 2_000_001, dtype=np.int64) * 7919 << 20])
    offsets = np.append(np.arange(0, keys.size, per_step), keys.size)
    compact_steps(keys[:12], offsets[:13 // per_step + 1])  # compiled outside the count
    tracemalloc.start()
    try:
        dd, uniq = compact_steps(keys, offsets)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    table = 16 << _bits_for(uniq.size)  # the smallest that holds them, where growth ends
    made = 8 * keys.size + dd.keys.nbytes + (0 if per_step == 1 else dd.inverse.nbytes + dd.offsets.nbytes)
    assert peak - made < 1.1 * table, f"{(peak - made) / table:.2f}x the table"
    want, want_uniq = compact_steps(keys, offsets, uniq.size)  # sized to never grow
    assert np.array_equal(uniq, want_uniq) and uniq.size == 2_000_001
    for name in ("keys", "offsets", "inverse"):
        assert np.array_equal(getattr(dd, name), getattr(want, name)), name


def test_a_counted_table_holds_the_distinct_keys_without_growing_and_a_low_count_grows():
    """Past the prefix, keys stop growing (as a real stream's do): the prefix's share sized the
    table 4x what 300 000 keys need. The exact count (``count_distinct``) sizes the smallest table
    under the load bound, which the pass never grows; a count too low still grows to hold them."""
    rng = np.random.default_rng(5)
    distinct = rng.permutation(300_000).astype(np.int64) * 7919 << 20
    keys = np.concatenate([distinct, distinct[rng.integers(0, distinct.size, 4 << 20)]])
    offsets = np.arange(0, keys.size + 1, 4, dtype=np.int64)
    n = count_distinct(keys)
    assert n == distinct.size
    bits = _start_bits(keys, n)
    assert int(0.6 * (1 << bits)) >= n > int(0.6 * (1 << bits - 1))  # the smallest that holds them
    assert _start_bits(keys) >= bits + 2  # the prefix's guess: 4x the table
    for hint, start in ((n, bits), (1, 4)):
        entries = np.empty(keys.size, np.int64)
        got = _compact_steps_kernel(keys, offsets, start, np.empty(keys.size, np.int64), entries,
                                    np.zeros(offsets.size, np.int64), np.empty(keys.size, np.int64))
        assert got[0] == n and got[2] == bits, hint  # exact: never grown; too low: grown to the same size
        dd, uniq = compact_steps(keys, offsets, hint)
        want, want_uniq = compact_steps(keys, offsets)
        assert np.array_equal(uniq, want_uniq) and np.array_equal(uniq, distinct)
        for name in ("keys", "offsets", "inverse"):
            assert np.array_equal(getattr(dd, name), getattr(want, name)), name


def test_a_deduper_carries_its_marks_from_call_to_call():
    ids = np.array([3, 1, 3, 1, 2, 2, 0, 3], dtype=np.int64)
    offsets = np.array([0, 3, 3, 6, 8])
    whole = dedup_steps(ids, offsets, 4)
    deduper = StepDeduper(4)
    parts = [deduper.dedup(ids[offsets[s]:offsets[s + 1]], [0, offsets[s + 1] - offsets[s]]) for s in range(4)]
    assert np.concatenate([p.keys for p in parts]).tolist() == whole.keys.tolist() == [3, 1, 1, 2, 0, 3]


def test_the_prompt_view_never_addresses_a_last_output_token_as_serving_never_feeds_it_back():
    """A request of P prompt and K output tokens runs P prefill positions and K - 1 decodes (the
    K-th token is sampled from the last and the request ends): the prompt view addressed one
    decode more per request than the scheduler's view, ``trace info`` and the serving replay."""
    from cachelab.engram import Addresser
    from cachelab.workload.steps import scheduled_stream

    addresser = Addresser("deepseek-v4.1-flash")
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, 128_000, int(n)) for n in (40, 33, 20, 50)]
    prompts = [30, 33, 19, 7]  # outputs of 10, 0, 1 and 43 tokens
    alone = LookupStream.from_sequences(addresser, seqs, tokens_per_step=8, prompt_lengths=prompts)
    batched = scheduled_stream(addresser, seqs, prompts, prefix_cache="off")

    def positions(stream):
        m = stream.meta
        return sorted({(int(r), int(p)) for r, p in zip(m["request"], m["position"])})

    fed = [max(len(s) - 1, p) for s, p in zip(seqs, prompts)]  # every token but an output's last
    assert positions(alone) == positions(batched) == [(r, p) for r, n in enumerate(fed) for p in range(n)]
    assert alone.num_lookups == sum(fed) * 48
    assert alone.num_steps == sum(-(-p // 8) + n - p for p, n in zip(prompts, fed))


def test_a_stream_without_metadata_has_the_same_keys_and_steps(tmp_path, monkeypatch):
    """A replay reads keys and steps alone, so ``simulate`` and ``mrc`` build streams without the
    per-lookup metadata (16 of a lookup's 24 bytes): in both step views, and read from a saved
    stream, the keys and steps are those of the stream with it, and with it each lookup's token
    (given a chunk of lookups at a time) is its request's token at its position."""
    from cachelab.engram import Addresser
    from cachelab.learning.streams import load_trace, request_stream
    from cachelab.workload import lookups

    addresser = Addresser("deepseek-v4.1-flash")
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, 128_000, int(n)) for n in (40, 33, 20, 50)]
    prompts, outputs = [s[:p] for s, p in zip(seqs, (30, 33, 19, 7))], [s[p:] for s, p in zip(seqs, (30, 33, 19, 7))]
    for steps in ("prompts", "serving"):
        full = request_stream(prompts, outputs, ["a", "b", "a", "c"], steps=steps)
        bare = request_stream(prompts, outputs, ["a", "b", "a", "c"], steps=steps, meta=False)
        assert np.array_equal(bare.keys, full.keys) and np.array_equal(bare.step_offsets, full.step_offsets)
        assert bare.meta == {} and set(full.meta) == {"column", "request", "position", "phase", "domain", "token"}
        assert bare.layout == full.layout is not None
    monkeypatch.setattr(lookups, "CHUNK", 1000)  # several chunks, one ending inside a token's lookups
    m = request_stream(prompts, outputs, ["a", "b", "a", "c"]).meta
    want = addresser.compress(np.concatenate(seqs))[np.cumsum([0] + [len(s) for s in seqs[:-1]])[m["request"]]
                                                    + m["position"]]
    assert np.array_equal(m["token"], want) and m["token"].dtype == np.int32
    saved = full.save(tmp_path / "s.npz")
    assert load_trace(str(saved), 0, 0, "deepseek-v4.1-flash", tokens=False, meta=False).meta == {}
    assert set(LookupStream.load(saved).meta) == set(full.meta)


def test_a_long_stream_checks_its_steps_with_no_array_of_a_byte_a_step():
    """Rising step offsets were checked by one comparison of every step with the next, an array of
    a byte a step (a 10 M-key trace's 10 MB of fresh pages); the check now goes a slice at a time,
    and still finds a fall at a slice's edge."""
    import tracemalloc

    from cachelab.workload.lookups import COMPARED

    n = 1_000_000
    keys, offsets = np.zeros(n, np.int64), np.arange(n + 1, dtype=np.int64)
    tracemalloc.start()
    try:
        LookupStream(keys, offsets, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n // 8, peak
    for fall in (COMPARED - 1, COMPARED, COMPARED + 1, n - 1):
        bad = offsets.copy()
        bad[fall] += 2  # above the next offset
        with pytest.raises(CachelabError, match="step_offsets must rise"):
            LookupStream(keys, bad, 1)


def test_the_ids_ranks_stand_for_cover_every_key_and_are_uint64(tmp_path):
    """``ids`` (a key trace of hashed ids past int64: the id each rank stands for) gives a policy that
    hashes row ids each key's id as its 64 bits; one too few, or ids of another type, are refused."""
    ids = np.array([2**63 + 9, 2**64 - 1, 3], dtype=np.uint64)
    stream = LookupStream.from_keys([2, 0, 1, 0], ids=ids)
    assert stream.raw_keys(np.array([0, 2])).tolist() == [-(2**63) + 9, 3]
    assert LookupStream.from_keys([2, 0]).raw_keys(np.array([2, 0])).tolist() == [2, 0]
    for bad in (ids[:2], ids.astype(np.int64), ids.reshape(1, 3)):
        with pytest.raises(CachelabError, match=r"ids must be a uint64 id for each key 0\.\.2"):
            LookupStream.from_keys([2, 0, 1, 0], ids=bad)
    path = stream.save(tmp_path / "s.npz")
    np.savez(path, **{**dict(np.load(path)), "ids": ids[:1]})
    with pytest.raises(CachelabError, match=r"s.npz: ids must be a uint64 id for each key"):
        LookupStream.load(path)
