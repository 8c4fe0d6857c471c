"""Keep scores computed online, one serving step at a time, for a live learned row cache.

Offline, ``keep_scores`` featurises a whole recorded stream. A server has only what it has
served so far, so ``OnlineScorer`` keeps the same state incrementally: dense ids for row keys
as they first arrive (first-occurrence order, as ``compact`` numbers them offline), the
per-key history of ``cachelab.learning.features`` (``FeatureState``, grown as keys arrive),
and the model's corpus prior (a hash table built once). Each step's distinct rows are one
chunk of entries, featurised by the very kernels offline scoring uses (``featurise``) and
scored by the model's compiled forest; the per-row-id scores go to
``TieredStore.lookup/prefetch(row_ids, scores)``.

Nothing here sees the future. The prompt lookahead uses what a server knows at admission: the
whole prompt. For a prefill entry it is the distance to the row's next use in the same prompt
at or past the end of this step's chunk (a later chunk), and the prompt left. Offline, where
the whole stream is known, a use by another request in between hides the later one
(``prompt_lookahead``); online no other request's future is known, so nothing is hidden. On a
stream whose prompts are prefilled one at a time (the learning streams' "prompts" steps) the
two agree, and so do the scores, bit for bit (tested).

The scorer also counts the served prompts the model was trained on (``PromptOverlap``): a
model's figures on those are in-sample, as an evaluation would refuse to count them. One hash
per prompt as its prefill completes, none per row.

The scorer runs on the serving thread before a step's fetch starts, so its time is part of
every step a learned row cache serves. ``ScorerCost.fit`` fits it from timed calls (the calling
thread's CPU time of each, with the call's ``last_counts``; the serving simulator times its own
calls, the same calls on the same inputs as the live engine's): seconds per call, per scheduled
sequence, per row looked up and per distinct row scored, which the simulator then charges per
step from the scorer's own counts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np

from cachelab.engram import Addresser
from cachelab.errors import CachelabError
from cachelab.learning.features import NEVER, FeatureState, _hash_fill, _home, featurise
from cachelab.learning.streams import LearningView, layout_signature, token_digest
from cachelab.learning.training import Model, as_scores, check_layout, load, predictions
from cachelab.workload.compaction import compact
from cachelab.workload.lookups import global_key

POSITION_BITS = 21  # a prompt's positions in the low bits of its (key, position) sort keys
KEPT_PROMPTS = 1024  # prompts whose rows are kept for the lookahead (those still in prefill)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _assign(table, keys, shift, n, raw, out):
    """Dense id of each key, a new one (``n``, ``n + 1``, ...) for a key not in ``table``."""
    mask = table.shape[0] - 1
    for i in range(keys.size):
        h = _home(keys[i], shift)
        while table[h, 0] != -1 and table[h, 0] != keys[i]:
            h = (h + 1) & mask
        if table[h, 0] == -1:
            table[h, 0] = keys[i]
            table[h, 1] = n
            raw[n] = keys[i]
            n += 1
        out[i] = table[h, 1]
    return n


class KeyIndex:
    """Dense ids ``0, 1, ...`` for raw row keys (>= 0) in the order they first arrive."""

    def __init__(self, bits: int = 16):
        self.table = np.full((1 << bits, 2), -1, np.int64)
        self.raw = np.empty(1 << bits, np.int64)  # raw key of each dense id
        self.size = 0

    def ids(self, keys: np.ndarray) -> np.ndarray:
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        need = self.size + keys.size
        if need > 0.6 * self.table.shape[0]:  # open addressing stays short below 60% load
            bits = int(np.ceil(np.log2(need / 0.6)))
            self.table = np.full((1 << bits, 2), -1, np.int64)
            _hash_fill(self.table, self.raw[:self.size], np.arange(self.size, dtype=np.int64), np.uint64(64 - bits))
        if need > self.raw.size:
            self.raw = np.concatenate([self.raw, np.empty(max(need, 2 * self.raw.size) - self.raw.size, np.int64)])
        out = np.empty(keys.size, np.int64)
        shift = np.uint64(64 - int(np.log2(self.table.shape[0])))
        self.size = _assign(self.table, keys, shift, self.size, self.raw, out)
        return out


@dataclass
class PromptOverlap:
    """How many served prompts (counted as each prefill completes: a preempted request's recomputed
    prefill counts again) are ones the model trained on: their compressed tokens' digest is among
    the training window's (``train_prompts`` of its metadata, ``LearningView.prompts``). ``trained``
    None: a model saved before those were recorded, so nothing can be said."""

    trained: np.ndarray | None  # sorted uint64 prompt digests of the model's training window
    prompts: int = 0
    seen: int = 0

    @classmethod
    def of(cls, model: Model) -> "PromptOverlap":
        recorded = model.metadata.get("spec", {}).get("train_prompts")
        return cls(None if recorded is None else np.unique(np.array([int(d, 16) for d in recorded], np.uint64)))

    def add(self, digests: np.ndarray) -> None:
        self.prompts += int(digests.size)
        if self.trained is not None:
            self.seen += int(np.isin(digests, self.trained).sum())

    def to_dict(self) -> dict:
        """``prompts`` served, ``trained_prompts`` of them the model trained on and their ``share``
        (both None where the model records no training prompts), ``model_prompts`` it records."""
        known = self.trained is not None
        return {"prompts": self.prompts, "trained_prompts": self.seen if known else None,
                "share": self.seen / self.prompts if known and self.prompts else None,
                "model_prompts": int(self.trained.size) if known else None}


class OnlineScorer:
    """Scores per row id for each served step (module doc). ``domain``: the label the model's
    training trace gave a request that ``scores`` is given none for (a capture's trace labels
    each by its endpoint: ``chat`` or ``completion``, ``cachelab.capture.to_trace.endpoint_domain``);
    a label the model never saw, or None, counts as unknown, as offline."""

    def __init__(self, model: Model, layout, domain: str | None = None):
        self.model = model
        self.addresser = Addresser(layout)
        cfg = self.addresser.config
        self.layers, self.columns, self.heads = len(cfg.layers), cfg.columns, cfg.heads
        self.max_ngram, self.vocab = cfg.max_ngram, cfg.compressed_vocab
        self.domains = [domain if domain is not None else "<unlabelled>"]  # labels seen, by index
        self.domain_index = {None: 0, self.domains[0]: 0}
        self.index = KeyIndex()
        self.state = FeatureState(1 << 16)
        self.prompts: OrderedDict[int, np.ndarray] = OrderedDict()  # rid -> sorted (key, position) of its prompt
        self.last_counts = (0, 0, 0)  # the last call's scheduled sequences, rows looked up, distinct rows scored
        self.last_positions = np.zeros(0, np.int64)  # the last call's position of each row id's score, on the clock
        self.overlap = PromptOverlap.of(model)  # served prompts the model trained on
        check_layout(model, layout_signature(cfg))
        if self.model.prior.token_counts.size != self.vocab:
            raise CachelabError(f"the model's corpus prior covers {self.model.prior.token_counts.size} compressed "
                                f"ids, layout {cfg.name!r} has {self.vocab}: a model trained on another layout")

    @classmethod
    def open(cls, directory: Path, layout, domain: str | None = None) -> "OnlineScorer":
        """The scorer of the model saved in ``directory`` (refused, naming why, as ``load`` does)."""
        return cls(load(directory), layout, domain)

    @property
    def clock(self) -> int:
        """Entries scored so far: the learned policy's clock, which scores are positions on."""
        return self.state.clock

    def scores(self, requests, starts, stops, num_prompt, tokens, row_ids, domains=None) -> np.ndarray:
        """Scores shaped like ``row_ids`` ``[T, layers, columns]``: the step's tokens, request by
        request, positions ``starts[i]:stops[i]`` of request ``requests[i]`` (``num_prompt[i]``
        prompt tokens; ``tokens[i]`` its token ids known so far; ``domains[i]`` its domain label,
        None for the scorer's own ``domain``)."""
        row_ids = np.asarray(row_ids)
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        lengths = stops - starts
        if row_ids.shape != (int(lengths.sum()), self.layers, self.columns):
            raise CachelabError(f"row ids of shape {list(row_ids.shape)} for a step of {int(lengths.sum())} "
                                f"tokens, {self.layers} layers and {self.columns} columns")
        which = np.repeat(np.arange(lengths.size), lengths)  # each token's request, by index in the step
        position = starts[which] + (np.arange(which.size) - np.repeat(np.cumsum(lengths) - lengths, lengths))
        inverse, uniq = compact(global_key(np.arange(self.layers)[None, :, None], row_ids).reshape(-1))
        self.last_counts = (int(lengths.size), int(inverse.size), int(uniq.size))
        first = np.empty(uniq.size, np.int64)
        first[inverse[::-1]] = np.arange(inverse.size)[::-1]  # last write wins = first lookup
        dense = self.index.ids(uniq)
        self.state.grow(self.index.size)
        per_token = self.layers * self.columns
        token = first // per_token
        req = which[token]
        pos = position[token]
        decode = pos >= np.asarray(num_prompt, np.int64)[req]
        view = LearningView(
            dense, np.array([0, dense.size]), np.arange(dense.size), np.array([0, inverse.size]),
            self.index.raw[:self.index.size], ((first // self.columns) % self.layers).astype(np.int8),
            (first % self.columns).astype(np.int8), pos.astype(np.int32), decode,
            self._domains(domains, lengths.size)[req], np.asarray(requests, np.int64)[req].astype(np.int32),
            self._ngrams(tokens, starts, stops, which, position)[token], self.domains, self.heads, self.vocab)
        ahead = self._lookahead(requests, stops, num_prompt, tokens, req, pos, decode, uniq) \
            if self.model.lookahead else None
        prompt = np.asarray(num_prompt, np.int64)
        done = np.flatnonzero((starts < prompt) & (prompt <= stops))  # prefills that complete in this step
        self.overlap.add(np.array([token_digest(self.addresser.compress(np.asarray(tokens[i][:prompt[i]], np.int64)))
                                   for i in done.tolist()], np.uint64))
        offset = self.clock
        x = featurise(view, 0, dense.size, self.state, self.model.prior, self.model.domains, ahead)
        out = as_scores(self.model, predictions(self.model, x, offset), offset)
        self.last_positions = (offset + inverse).reshape(row_ids.shape)  # for a replay of rows folded or sampled
        return out[inverse].reshape(row_ids.shape)

    def _domains(self, labels, n: int) -> np.ndarray:
        """Each of the step's ``n`` requests' index in ``self.domains`` (labels new to it appended)."""
        if labels is None:
            return np.zeros(n, np.int16)
        if len(labels) != n:
            raise CachelabError(f"{len(labels)} domain labels for a step of {n} requests")
        out = np.empty(n, np.int16)
        for i, label in enumerate(labels):  # one per request of the step, not per row
            at = self.domain_index.get(label)
            if at is None:
                at = self.domain_index[label] = len(self.domains)
                self.domains.append(label)
            out[i] = at
        return out

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended before its prefill did (aborted): drop its prompt's rows."""
        self.prompts.pop(rid, None)

    def _ngrams(self, tokens, starts, stops, which, position) -> np.ndarray:
        """Compressed ids of each step token and the ``max_ngram - 1`` before it in its request
        (-1 before the request's start)."""
        lo = np.maximum(starts - self.max_ngram + 1, 0)  # each request's window: the step's tokens and those before
        known = self.addresser.compress(np.concatenate(
            [np.empty(0, np.int64), *(np.asarray(tokens[i][lo[i]:stops[i]], np.int64) for i in range(starts.size))]))
        window = np.cumsum(stops - lo) - (stops - lo) - lo  # known[window[i] + p] is request i's position p
        back = position[:, None] - np.arange(self.max_ngram)[None, :]
        return np.where(back >= 0, known[np.maximum(window[which][:, None] + back, 0)], -1).astype(np.int32)

    def _lookahead(self, requests, stops, num_prompt, tokens, req, pos, decode, uniq) -> np.ndarray:
        """The two lookahead columns of the step's entries (module doc)."""
        ahead = np.zeros((req.size, 2), np.float32)
        ahead[:, 0] = NEVER
        for i in np.unique(req[~decode]).tolist():
            rid, prompt = int(requests[i]), int(num_prompt[i])
            order = self._prompt(rid, np.asarray(tokens[i][:prompt], np.int64))
            m = (req == i) & ~decode
            probe = (uniq[m] << POSITION_BITS) | int(stops[i])
            at = np.searchsorted(order, probe)  # the first (key, position) at or past (key, stop)
            inside = at < order.size
            hit = order[np.minimum(at, order.size - 1)]
            found = inside & ((hit >> POSITION_BITS) == uniq[m])
            nxt = hit & ((1 << POSITION_BITS) - 1)
            ahead[m, 0] = np.where(found, np.log1p(np.where(found, nxt - pos[m], 0).astype(np.float64)), NEVER)
            ahead[m, 1] = np.log1p((prompt - pos[m]).astype(np.float64))
            if int(stops[i]) >= prompt:  # prefill done: its rows are no longer needed
                self.prompts.pop(rid, None)
        return ahead

    def _prompt(self, rid: int, prompt: np.ndarray) -> np.ndarray:
        """Sorted ``key << POSITION_BITS | position`` over every row of a prompt (kept while it prefills)."""
        order = self.prompts.get(rid)
        if order is None:
            if prompt.size >= 1 << POSITION_BITS:
                raise CachelabError(f"a prompt of {prompt.size:,} tokens: the online lookahead takes fewer than "
                                    f"{1 << POSITION_BITS:,}")
            rows = self.addresser.rows(prompt).astype(np.int64)
            keys = global_key(np.arange(self.layers)[None, :, None], rows)
            where = np.broadcast_to(np.arange(prompt.size, dtype=np.int64)[:, None, None], keys.shape)
            order = np.sort(((keys << POSITION_BITS) | where).reshape(-1))
            self.prompts[rid] = order
            while len(self.prompts) > KEPT_PROMPTS:
                self.prompts.popitem(last=False)
        return order


@dataclass(frozen=True)
class ScorerCost:
    """The online scorer's time per call: ``per_call_s`` plus ``per_sequence_s``, ``per_lookup_s``
    and ``per_row_s`` times the step's scheduled sequences, rows looked up (tokens x rows per
    token) and distinct rows scored (``OnlineScorer.last_counts``), fitted by ``fit`` on calls
    timed on the machine they ran on (CPU seconds of the calling thread: a thread given all of
    a core)."""

    per_call_s: float
    per_sequence_s: float
    per_lookup_s: float
    per_row_s: float
    calls: int = 0  # the timed calls the fit used
    rms_error: float = 0.0  # the fit's root-mean-square relative error per call

    def seconds(self, counts: tuple[int, int, int]) -> float:
        """Seconds of one call with ``counts`` (sequences, lookups, distinct rows)."""
        return self.total_s(1, *counts)

    def total_s(self, calls: int, sequences: int, lookups: int, rows: int) -> float:
        """Seconds of ``calls`` calls whose counts sum to ``sequences``, ``lookups`` and ``rows``."""
        return self.per_call_s * calls + self.per_sequence_s * sequences + self.per_lookup_s * lookups + self.per_row_s * rows

    def to_dict(self) -> dict:
        return {"per_call_s": self.per_call_s, "per_sequence_s": self.per_sequence_s,
                "per_lookup_s": self.per_lookup_s, "per_row_s": self.per_row_s, "calls": self.calls,
                "rms_relative_error": self.rms_error}

    @classmethod
    def fit(cls, calls) -> "ScorerCost":
        """The four terms by non-negative least squares of each call's relative error (a decode
        step counts as much as a prefill step) over ``calls``, rows of ``(cpu_s, sequences,
        lookups, rows)``; calls over 3 times the first fit's time (a first call's one-time
        costs, a preempted thread) are left out of the second, final fit."""
        from scipy.optimize import nnls

        data = np.asarray(calls, np.float64).reshape(-1, 4)
        data = data[data[:, 0] > 0]
        if data.shape[0] < 4:
            raise CachelabError(f"a scorer cost needs at least 4 timed calls, got {data.shape[0]}")
        y, a = data[:, 0], np.column_stack([np.ones(data.shape[0]), data[:, 1:]])
        for _ in range(2):
            coef, _ = nnls(a / y[:, None], np.ones(y.size))
            keep = y <= 3 * (a @ coef)
            if keep.all():
                break
            y, a = y[keep], a[keep]
        return cls(*map(float, coef), calls=int(y.size), rms_error=float(np.sqrt(np.mean((a @ coef / y - 1) ** 2))))
