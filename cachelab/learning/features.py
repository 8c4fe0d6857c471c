"""Causal per-lookup features and future-derived labels for hotness predictors.

Everything a feature uses is known before the lookup's fetch: where the lookup sits (layer,
n-gram order, head, domain, position in its request, prefill or decode), what the arrived
prompt says of the future (a prompt is whole before its prefill starts and Engram rows
depend only on tokens, so a prefill lookup knows how many prompt tokens later its row is
used again in the same prompt, and how much prompt is left; off with ``lookahead=False``),
what the key's past
looks like (age, the last ``GAPS`` reuse distances, exponentially decayed counters at several
half-lives, access count, earlier accesses within the same request), and corpus statistics from a *training window only*
(``CorpusPrior``: how often the n-gram's compressed token ids, and the row itself, occurred
there). Time is the lookup index. One compiled pass fills the whole matrix; ``FeatureState``
carries the per-key history across chunks so a stream can be featurised piece by piece.

Labels look into the future (``cachelab.workload.future.next_access``): ``log1p`` of lookups to the next
access censored at ``horizon`` (regression), reuse within ``horizon`` (classification), or
whether Belady, at a given cache size, keeps the row until its next access (classification:
Hawkeye's OPTgen labels, aimed at the cache's own decision boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba as nb
import numpy as np

from cachelab.compiled import prefetch
from cachelab.errors import CachelabError
from cachelab.workload.future import next_access
from cachelab.policy import NO_NEXT

GAPS = 8
HALF_LIVES = (256, 4096, 65536, 1048576)
NEVER = 24.0  # log1p of a gap or age that does not exist (larger than any real one)

FEATURE_NAMES = (
    ["layer", "order", "head", "domain", "log_position", "decode",
     "log_prompt_next", "log_prompt_left",
     "log_token_freq", "log_ngram_min_token_freq", "log_row_freq_train",
     "log_age", "log_count"]
    + [f"log_gap_{i + 1}" for i in range(GAPS)]
    + [f"log_decayed_{h}" for h in HALF_LIVES]
    + ["log_request_count"]
)
LOOKAHEAD_COLUMN = FEATURE_NAMES.index("log_prompt_next")  # and log_prompt_left after it
PRIOR_COLUMN = FEATURE_NAMES.index("log_token_freq")  # the three corpus-prior columns start here
HISTORY_COLUMN = FEATURE_NAMES.index("log_age")


PRIOR_TENSORS = ("token_counts", "row_keys", "row_counts")
INT64_MAX = np.iinfo(np.int64).max


@dataclass(slots=True)
class CorpusPrior:
    """Corpus frequencies learnt from a training window (saved with the model, no pickle).

    ``token_counts[c]``: occurrences of compressed id ``c`` among the window's tokens.
    ``row_keys``/``row_counts``: raw keys ``(layer << 32) | row`` seen at least twice, sorted.
    ``row_count`` finds a key's count through a hash table built once (``_table``).
    """

    token_counts: np.ndarray
    row_keys: np.ndarray
    row_counts: np.ndarray
    _table: np.ndarray | None = field(default=None, init=False, repr=False)

    def row_count(self, raw_keys: np.ndarray) -> np.ndarray:
        """The window's count of each raw key (0 for a key seen fewer than twice there)."""
        if self._table is None:
            bits = max(4, int(np.ceil(np.log2(max(self.row_keys.size, 1) / 0.5))))
            self._table = np.full((1 << bits, 2), -1, np.int64)
            _hash_fill(self._table, self.row_keys, self.row_counts, np.uint64(64 - bits))
        raw_keys = np.ascontiguousarray(raw_keys, dtype=np.int64)
        out = np.empty(raw_keys.size, np.int64)
        _hash_probe(self._table, raw_keys, np.uint64(64 - int(np.log2(self._table.shape[0]))), out)
        return out

    @classmethod
    def from_window(cls, view, lo: int, hi: int) -> "CorpusPrior":
        """Count the tokens and rows of entries ``[lo, hi)`` of a ``LearningView`` only."""
        where = view.request[lo:hi].astype(np.int64) << 32 | view.position[lo:hi].astype(np.int64)
        _, first = np.unique(where, return_index=True)
        tokens = view.ngram[lo:hi, 0][first]
        token_counts = np.bincount(tokens[tokens >= 0], minlength=view.vocab).astype(np.int64)
        keys, counts = np.unique(view.raw_keys[view.keys[lo:hi]], return_counts=True)
        often = counts >= 2
        return cls(token_counts, keys[often].astype(np.int64), counts[often].astype(np.int64))

    def tensors(self) -> dict[str, np.ndarray]:
        return {"token_counts": self.token_counts, "row_keys": self.row_keys, "row_counts": self.row_counts}

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray], where) -> "CorpusPrior":
        """A prior read back from ``tensors()``'s arrays, refused (naming ``where``) unless the
        compiled feature kernels can index it safely: integer counts >= 0, one count per key,
        keys strictly increasing."""
        arrays = [t[name] for name in PRIOR_TENSORS]
        if any(a.dtype.kind not in "iu" or (a.size and (a.min() < 0 or a.max() > INT64_MAX)) for a in arrays):
            raise CachelabError(f"{where}: {', '.join(PRIOR_TENSORS)} must hold integers >= 0")
        tokens, keys, counts = (a.astype(np.int64) for a in arrays)
        if keys.size != counts.size or (keys.size > 1 and (np.diff(keys) <= 0).any()):
            raise CachelabError(f"{where}: row_keys must be strictly increasing, with one row_counts entry each")
        return cls(tokens, keys, counts)


@nb.njit(cache=True, inline="always")
def _home(key, shift):
    """Fibonacci hashing: the top bits of key x 2^64/phi."""
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> shift)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _hash_fill(table, keys, counts, shift):
    """Open addressing, linear probing; keys are >= 0 and distinct, -1 marks an empty slot."""
    mask = table.shape[0] - 1
    for i in range(keys.size):
        h = _home(keys[i], shift)
        while table[h, 0] != -1:
            h = (h + 1) & mask
        table[h, 0] = keys[i]
        table[h, 1] = counts[i]


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _hash_probe(table, keys, shift, out):
    mask = table.shape[0] - 1
    for i in range(keys.size):
        if i + 16 < keys.size:
            prefetch(table, _home(keys[i + 16], shift))
        h = _home(keys[i], shift)
        out[i] = 0
        while table[h, 0] != -1:
            if table[h, 0] == keys[i]:
                out[i] = table[h, 1]
                break
            h = (h + 1) & mask


@dataclass(slots=True)
class FeatureState:
    """Per-key history, carried from one chunk of a stream to the next."""

    num_keys: int
    last: np.ndarray = field(init=False)
    count: np.ndarray = field(init=False)
    gaps: np.ndarray = field(init=False)
    decayed: np.ndarray = field(init=False)
    last_request: np.ndarray = field(init=False)
    request_count: np.ndarray = field(init=False)
    clock: int = 0

    def __post_init__(self):
        self.last = np.full(self.num_keys, -1, dtype=np.int64)
        self.count = np.zeros(self.num_keys, dtype=np.int64)
        self.gaps = np.zeros((self.num_keys, GAPS), dtype=np.float32)
        self.decayed = np.zeros((self.num_keys, len(HALF_LIVES)), dtype=np.float64)
        self.last_request = np.full(self.num_keys, -1, dtype=np.int32)
        self.request_count = np.zeros(self.num_keys, dtype=np.int32)

    def grow(self, num_keys: int) -> None:
        """Room for keys ``[0, num_keys)`` (online, where keys keep arriving), at least doubling."""
        if num_keys <= self.num_keys:
            return
        size = max(num_keys, 2 * self.num_keys)
        fresh = FeatureState(size - self.num_keys)
        for name in ("last", "count", "gaps", "decayed", "last_request", "request_count"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(fresh, name)]))
        self.num_keys = size


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _history_kernel(keys, t0, last, count, gaps, decayed, rates, out, col):
    """Fill the history columns ``out[:, col:]`` and update the state, in stream order."""
    n_gaps = gaps.shape[1]
    n_h = rates.size
    for i in range(keys.size):
        k = keys[i]
        t = t0 + i
        c = count[k]
        if c == 0:
            out[i, col] = NEVER
            for j in range(n_gaps):
                out[i, col + 2 + j] = NEVER
            for j in range(n_h):
                out[i, col + 2 + n_gaps + j] = 0.0
            for j in range(n_gaps):
                gaps[k, j] = NEVER
        else:
            dt = t - last[k]
            age = np.log1p(np.float64(dt))
            out[i, col] = age
            for j in range(n_gaps):
                out[i, col + 2 + j] = gaps[k, j]
            for j in range(n_h):
                decayed[k, j] *= np.exp(-rates[j] * dt)
                out[i, col + 2 + n_gaps + j] = np.log1p(decayed[k, j])
            for j in range(n_gaps - 1, 0, -1):
                gaps[k, j] = gaps[k, j - 1]
            gaps[k, 0] = age
        out[i, col + 1] = np.log1p(np.float64(c))
        for j in range(n_h):
            decayed[k, j] += 1.0
        count[k] = c + 1
        last[k] = t


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _entry_kernel(layer, column, heads, known_domain, domain, position, decode, out):
    """The first six columns, what each entry says of itself: layer, n-gram order, head, the
    model's index of its domain, log1p position, decode flag (one pass over the row-major matrix)."""
    for i in range(layer.size):
        out[i, 0] = layer[i]
        out[i, 1] = 2 + column[i] // heads
        out[i, 2] = column[i] % heads
        out[i, 3] = known_domain[domain[i]]
        out[i, 4] = np.log1p(np.float64(position[i]))
        out[i, 5] = decode[i]


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _request_kernel(keys, request, last_request, request_count, out, col):
    """log1p of the key's earlier accesses within the same request (repeats inside a prompt)."""
    for i in range(keys.size):
        k = keys[i]
        if last_request[k] != request[i]:
            last_request[k] = request[i]
            request_count[k] = 0
        out[i, col] = np.log1p(np.float64(request_count[k]))
        request_count[k] += 1


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _token_kernel(ngram, order, token_counts, out, col):
    """log1p corpus frequency of the newest token and of the rarest token of each entry's n-gram."""
    for i in range(ngram.shape[0]):
        newest = token_counts[ngram[i, 0]] if ngram[i, 0] >= 0 else 0
        out[i, col] = np.log1p(np.float64(newest))
        best = newest
        for k in range(1, order[i]):
            if ngram[i, k] < 0:
                break
            c = token_counts[ngram[i, k]]
            if c < best:
                best = c
        out[i, col + 1] = np.log1p(np.float64(best))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _prompt_kernel(keys, request, position, decode, prompt_len, num_keys, out, col):
    """One backward pass: for a prefill entry, log1p of the prompt tokens to its row's next use
    when that use is in the same request's prompt (else NEVER), and log1p of the prompt left.

    Conservative under interleaving: only the row's very next use counts, so a use by
    another request in between hides a later one in this prompt."""
    last_request = np.full(num_keys, -1, dtype=np.int64)
    last_position = np.zeros(num_keys, dtype=np.int64)
    for i in range(keys.size - 1, -1, -1):
        k = keys[i]
        out[i, col] = NEVER
        out[i, col + 1] = 0.0
        if not decode[i]:
            if last_request[k] == request[i]:
                out[i, col] = np.log1p(np.float64(last_position[k] - position[i]))
            out[i, col + 1] = np.log1p(np.float64(prompt_len[request[i]] - position[i]))
        last_request[k] = request[i] if not decode[i] else -1
        last_position[k] = position[i]


def prompt_lookahead(view) -> np.ndarray:
    """The two lookahead columns for every entry of a ``LearningView`` (see ``_prompt_kernel``)."""
    request = view.request.astype(np.int64)
    prompt_len = np.zeros(int(request.max()) + 1 if request.size else 1, dtype=np.int64)
    np.maximum.at(prompt_len, request, np.where(view.decode, 0, view.position.astype(np.int64) + 1))
    out = np.empty((len(view), 2), dtype=np.float32)
    _prompt_kernel(view.keys, request, view.position.astype(np.int64), view.decode, prompt_len, view.num_keys, out, 0)
    return out


def extract(stream, lo: int, hi: int, state: FeatureState, prior: CorpusPrior,
            domains: list[str], lookahead: bool | np.ndarray = True) -> np.ndarray:
    """Features of entries ``[lo, hi)`` of a ``LearningView``; ``state`` must have seen exactly ``[0, lo)``.

    ``domains`` is the model's domain vocabulary: a domain it never saw gets -1. Without
    ``lookahead`` the two prompt-lookahead columns hold "never" and 0 (a model then ignores them);
    an array is the whole view's ``prompt_lookahead``, computed once for a view featurised in chunks.
    """
    if state.clock != lo:
        raise ValueError(f"feature state is at lookup {state.clock}, not {lo}: featurise in order")
    if isinstance(lookahead, np.ndarray):
        ahead = lookahead[lo:hi]
    else:
        ahead = prompt_lookahead(stream)[lo:hi] if lookahead else None
    return featurise(stream, lo, hi, state, prior, domains, ahead)


def featurise(entries, lo: int, hi: int, state: FeatureState, prior: CorpusPrior, domains: list[str],
              ahead: np.ndarray | None) -> np.ndarray:
    """Features of entries ``[lo, hi)`` of a ``LearningView`` whose history ``state`` holds, at
    time ``state.clock`` on (``extract`` for a whole view; ``cachelab.learning.online`` for a
    view of one serving step). ``ahead``: the two lookahead columns of these entries, or None
    for "never" and 0."""
    if prior.token_counts.size != entries.vocab:
        raise CachelabError(f"the model's corpus prior covers {prior.token_counts.size} compressed ids, "
                            f"the stream's vocabulary has {entries.vocab}: another Engram layout")
    n = hi - lo
    out = np.empty((n, len(FEATURE_NAMES)), dtype=np.float32)
    known = np.array([domains.index(d) if d in domains else -1 for d in entries.domains], dtype=np.float32)
    _entry_kernel(entries.layer[lo:hi], entries.column[lo:hi], entries.heads, known, entries.domain[lo:hi],
                  entries.position[lo:hi], entries.decode[lo:hi], out)
    if ahead is not None:
        out[:, LOOKAHEAD_COLUMN:LOOKAHEAD_COLUMN + 2] = ahead
    else:
        out[:, LOOKAHEAD_COLUMN] = NEVER
        out[:, LOOKAHEAD_COLUMN + 1] = 0.0
    apply_prior(entries, lo, hi, prior, out)
    rates = np.log(2.0) / np.asarray(HALF_LIVES, dtype=np.float64)
    _history_kernel(entries.keys[lo:hi], state.clock, state.last, state.count, state.gaps, state.decayed, rates,
                    out, HISTORY_COLUMN)
    _request_kernel(entries.keys[lo:hi], entries.request[lo:hi], state.last_request, state.request_count, out,
                    len(FEATURE_NAMES) - 1)
    state.clock += n
    return out


def apply_prior(view, lo: int, hi: int, prior: CorpusPrior, out: np.ndarray) -> None:
    """(Re)write the corpus-prior columns of ``out`` (the features of entries ``[lo, hi)``)."""
    order = 2 + view.column[lo:hi].astype(np.int64) // view.heads
    _token_kernel(view.ngram[lo:hi], order, prior.token_counts, out, PRIOR_COLUMN)
    out[:, PRIOR_COLUMN + 2] = np.log1p(prior.row_count(view.raw_keys[view.keys[lo:hi]]))


def regression_labels(keys: np.ndarray, horizon: int) -> np.ndarray:
    """log1p(lookups to the next access), censored at ``horizon``."""
    nxt = next_access(keys)
    dist = np.where(nxt == NO_NEXT, horizon, nxt - np.arange(keys.size))
    return np.log1p(np.minimum(dist, horizon)).astype(np.float32)


def reuse_labels(keys: np.ndarray, horizon: int) -> np.ndarray:
    """1 if the key is accessed again within ``horizon`` lookups."""
    nxt = next_access(keys)
    return ((nxt != NO_NEXT) & (nxt - np.arange(keys.size) <= horizon)).astype(np.float32)


def belady_labels(keys: np.ndarray, step_offsets: np.ndarray, capacity: int, num_keys: int) -> np.ndarray:
    """1 if the offline optimum (the registered policy declaring ``Capabilities(optimal=True)``:
    Belady with bypass) at ``capacity`` rows keeps the key resident from this access to its
    next one, i.e. that next access is an optimal hit; 0 otherwise."""
    from cachelab import registry
    from cachelab.engine.replay import run_policy
    from cachelab.learning.lineup import optimum

    hits = run_policy(registry.make_policy(optimum()), keys, step_offsets, capacity, num_keys)
    nxt = next_access(keys)
    kept = np.zeros(keys.size, dtype=np.float32)
    known = nxt != NO_NEXT
    kept[known] = hits[nxt[known]]
    return kept
