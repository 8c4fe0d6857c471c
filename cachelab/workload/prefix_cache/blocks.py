"""vLLM-style prefix caching: a pool of KV blocks, hash-chained full blocks, an LRU free queue.

As vLLM v1's KV-cache manager does it (vllm/v1/core/block_pool.py, kv_cache_manager.py):

- KV memory is ``num_blocks`` blocks of ``block_size`` tokens. A request holds one block per
  ``block_size`` tokens it has computed (or is about to compute).
- A full block is cached under the chained hash of its prefix (``block_hashes``);
  a later request whose prompt starts with the same blocks reuses them ("computed blocks").
  At least one prompt token is always recomputed, so a hit covers at most
  ``(num_prompt - 1) // block_size`` blocks.
- A block whose reference count drops to zero goes to the *tail* of the free queue but
  stays cached; new blocks are taken from the *head*, evicting the cached hash they held.
  A request frees its blocks tail first, so the end of its chain is evicted before its start.
  A freed block that holds no hash (a partial block, or one never filled) can never be hit,
  so it goes to the *head* instead, to be reused first (vLLM 0.32 ``BlockPool.free_blocks``:
  ``prepend_n`` for blocks without a hash, ``append_n`` for the rest).
- Blocks are not deduplicated: a prefix computed again (its last block past the hit limit,
  say) is published under the same hash by a second block, and a hit takes the first of them
  still cached, so evicting one copy leaves the hash cached while another copy lives
  (``BlockHashToBlockMap``: a hash maps to every block that holds it, in insertion order).

Hit rate is vLLM's: cached tokens / queried (prompt) tokens, counted once per admission.

    free queue:  head -> [least recently freed] ... [most recently freed] <- tail
                 take() pops the head            free() appends at the tail
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.typed import Dict

from cachelab.errors import CachelabError
from cachelab.workload.prefix_cache.hashing import chained_block_hashes, continue_chain

HEAD, TAIL, NUM_FREE, EVICTIONS, NUM_CACHED = 0, 1, 2, 3, 4


@nb.njit(cache=True)
def _new_table():
    """An empty hash -> block table. Made here, not by ``Dict.empty`` from Python, whose
    constructor numba compiles anew in every process (~1.2 s of each `cachelab serve` start)."""
    return Dict.empty(key_type=types.int64, value_type=types.int64)


@nb.njit(cache=True, nogil=True)
def _match(table, hashes, limit):
    n = 0
    while n < limit and hashes[n] in table:
        n += 1
    return n


@nb.njit(cache=True, nogil=True)
def _unlink(b, prev, nxt, meta):
    p, q = prev[b], nxt[b]
    if p >= 0:
        nxt[p] = q
    else:
        meta[HEAD] = q
    if q >= 0:
        prev[q] = p
    else:
        meta[TAIL] = p
    prev[b] = -1
    nxt[b] = -1
    meta[NUM_FREE] -= 1


@nb.njit(cache=True, nogil=True)
def _evictable(table, hashes, n, ref):
    """How many of the cached blocks of ``hashes[:n]`` sit in the free queue (a touch takes them out)."""
    k = 0
    for i in range(n):
        if ref[table[hashes[i]]] == 0:
            k += 1
    return k


@nb.njit(cache=True, nogil=True)
def _touch(table, hashes, n, ref, prev, nxt, meta, out):
    """Reuse the cached blocks of ``hashes[:n]``: out of the free queue, one more reference."""
    for i in range(n):
        b = table[hashes[i]]
        if ref[b] == 0:
            _unlink(b, prev, nxt, meta)
        ref[b] += 1
        out[i] = b


@nb.njit(cache=True, nogil=True)
def _take(n, ref, prev, nxt, meta, block_hash, cached, dup_prev, dup_next, table, out):
    """Pop ``n`` blocks from the free queue's head, evicting the hashes they held."""
    for i in range(n):
        b = meta[HEAD]
        _unlink(b, prev, nxt, meta)
        if cached[b]:
            p, q = dup_prev[b], dup_next[b]
            if p >= 0:
                dup_next[p] = q
            elif q >= 0:
                table[block_hash[b]] = q  # the next copy now answers for the hash
            else:
                table.pop(block_hash[b])
            if q >= 0:
                dup_prev[q] = p
            dup_prev[b] = -1
            dup_next[b] = -1
            cached[b] = False
            meta[EVICTIONS] += 1
            meta[NUM_CACHED] -= 1
        ref[b] = 1
        out[i] = b


@nb.njit(cache=True, nogil=True)
def _cache(blocks, hashes, block_hash, cached, dup_prev, dup_next, table, meta):
    """Publish newly full blocks; a block whose hash is cached already joins the end of that
    hash's list of copies (``table`` maps a hash to its first copy)."""
    for i in range(blocks.size):
        b, h = blocks[i], hashes[i]
        block_hash[b] = h
        cached[b] = True
        meta[NUM_CACHED] += 1
        if h in table:
            t = table[h]
            while dup_next[t] >= 0:
                t = dup_next[t]
            dup_next[t] = b
            dup_prev[b] = t
        else:
            table[h] = b


@nb.njit(cache=True, nogil=True)
def _free(blocks, ref, prev, nxt, meta, cached):
    """Drop one reference per block, in the order given; unreferenced blocks with a hash join
    the tail in that order, those without one the head (the first given ends up first)."""
    first = np.empty(blocks.size, np.int64)
    n_first = 0
    for i in range(blocks.size):
        b = blocks[i]
        ref[b] -= 1
        if ref[b] == 0:
            meta[NUM_FREE] += 1
            if not cached[b]:
                first[n_first] = b
                n_first += 1
                continue
            t = meta[TAIL]
            prev[b] = t
            nxt[b] = -1
            if t >= 0:
                nxt[t] = b
            else:
                meta[HEAD] = b
            meta[TAIL] = b
    for i in range(n_first - 1, -1, -1):
        b = first[i]
        h = meta[HEAD]
        prev[b] = -1
        nxt[b] = h
        if h >= 0:
            prev[h] = b
        else:
            meta[TAIL] = b
        meta[HEAD] = b


def block_hashes(tokens, block_size: int) -> np.ndarray:
    """Chained hashes of the full blocks of one sequence (a partial tail block has none)."""
    toks = np.asarray(tokens)
    hashes, _ = chained_block_hashes(toks, np.array([0, toks.size]), block_size)
    return hashes[: toks.size // block_size]


class BlockPrefixCache:
    """A vLLM-style KV block pool with (optional) prefix caching.

    Per request: ``match`` (how many prompt tokens are cached), ``admit`` (take those blocks),
    ``extend`` (room for more computed tokens; False when out of blocks), ``free``.

    Args:
        num_blocks: KV blocks in the pool.
        block_size: tokens per block (vLLM's default is 16).
        enable_caching: False gives the same pool with no reuse (the prefix cache off).
    """

    kind = "vllm"

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise CachelabError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_caching = enable_caching
        n = self.num_blocks
        self._ref = np.zeros(n, np.int32)
        self._prev = np.arange(-1, n - 1, dtype=np.int64)
        self._nxt = np.arange(1, n + 1, dtype=np.int64)
        self._nxt[-1] = -1
        self._meta = np.array([0, n - 1, n, 0, 0], dtype=np.int64)
        self._block_hash = np.zeros(n, np.int64)
        self._cached = np.zeros(n, np.bool_)  # the block holds a published hash
        self._dup_prev = np.full(n, -1, np.int64)  # the copies of one hash, in publication order
        self._dup_next = np.full(n, -1, np.int64)
        self._table = _new_table()
        self._req: dict[int, list] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_tokens(self) -> int:
        """Tokens that can still be allocated (free blocks, cached or not)."""
        return int(self._meta[NUM_FREE]) * self.block_size

    @property
    def num_cached_tokens(self) -> int:
        """Tokens in blocks published in the prefix cache (the cache's footprint; a prefix
        computed twice holds two blocks)."""
        return int(self._meta[NUM_CACHED]) * self.block_size

    @property
    def evictions(self) -> int:
        return int(self._meta[EVICTIONS])

    @property
    def hit_ratio(self) -> float:
        """vLLM's prefix-cache hit rate: cached tokens / queried tokens."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def reset_counts(self) -> None:
        """Count hits afresh from here, the cached blocks kept (a measured run after a warm-up)."""
        self.queried_tokens = self.hit_tokens = 0

    def prefix_key(self, tokens: np.ndarray, known: np.ndarray | None = None) -> np.ndarray:
        """What ``match`` and ``admit`` take: the chained hashes of the full blocks. ``known``, this
        key of a prefix of ``tokens`` (a request's at its last admission try), is kept and only the
        blocks after it are hashed, chained on its last (bit-identical): a request that waited for
        room or was preempted is not hashed again, as vLLM keeps a request's ``block_hashes``."""
        if known is None or known.size == 0:
            return block_hashes(tokens, self.block_size)
        toks = np.asarray(tokens)
        n = toks.size // self.block_size
        if n <= known.size:
            return known[:n]
        key = np.empty(n, np.int64)
        key[: known.size] = known
        continue_chain(toks, known, self.block_size, key[known.size:])
        return key

    def match(self, hashes: np.ndarray, num_prompt: int) -> int:
        """Cached prompt tokens: the longest run of leading blocks in the cache (no state change)."""
        if not self.enable_caching:
            return 0
        limit = min(hashes.size, max(num_prompt - 1, 0) // self.block_size)
        return _match(self._table, hashes, limit) * self.block_size

    def admit(self, rid: int, hashes: np.ndarray, num_prompt: int, num_cached: int) -> None:
        """Start request ``rid`` with ``num_cached`` tokens served from the cache (from ``match``);
        their blocks are taken by the first ``extend``, with the new ones or not at all.

        Args:
            hashes: int64 chained hashes of every full block of the request's tokens (all the
                tokens it will compute, so its output blocks are published as they fill).
        """
        if rid in self._req:
            raise CachelabError(f"request {rid} is already admitted")
        n = num_cached // self.block_size
        blocks = np.empty(hashes.size + 1, np.int64)  # room for every full block and a partial one
        # block table, blocks held, blocks published, hashes, cached blocks the first extend takes,
        # room extend_key grows the hashes in
        self._req[rid] = [blocks, 0, n, hashes, n, None]

    def record_query(self, num_prompt: int, num_cached: int, preempted: bool = False) -> None:
        """Count one admitted request's prompt and cached tokens (vLLM's hit-rate terms); a
        preempted request's return is not counted (vLLM's ``PrefixCacheStats.record``), nor any
        request with caching off (vLLM skips the lookup and its stats: its queries counter stays 0)."""
        if preempted or not self.enable_caching:
            return
        self.queried_tokens += num_prompt
        self.hit_tokens += num_cached

    def extend(self, rid: int, num_tokens: int) -> bool:
        """Hold blocks for the first ``num_tokens`` tokens of ``rid``; False if the pool is short.

        The first call after ``admit`` takes the cached blocks too, and only if everything
        fits (vLLM's ``allocate_slots``): a refused admission leaves the free queue's order
        as it was, so a request waiting for room does not keep its prefix fresh."""
        state = self._req[rid]
        blocks, held, published, hashes, hit = state[:5]
        need = -(-num_tokens // self.block_size) - held - hit
        if hit:
            if max(need, 0) + _evictable(self._table, hashes, hit, self._ref) > self._meta[NUM_FREE]:
                return False
            _touch(self._table, hashes, hit, self._ref, self._prev, self._nxt, self._meta, blocks)
            held = state[1] = hit
            state[4] = 0
        if need > 0:
            if need > self._meta[NUM_FREE]:
                return False
            if held + need > blocks.size:
                blocks = state[0] = np.resize(blocks, held + need)
            _take(need, self._ref, self._prev, self._nxt, self._meta, self._block_hash, self._cached,
                  self._dup_prev, self._dup_next, self._table, blocks[held:held + need])
            state[1] = held + need
        if self.enable_caching:
            full = min(num_tokens // self.block_size, hashes.size)
            if full > published:
                _cache(blocks[published:full], hashes[published:full], self._block_hash, self._cached,
                       self._dup_prev, self._dup_next, self._table, self._meta)
                state[2] = full
        return True

    def fits(self, rid: int, num_tokens: int) -> bool:
        """Whether blocks for the first ``num_tokens`` tokens of ``rid`` could be held now, its
        cached prefix counted (vLLM's ``full_sequence_must_fit`` admission check); no change."""
        _, held, _, hashes, hit = self._req[rid][:5]
        need = max(-(-num_tokens // self.block_size) - held - hit, 0)
        if hit:
            need += _evictable(self._table, hashes, hit, self._ref)
        return need <= self._meta[NUM_FREE]

    def extend_key(self, rid: int, tokens: np.ndarray) -> np.ndarray:
        """Chain ``rid``'s key on to the full blocks of ``tokens`` (its tokens so far, which start
        with those its key hashes) and return it: a live request learns its tokens as it samples
        them, and its output blocks are then published as they fill, as vLLM caches them (a later
        turn reuses the answer's KV). Only the new blocks are hashed, into room that doubles
        (amortised O(1) a block)."""
        state = self._req[rid]
        hashes, room = state[3], state[5]
        n = tokens.size // self.block_size
        if n <= hashes.size:
            return hashes
        if room is None or room.size < n:
            room = state[5] = np.empty(max(n, 2 * hashes.size), np.int64)
            room[: hashes.size] = hashes
        continue_chain(tokens, hashes, self.block_size, room[hashes.size:n])
        state[3] = room[:n]
        return state[3]

    def block_table(self, rid: int) -> np.ndarray:
        """The KV blocks ``rid`` holds, in position order (block ``i`` holds its tokens
        ``i * block_size`` to ``(i + 1) * block_size - 1``): a paged KV cache's block table."""
        blocks, held = self._req[rid][:2]
        return blocks[:held]

    def free(self, rid: int) -> None:
        """Release ``rid``'s blocks, tail first; full ones stay cached until evicted."""
        blocks, held = self._req.pop(rid)[:2]
        _free(blocks[:held][::-1].copy(), self._ref, self._prev, self._nxt, self._meta, self._cached)

    preempt = free  # vLLM frees a preempted request's blocks the same way; it recomputes later
