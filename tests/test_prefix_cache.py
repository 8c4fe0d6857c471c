"""Prefix caches: hand-computed hits, eviction order, and Mooncake's published LRU behaviour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cachelab.workload.prefix_cache import (BlockPrefixCache, RadixPrefixCache, block_hashes, replay_sequential,
                                            sequential_hits)
from cachelab.workload.prefix_cache.hashing import chained_block_hashes, continue_chain


def _start(cache, rid, tokens, num_prompt=None):
    key = cache.prefix_key(np.asarray(tokens))
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    cached = cache.match(key, num_prompt)
    cache.admit(rid, key, num_prompt, cached)
    cache.record_query(num_prompt, cached)
    return cached


def test_block_hashes_chain_the_prefix():
    a = block_hashes(np.arange(10), 4)
    b = block_hashes(np.r_[np.arange(4), 99, np.arange(5, 10)], 4)
    assert a.size == 2 and a[0] == b[0] and a[1] != b[1]  # block 1 differs, so its chain does
    c = block_hashes(np.r_[99, np.arange(1, 10)], 4)
    assert c[1] != a[1]  # same block content, different prefix


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2 ** 31 - 1), max_size=200), st.integers(1, 20), st.lists(st.integers(0, 200)))
def test_a_chain_continued_block_by_block_is_the_full_recomputation(tokens, block, cuts):
    """The live engine hashes an answer's blocks as they fill, each chained on the hash before it:
    the chain must be bit-identical to hashing the whole sequence again (the prefix cache's keys
    and vLLM-style KV events both carry these hashes)."""
    tokens = np.asarray(tokens, np.int64)
    full = block_hashes(tokens, block)
    hashes = np.empty(0, np.int64)
    for end in sorted({min(c, tokens.size) for c in cuts} | {tokens.size}):
        more = np.empty(end // block - hashes.size, np.int64)
        continue_chain(tokens[:end], hashes, block, more)
        hashes = np.concatenate([hashes, more])
    assert np.array_equal(hashes, full)
    assert np.array_equal(full, chained_block_hashes(tokens, np.array([0, tokens.size]), block)[0][: full.size])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2 ** 31 - 1), max_size=200), st.integers(1, 20), st.lists(st.integers(0, 200)))
def test_a_key_grown_from_a_known_prefix_key_is_the_full_recomputation(tokens, block, cuts):
    """A request's key is kept across its admission tries and grown by its new blocks alone
    (``prefix_key(tokens, known)``): bit-identical to hashing all its tokens again, shorter
    token runs than the key included."""
    tokens = np.asarray(tokens, np.int64)
    cache = BlockPrefixCache(num_blocks=4, block_size=block)
    key = None
    for end in [min(c, tokens.size) for c in cuts] + [tokens.size]:
        key = cache.prefix_key(tokens[:end], key)
        assert np.array_equal(key, block_hashes(tokens[:end], block))
        key = key if key.size else None


def test_continue_chain_refuses_room_that_is_not_the_new_blocks():
    with pytest.raises(ValueError, match="out holds 2 hashes; 9 tokens have 2 full blocks of 4, 1 of them"):
        continue_chain(np.arange(9), block_hashes(np.arange(4), 4), 4, np.empty(2, np.int64))


def test_a_live_requests_key_grows_one_block_at_a_time_to_its_full_hashes():
    """extend_key, fed a request's tokens one more at a time as the engine feeds them, ends with the
    hashes of the whole sequence, and publishes its output blocks under them as they fill."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 130_000, 300)
    cache = BlockPrefixCache(num_blocks=64, block_size=8)
    assert _start(cache, 0, tokens[:21]) == 0
    for n in range(21, tokens.size + 1):
        assert cache.extend(0, n)
        cache.extend_key(0, tokens[:n])
    assert np.array_equal(cache._req[0][3], cache.prefix_key(tokens))
    cache.free(0)
    assert _start(cache, 1, tokens) == (tokens.size - 1) // 8 * 8  # the answer's blocks were cached


def test_vllm_hits_free_queue_order_and_eviction():
    cache = BlockPrefixCache(num_blocks=4, block_size=4)
    a = list(range(1, 11))
    assert _start(cache, 0, a) == 0 and cache.extend(0, 10)  # takes blocks 0, 1, 2
    cache.free(0)  # tail first; the partial block 2 holds no hash, so it goes to the head: 2 | 3 | 1, 0
    assert cache._prev[0] == 1 and cache._meta[0] == 2 and cache._meta[1] == 0
    b = a[:8] + [99, 100]
    assert _start(cache, 1, b) == 8  # blocks 0 and 1 reused
    assert cache.extend(1, 10) and cache.num_free_tokens == 4  # took block 2 (the head); block 3 left
    assert _start(cache, 2, list(range(200, 212))) == 0
    assert not cache.extend(2, 12)  # three blocks needed, one free
    cache.free(1)  # queue: 2 (partial, to the head), 3, 1, 0
    assert cache.extend(2, 12) and cache.evictions == 1  # blocks 2, 3, 1: block 1's hash goes
    cache.free(2)
    assert _start(cache, 3, a) == 4  # only a's first block is still cached
    assert cache.hit_ratio == pytest.approx(12 / 42)


def test_vllm_keeps_a_hash_while_any_copy_of_its_block_lives():
    """vLLM does not deduplicate blocks: a repeated 64-token prompt recomputes its last block
    (past the hit limit) into a second block under the same hash. Evicting the first copy
    leaves the second one hit. Hits as vLLM 0.32's KVCacheManager gives them, driven the same
    way (8 usable blocks)."""
    a, c = np.arange(64), np.arange(1000, 1064)
    prompts = [a, a, c, np.arange(80)]
    cache = BlockPrefixCache(8, 16)
    assert sequential_hits(cache, [block_hashes(p, 16) for p in prompts], [p.size for p in prompts]).tolist() == [
        0, 48, 0, 64]  # c took a's first copy of block 3; its second copy is still cached
    assert cache.num_cached_tokens == 8 * 16  # the copy counts: it holds KV


def test_vllm_a_refused_admission_leaves_the_lru_order_alone():
    """A waiting request that does not fit takes nothing, its cached prefix included: vLLM's
    allocate_slots checks the room before it touches a block. Hits as vLLM 0.32's
    KVCacheManager gives them (8 usable blocks of 16)."""
    cache = BlockPrefixCache(8, 16)

    def run(rid, tokens, keep=False):
        key = block_hashes(tokens, 16)
        hit = cache.match(key, tokens.size)
        cache.admit(rid, key, tokens.size, hit)
        if not cache.extend(rid, tokens.size):
            cache.preempt(rid)
            return None
        if not keep:
            cache.free(rid)
        return hit

    x, y = np.arange(32), np.arange(500, 532)
    assert [run(0, x), run(1, y), run(2, np.arange(2000, 2048), keep=True)] == [0, 0, 0]  # 3 blocks held
    assert run(3, np.r_[x, np.arange(3000, 3064)]) is None  # x's 2 blocks + 4 new > 5 free: refused
    # x is still the least recently freed: the next 3 blocks evict it (before, the refused
    # admission had moved x's blocks to the tail, and y went instead)
    assert run(4, np.arange(4000, 4048)) == 0
    assert [run(5, np.r_[x, np.arange(32, 48)]), run(6, np.r_[y, np.arange(532, 548)])] == [0, 0]


def test_vllm_recomputes_the_last_prompt_token():
    cache = BlockPrefixCache(num_blocks=8, block_size=4)
    replay_sequential(cache, [cache.prefix_key(np.arange(8))], [8])
    assert cache.match(cache.prefix_key(np.arange(8)), 8) == 4  # not 8: one token must run
    assert cache.match(cache.prefix_key(np.arange(9)), 9) == 8


def test_vllm_caching_off_never_hits():
    cache = BlockPrefixCache(num_blocks=8, block_size=4, enable_caching=False)
    prompt = np.arange(12)
    assert replay_sequential(cache, [cache.prefix_key(prompt)] * 3, [12] * 3) == 0.0
    # and queries nothing: vLLM skips the lookup and its stats, so vllm:prefix_cache_queries stays 0
    assert cache.queried_tokens == cache.hit_tokens == 0


def _lru_blocks_reference(hash_lists, lengths, block_size, capacity_blocks):
    """An OrderedDict of blocks freed tail first, as vLLM documents; a partial block is a
    block too: it takes a slot while its request runs, holds no hash, and once freed goes to
    the front (it is reused first) but keeps its slot until a later request takes it."""
    lru, hit, total = OrderedDict(), 0, 0
    for i, (hashes, n) in enumerate(zip(hash_lists, lengths)):
        full = hashes[: n // block_size] + ([("partial", i)] if n % block_size else [])
        k = 0
        while k < min(len(full), (n - 1) // block_size) and full[k] in lru:
            k += 1
        hit, total = hit + k * block_size, total + n
        for h in reversed(full):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
        if n % block_size:
            lru.move_to_end(("partial", i), last=False)
    return hit / total


def test_vllm_agrees_with_an_ordered_dict_lru():
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 50, 64) for _ in range(6)]
    prompts = [np.r_[docs[rng.integers(6)][: rng.integers(8, 64)], rng.integers(0, 50, rng.integers(1, 20))]
               for _ in range(300)]
    hashes = [block_hashes(p, 8) for p in prompts]
    lengths = [p.size for p in prompts]
    for cap in (11, 16, 40):  # every prompt (at most 83 tokens) fits in 11 blocks
        ours = replay_sequential(BlockPrefixCache(cap, 8), hashes, lengths)
        assert ours == pytest.approx(_lru_blocks_reference([h.tolist() for h in hashes], lengths, 8, cap))


def test_sglang_split_lock_and_leaf_lru():
    cache = RadixPrefixCache(capacity_tokens=10)
    assert _start(cache, 0, [1, 2, 3, 4, 5]) == 0 and cache.extend(0, 5)
    cache.free(0)
    assert _start(cache, 1, [1, 2, 3, 9, 9]) == 3  # splits [1..5] into [1,2,3] + [4,5]
    assert sorted(cache.root.children[1].children) == [4]
    assert cache.extend(1, 5) and cache.num_free_tokens == 3
    assert _start(cache, 2, [7] * 6) == 0
    assert not cache.extend(2, 6)  # 3 free + leaf [4,5] (the locked [1,2,3] is not evictable) < 6
    assert cache.num_free_tokens == 3 and cache.tree_tokens == 5  # refused: nothing evicted
    cache.free(1)  # inserts [9,9] under [1,2,3]
    assert cache.tree_tokens == 7 and cache.evictable_tokens == 7
    assert cache.extend(2, 6) and cache.tree_tokens == 3  # leaves [4,5], then [9,9] went; [1,2,3] is kept
    assert cache.hit_ratio == pytest.approx(3 / 16)


def test_sglang_refuses_what_cannot_fit_without_evicting_the_tree():
    """SGLang admits a request against available + evictable tokens (PrefillAdder) and evicts only
    for an allocation that fits: a refused one left the tree empty, so the request after it,
    sharing the evicted prefix, missed it (here 30 tokens)."""
    cache = RadixPrefixCache(capacity_tokens=100)
    shared = np.arange(30)
    assert _start(cache, 0, shared) == 0 and cache.extend(0, 30)
    cache.free(0)  # 30 tokens cached, unlocked
    assert _start(cache, 1, np.arange(100, 160)) == 0 and cache.extend(1, 60)  # 10 free
    assert _start(cache, 2, np.arange(200, 250)) == 0
    assert not cache.extend(2, 50)  # 10 free + 30 evictable < 50
    cache.preempt(2)
    assert cache.tree_tokens == 30 and cache.evicted_tokens == 0
    assert _start(cache, 3, np.r_[shared, 7]) == 30  # the whole shared prefix, as SGLang keeps it


def test_sglang_unbounded_equals_longest_earlier_prefix():
    rng = np.random.default_rng(5)
    base = rng.integers(0, 5, 40)
    prompts = [np.r_[base[: rng.integers(0, 40)], rng.integers(0, 5, rng.integers(1, 10))] for _ in range(80)]
    expected_hit = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            m = min(q.size, p.size - 1)
            d = np.flatnonzero(q[:m] != p[:m])
            best = max(best, int(d[0]) if d.size else m)
        expected_hit += best
    cache = RadixPrefixCache(capacity_tokens=10**6)
    ratio = replay_sequential(cache, [cache.prefix_key(p) for p in prompts], [p.size for p in prompts])
    assert ratio == pytest.approx(expected_hit / sum(p.size for p in prompts))


@pytest.mark.data
def test_vllm_reproduces_mooncake_lru(data_dir):
    path = data_dir / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"
    rows = [json.loads(line) for line in path.open()]
    hashes = [np.asarray(r["hash_ids"], dtype=np.int64) for r in rows]
    lengths = [r["input_length"] for r in rows]
    ratios = {cap: replay_sequential(BlockPrefixCache(cap // 512, 512), hashes, lengths)
              for cap in (3_000_000, 30_000_000, 300_000_000)}
    assert ratios[3_000_000] == pytest.approx(0.14, abs=0.01)  # Mooncake (FAST'25): about 14%
    assert ratios[30_000_000] > 0.35 and ratios[300_000_000] == pytest.approx(0.366, abs=0.01)


def test_a_new_pool_compiles_no_table_constructor_once_numba_has_cached_it():
    """The pool's hash table was made by numba's ``Dict.empty`` called from Python, whose
    constructor numba compiles in every new process and never caches: ~1.2 s of each `cachelab
    serve` start (and of every process that made a pool). A fresh process now loads it from the cache."""
    code = ("from numba.typed import typeddict\n"
            "from cachelab.workload.prefix_cache import BlockPrefixCache\n"
            "BlockPrefixCache(8)\n"
            "print(len(typeddict._make_dict.signatures))")  # numba's constructor, compiled from Python
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(2):  # the first process may be the one that writes numba's cache
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0"], out.stdout
