"""The serving scheduler: which requests compute which token positions in each step.

vLLM v1's outline (vllm/v1/core/sched/scheduler.py): continuous batching with chunked
prefill under a token budget and a sequence cap per step; running requests first (a decode
token or their next prefill chunk), then waiting ones in arrival order while KV blocks last
(a waiting request starts only if the pool could hold all it knows, not just its first chunk:
vLLM 0.32's default ``scheduler_reserve_full_isl``); when a running request cannot grow, the
most recently admitted one is preempted (its KV
freed; it is recomputed later, as vLLM does). The KV pool is a prefix cache
(``cachelab.workload.prefix_cache``): cached prompt tokens are not computed.

The caller owns time and the model, so the same object serves a simulation and a live
engine: ``add`` a request when it arrives, ``schedule`` a step (a ``StepRecord``), run it,
then ``complete`` it (vLLM's ``schedule()`` / ``update_from_output()`` split). A replay
knows every token up front; a live engine passes the tokens it sampled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from cachelab.errors import CachelabError
from cachelab.workload.prefix_cache import BlockPrefixCache, RadixPrefixCache

PREFIX_CACHES = ("vllm", "sglang", "off")
# A scheduler's budget and cap where no GPU is named (a lookup stream of queued requests): H100's
# budget, the smaller GPUs' cap. A serving replay takes its GPU's (``vllm_batch_defaults``).
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256
GIB = 1 << 30


def vllm_batch_defaults(device_memory_bytes: float) -> tuple[int, int]:
    """vLLM 0.32's OpenAI-server ``max_num_batched_tokens`` and ``max_num_seqs`` for a GPU of this
    much memory (``EngineArgs.get_batch_defaults``): 16384 and 1024 from 160 GiB (B200, B300, GB200),
    8192 and 1024 from 70 GiB (H100, H200, GH200; vLLM also excludes A100 there, which no profile is),
    2048 and 256 below."""
    if device_memory_bytes >= 160 * GIB:
        return 16384, 1024
    if device_memory_bytes >= 70 * GIB:
        return 8192, 1024
    return 2048, 256


def kv_pool(kind: str, kv_tokens: int, block_size: int = 16):
    """The KV pool of ``kv_tokens`` tokens as prefix cache ``kind`` (one of PREFIX_CACHES) manages it."""
    if kind not in PREFIX_CACHES:
        raise CachelabError(f"prefix_cache must be one of {list(PREFIX_CACHES)}, got {kind!r}")
    if kind == "sglang":
        return RadixPrefixCache(kv_tokens)
    return BlockPrefixCache(kv_tokens // block_size, block_size, enable_caching=kind == "vllm")


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it; the counters are the scheduler's to move.

    Args:
        rid: the request's id (unique among the scheduler's requests).
        tokens: the token ids known so far: the prompt, then outputs (a replay knows them
            all; a live engine's grow as ``complete`` appends what it sampled).
        num_prompt: prompt tokens; max_output: output tokens after which it finishes.
    """

    rid: int
    tokens: np.ndarray
    num_prompt: int
    max_output: int
    num_computed: int = 0  # positions whose KV is computed
    num_output: int = 0  # tokens emitted
    preemptions: int = 0
    # the pool's prefix key of its tokens, kept across admission tries and preemptions and grown by
    # their new blocks alone (vLLM's ``Request.block_hashes``): a long prompt waiting for room was
    # hashed whole again at every step's try
    key: np.ndarray | None = field(default=None, repr=False, compare=False)
    # where ``complete`` appends sampled tokens: ``tokens`` is a view of its first ``num_known``, and
    # it doubles when full, so a request of L tokens costs O(L) copying (a copy per token was O(L^2))
    _room: np.ndarray | None = field(default=None, repr=False, compare=False)

    def append(self, token: int) -> None:
        """Add a sampled token after the ``num_known`` known ones (amortised O(1))."""
        n = self.num_known
        room = self._room
        if room is None or room.size <= n:
            room = self._room = np.empty(max(n + 1, min(2 * n, self.num_prompt + self.max_output)), np.int64)
            room[:n] = self.tokens[:n]
        room[n] = token
        self.tokens = room[: n + 1]

    @property
    def num_known(self) -> int:
        """Positions to compute before the next token: the prompt and every output fed back."""
        return self.num_prompt + self.num_output


@dataclass
class StepRecord:
    """One step: per scheduled request (running ones first, then those admitted), the
    positions ``starts[i]:stops[i]`` it computes; what ``complete`` did is filled in then."""

    index: int
    requests: np.ndarray  # int64 request ids
    starts: np.ndarray  # int64 first position computed
    stops: np.ndarray  # int64 one past the last position computed
    num_prompt: np.ndarray  # int64 prompt tokens (a position at or past it is a decode)
    cached: np.ndarray  # int64 prefix-cache hit tokens (0 unless admitted in this step)
    admitted: np.ndarray  # bool: admitted in this step (first time or after a preemption)
    preempted: tuple[int, ...] = ()  # requests preempted to make room in this step
    emitted: tuple[int, ...] = field(default=())  # requests that emitted a token (set by complete)
    finished: tuple[int, ...] = field(default=())  # requests that finished (set by complete)

    @property
    def num_tokens(self) -> int:
        return int((self.stops - self.starts).sum())

    @property
    def decodes(self) -> int:
        """Requests that compute one output position (a decode, not a prefill chunk)."""
        return int(((self.stops - self.starts == 1) & (self.starts >= self.num_prompt)).sum())

    def to_dict(self) -> dict:
        return {"index": self.index, "requests": self.requests.tolist(), "starts": self.starts.tolist(),
                "stops": self.stops.tolist(), "cached": self.cached.tolist(), "admitted": self.admitted.tolist(),
                "preempted": list(self.preempted), "emitted": list(self.emitted), "finished": list(self.finished),
                "tokens": self.num_tokens, "decodes": self.decodes}


class RequestQueue:
    """Requests in order, keyed by request id. The waiting ones in admission order (vLLM's FCFS
    queue: an arrival joins the back, a preempted request goes back to the front), and the running
    ones in admission order (a preemption takes the back one). Keyed, so an abort takes one out in
    O(1): a deque's ``remove`` scanned the queue, and aborting k of n queued requests (a client
    gone mid-burst) held the engine thread for O(n k), 4.5 s for 16,384 in random order; the
    running list's ``remove`` did the same over up to ``max_num_seqs`` running ones."""

    def __init__(self):
        self._queue: OrderedDict[int, Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue.values())

    def append(self, request: Request) -> None:
        self._queue[request.rid] = request

    def appendleft(self, request: Request) -> None:
        self._queue[request.rid] = request
        self._queue.move_to_end(request.rid, last=False)

    def peek(self) -> Request:
        return next(iter(self._queue.values()))

    def popleft(self) -> Request:
        return self._queue.popitem(last=False)[1]

    def pop(self) -> Request:
        """The back one, taken out."""
        return self._queue.popitem()[1]

    def discard(self, request: Request) -> bool:
        """Take ``request`` out; False if it is not queued."""
        if self._queue.get(request.rid) is not request:
            return False
        del self._queue[request.rid]
        return True


class Scheduler:
    """Continuous batching over one KV pool (see module doc).

    Args:
        kv: a prefix cache (``kv_pool``): ``match -> admit -> extend ... -> free | preempt``.
        max_num_batched_tokens: token budget per step; max_num_seqs: running requests at most.
    """

    def __init__(self, kv, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS, max_num_seqs: int = MAX_NUM_SEQS):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise CachelabError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.kv = kv
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.waiting = RequestQueue()
        self.running = RequestQueue()
        self._live: dict[int, Request] = {}
        self._open: StepRecord | None = None
        self.num_steps = 0

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def add(self, request: Request) -> None:
        """Queue ``request`` behind the waiting ones."""
        if request.rid in self._live:
            raise CachelabError(f"request {request.rid} is already in the scheduler")
        if request.num_prompt < 1 or request.max_output < 1:
            raise CachelabError(f"request {request.rid}: num_prompt and max_output must be >= 1, "
                                f"got {request.num_prompt} and {request.max_output}")
        self._live[request.rid] = request
        self.waiting.append(request)

    def abort(self, rid: int) -> bool:
        """Drop request ``rid`` between steps (a client gone): its KV is freed as at a finish.
        Returns False if it is not (or no longer) in the scheduler. O(1), queued or running."""
        if self._open is not None:
            raise CachelabError(f"step {self._open.index} is open; abort between steps")
        r = self._live.pop(rid, None)
        if r is None:
            return False
        if not self.waiting.discard(r):
            self.running.discard(r)
            self.kv.free(rid)
        return True

    def schedule(self) -> StepRecord:
        """The next step; raises if work is waiting but the KV pool cannot hold any of it."""
        if self._open is not None:
            raise CachelabError(f"step {self._open.index} is not completed; call complete() first")
        kv, budget = self.kv, self.max_num_batched_tokens
        picked: list[tuple[Request, int, int, int]] = []  # request, start, stop, cached
        preempted: list[int] = []
        running = self.running
        for i, r in enumerate(list(running)):  # admission order; a preemption takes from the back
            if i >= len(running) or budget <= 0:
                break
            num = min(r.num_known - r.num_computed, budget)
            while not kv.extend(r.rid, r.num_computed + num):
                victim = running.pop()  # the most recently admitted
                kv.preempt(victim.rid)
                victim.num_computed = 0
                victim.preemptions += 1
                self.waiting.appendleft(victim)
                preempted.append(victim.rid)
                if victim is r:
                    break
            else:
                picked.append((r, r.num_computed, r.num_computed + num, 0))
                budget -= num
                continue
            break
        num_running = len(picked)
        while not preempted and self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            r = self.waiting.peek()
            known = r.num_known
            key = r.key = kv.prefix_key(r.tokens[: r.num_prompt + r.max_output - 1], r.key)  # all it computes
            hit = kv.match(key, known)
            num = min(known - hit, budget)
            kv.admit(r.rid, key, known, hit)
            if not (kv.fits(r.rid, known) and kv.extend(r.rid, hit + num)):  # all it knows must fit
                kv.preempt(r.rid)
                break
            kv.record_query(known, hit, preempted=r.preemptions > 0)
            self.waiting.popleft()
            running.append(r)
            r.num_computed = hit
            picked.append((r, hit, hit + num, hit))
            budget -= num
        if not picked and self._live:
            r = self.waiting.peek()
            raise CachelabError(f"nothing can be scheduled: the KV cache ({kv.capacity_tokens} tokens) cannot hold "
                                f"the next request ({r.rid}, {r.num_known} tokens)")
        cols = np.array([(r.rid, a, b, r.num_prompt, c) for r, a, b, c in picked], np.int64).reshape(-1, 5)
        admitted = np.arange(len(picked)) >= num_running
        step = StepRecord(self.num_steps, cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], cols[:, 4], admitted,
                          tuple(preempted))
        self.num_steps += 1
        self._open = step if picked else None
        return step

    def complete(self, step: StepRecord, sampled: Mapping[int, int] | None = None,
                 stopped: Collection[int] = ()) -> tuple[int, ...]:
        """Finish running ``step``: its positions are computed; a request that computed all
        it knew emits a token (``sampled[rid]``, appended to its tokens, when given) and
        finishes after ``max_output`` tokens or when listed in ``stopped``. Returns the
        finished request ids, whose KV is freed (published prefixes stay cached)."""
        if step is not self._open:
            raise CachelabError(f"step {step.index} is not the step last scheduled, or is completed already")
        self._open = None
        emitted, done = [], []
        for rid, stop in zip(step.requests.tolist(), step.stops.tolist()):
            r = self._live[rid]
            r.num_computed = stop
            if stop == r.num_known:
                if sampled is not None:
                    r.append(sampled[rid])
                r.num_output += 1
                emitted.append(rid)
                if r.num_output == r.max_output or rid in stopped:
                    done.append(rid)
        for rid in done:
            self.kv.free(rid)
            self.running.discard(self._live.pop(rid))
        step.emitted, step.finished = tuple(emitted), tuple(done)
        return step.finished
