"""SGLang-style prefix caching: RadixAttention's token radix tree with leaf-only LRU eviction.

As SGLang's ``RadixCache`` does it (python/sglang/srt/mem_cache/radix_cache.py):

- Edges hold token sequences; children are keyed by their first token. A lookup or an
  insert that stops inside an edge splits it, so every shared prefix becomes a node.
- A running request locks the path of its matched prefix (reference counts up to the root);
  only unlocked leaves are evicted, least recently used first, and a parent whose last child
  went becomes a leaf in turn.
- A finished request inserts its tokens; the part already in the tree is freed as duplicate.
- A request whose tokens do not fit in the free and the evictable (unlocked) tokens together
  is refused without evicting anything (SGLang's ``PrefillAdder`` budget is ``available_size()
  + evictable_size()``; eviction frees only what an allocation that fits needs).

KV memory is ``capacity_tokens`` token slots shared by the tree and the running requests'
private (not yet inserted) tokens. Hit rate is SGLang's: cached / (new + cached) tokens of
a prefill batch, where a request's matched prefix counts as cached once (its later chunks
count as new only); summed over all batches here.

Python per request and per tree node, never per token: edge comparisons are NumPy.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from cachelab.errors import CachelabError


class _Node:
    __slots__ = ("key", "children", "parent", "lock", "last_access")

    def __init__(self, key: np.ndarray, parent: "_Node | None", now: int):
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.lock = 0
        self.last_access = now


def _common(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class RadixPrefixCache:
    """A token radix tree over a pool of ``capacity_tokens`` KV slots."""

    kind = "sglang"

    def __init__(self, capacity_tokens: int, enable_caching: bool = True):
        if capacity_tokens < 1:
            raise CachelabError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        self.capacity_tokens = int(capacity_tokens)
        self.enable_caching = enable_caching
        self.block_size = 1
        self._clock = itertools.count(1)
        self._tie = itertools.count()
        self.root = _Node(np.empty(0, np.int32), None, 0)
        self.root.lock = 1  # the root is never evicted
        self._heap: list[tuple[int, int, _Node]] = []
        self.tree_tokens = 0
        self.private_tokens = 0
        self.evicted_tokens = 0
        self.evictable_tokens = 0  # tokens of unlocked nodes (SGLang's ``evictable_size``)
        self._req: dict[int, tuple[np.ndarray, _Node, int, int]] = {}  # tokens, node, cached, held
        self.new_tokens = 0
        self.cached_tokens = 0

    # -- tree primitives -------------------------------------------------------------------
    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; the new middle node is returned."""
        mid = _Node(child.key[:at], child.parent, child.last_access)
        mid.lock = child.lock
        mid.children[int(child.key[at])] = child
        child.parent.children[int(child.key[0])] = mid
        child.key = child.key[at:]
        child.parent = mid
        return mid

    def _walk(self, tokens: np.ndarray, now: int) -> tuple[_Node, int]:
        node, pos = self.root, 0
        while pos < tokens.size:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            n = _common(child.key, tokens[pos:])
            child.last_access = now
            if n < child.key.size:
                node = self._split(child, n)
                pos += n
                break
            node, pos = child, pos + n
        return node, pos

    def _lock(self, node: _Node, delta: int) -> None:
        while node is not None:
            if node.lock == 0:  # locked now: no longer evictable (the root's key is empty)
                self.evictable_tokens -= node.key.size
            node.lock += delta
            if node.lock == 0:
                self.evictable_tokens += node.key.size
                if not node.children:
                    heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
            node = node.parent

    def _insert(self, tokens: np.ndarray) -> int:
        """Insert ``tokens``; return how many were already in the tree."""
        now = next(self._clock)
        node, pos = self._walk(tokens, now)
        if pos < tokens.size:
            leaf = _Node(tokens[pos:].copy(), node, now)
            node.children[int(tokens[pos])] = leaf
            self.tree_tokens += leaf.key.size
            self.evictable_tokens += leaf.key.size
            heapq.heappush(self._heap, (now, next(self._tie), leaf))
        return pos

    def _evict(self, num_tokens: int) -> None:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are free."""
        freed = 0
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node.children or node.lock or node.parent is None:
                continue  # no longer an evictable leaf
            if stamp != node.last_access:  # touched since pushed: requeue at its new time
                heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
                continue
            parent = node.parent
            del parent.children[int(node.key[0])]
            node.parent = None
            freed += node.key.size
            self.tree_tokens -= node.key.size
            self.evictable_tokens -= node.key.size
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(self._heap, (parent.last_access, next(self._tie), parent))
        self.evicted_tokens += freed

    # -- the KV-manager protocol ----------------------------------------------------------
    @property
    def num_free_tokens(self) -> int:
        return self.capacity_tokens - self.tree_tokens - self.private_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.tree_tokens

    @property
    def hit_ratio(self) -> float:
        """SGLang's cache hit rate: cached / (new + cached) prefill tokens."""
        total = self.new_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0

    def reset_counts(self) -> None:
        """Count hits afresh from here, the tree kept (a measured run after a warm-up)."""
        self.new_tokens = self.cached_tokens = 0

    def prefix_key(self, tokens: np.ndarray, known: np.ndarray | None = None) -> np.ndarray:
        """What ``match`` and ``admit`` take: the tokens themselves (nothing hashed, so ``known``,
        the key of a prefix, saves nothing)."""
        return np.asarray(tokens, dtype=np.int32)

    def match(self, tokens: np.ndarray, num_prompt: int) -> int:
        """Cached prompt tokens (SGLang recomputes at least the last prompt token too)."""
        if not self.enable_caching:
            return 0
        _, n = self._walk(np.asarray(tokens[: max(num_prompt - 1, 0)]), next(self._clock))
        return n

    def admit(self, rid: int, tokens: np.ndarray, num_prompt: int, num_cached: int) -> None:
        """Start ``rid``, locking the path of its ``num_cached`` cached tokens."""
        if rid in self._req:
            raise CachelabError(f"request {rid} is already admitted")
        node, n = self._walk(np.asarray(tokens[:num_cached]), next(self._clock))
        if n != num_cached:
            raise CachelabError(f"request {rid}: {num_cached} cached tokens claimed, {n} in the tree")
        self._lock(node, 1)
        self._req[rid] = (np.asarray(tokens), node, num_cached, num_cached)

    def record_query(self, num_prompt: int, num_cached: int, preempted: bool = False) -> None:
        """Count one admitted request's new and cached prefill tokens (SGLang's terms: a
        retracted request's new prefill counts again, ``preempted`` or not)."""
        self.new_tokens += num_prompt - num_cached
        self.cached_tokens += num_cached

    def fits(self, rid: int, num_tokens: int) -> bool:
        """Always: SGLang's own admission (its ``PrefillAdder`` budget of input and expected
        output tokens) is not modelled; a request starts when its first chunk fits."""
        return True

    def extend(self, rid: int, num_tokens: int) -> bool:
        tokens, node, cached, held = self._req[rid]
        need = num_tokens - held
        if need <= 0:
            return True
        if need > self.num_free_tokens:
            if need > self.num_free_tokens + self.evictable_tokens:
                return False  # refused as SGLang refuses it: the cached prefixes stay
            self._evict(need - self.num_free_tokens)
        self.private_tokens += need
        self._req[rid] = (tokens, node, cached, num_tokens)
        return True

    def free(self, rid: int) -> None:
        """Finish ``rid``: insert its computed tokens into the tree, unlock its prefix."""
        tokens, node, cached, held = self._req.pop(rid)
        self.private_tokens -= held - cached
        if self.enable_caching:
            self._insert(tokens[:held])
        self._lock(node, -1)

    def preempt(self, rid: int) -> None:
        """Retract ``rid``: its private tokens are dropped, not cached; its prefix is unlocked."""
        tokens, node, cached, held = self._req.pop(rid)
        self.private_tokens -= held - cached
        self._lock(node, -1)
