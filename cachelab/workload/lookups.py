"""The lookup stream: every Engram row read, grouped into serving steps.

A stream is CSR-shaped: ``keys[step_offsets[s]:step_offsets[s+1]]`` are the lookups of step
``s``. A key is a global row key ``(layer_index << 32) | row``, so the two (or more) layer
tables share one key space and a row keeps its table identity (the SSD page model needs it).
Optional per-lookup metadata (column, request, position, phase, domain) rides along for
predictors and reports; the engine itself reads only keys and steps.

Steps are the unit of deduplication: a serving step gathers its rows at once, so a row
looked up twice in one step is fetched once (``dedup_steps``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numba as nb
import numpy as np

from cachelab.errors import CachelabError

LAYER_SHIFT = 32
ROW_MASK = (1 << LAYER_SHIFT) - 1
FORMAT_VERSION = 1
PREFILL, DECODE = 0, 1
# Per-lookup metadata fields and their dtypes (others are allowed, these are checked).
META_DTYPES = {"column": np.int8, "request": np.int32, "position": np.int32,
               "phase": np.int8, "domain": np.int16}


def global_key(layer_index, row) -> np.ndarray:
    """``(layer_index << 32) | row`` as int64."""
    return (np.asarray(layer_index, dtype=np.int64) << LAYER_SHIFT) | np.asarray(row, dtype=np.int64)


def split_key(keys) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``global_key``: (layer index, row within the layer's table)."""
    keys = np.asarray(keys, dtype=np.int64)
    return keys >> LAYER_SHIFT, keys & ROW_MASK


@dataclass(frozen=True)
class LookupStream:
    """Row lookups per serving step.

    Args:
        keys: int64 global row keys, in step order (within a step: token, layer, column).
        step_offsets: int64 [steps + 1], rising from 0 to ``keys.size``.
        row_bytes: bytes per row (264 for DeepSeek-V4.1).
        layers: the Engram layer ids behind layer indices 0, 1, ...
        meta: optional per-lookup arrays, each ``keys.size`` long (see META_DTYPES).
        domains: names behind ``meta["domain"]`` codes.
    """

    keys: np.ndarray
    step_offsets: np.ndarray
    row_bytes: int
    layers: tuple = (0,)
    meta: Mapping[str, np.ndarray] = field(default_factory=dict)
    domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        keys = np.ascontiguousarray(self.keys, dtype=np.int64)
        offs = np.ascontiguousarray(self.step_offsets, dtype=np.int64)
        if keys.ndim != 1:
            raise CachelabError(f"keys must be one-dimensional, got shape {keys.shape}")
        if offs.ndim != 1 or offs.size < 1 or offs[0] != 0 or offs[-1] != keys.size or np.any(np.diff(offs) < 0):
            raise CachelabError(f"step_offsets must rise from 0 to {keys.size} (the lookup count), "
                                f"got {offs[:5].tolist()}...{offs[-2:].tolist()}")
        if keys.size and keys.min() < 0:
            raise CachelabError(f"keys must be non-negative, found {int(keys.min())}")
        if int(self.row_bytes) < 1:
            raise CachelabError(f"row_bytes must be positive, got {self.row_bytes}")
        meta = {}
        for name, arr in self.meta.items():
            arr = np.ascontiguousarray(arr, dtype=META_DTYPES.get(name))
            if arr.shape != keys.shape:
                raise CachelabError(f"meta field {name!r} has shape {arr.shape}, expected {keys.shape}")
            meta[name] = arr
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "step_offsets", offs)
        object.__setattr__(self, "row_bytes", int(self.row_bytes))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "meta", meta)
        object.__setattr__(self, "domains", tuple(self.domains))

    @property
    def num_steps(self) -> int:
        return self.step_offsets.size - 1

    @property
    def num_lookups(self) -> int:
        return self.keys.size

    def step_ids(self) -> np.ndarray:
        """The step of every lookup."""
        return np.repeat(np.arange(self.num_steps, dtype=np.int64), np.diff(self.step_offsets))

    @classmethod
    def from_keys(cls, keys, row_bytes: int = 1) -> "LookupStream":
        """A plain key trace: every request is its own step (no deduplication)."""
        keys = np.asarray(keys, dtype=np.int64)
        return cls(keys, np.arange(keys.size + 1, dtype=np.int64), row_bytes)

    @classmethod
    def from_rows(cls, rows, token_step, row_bytes: int, layers: Sequence[int],
                  token_meta: Mapping[str, np.ndarray] | None = None,
                  domains: Sequence[str] = ()) -> "LookupStream":
        """Flatten addresser rows ``[T, L, C]`` in token -> layer -> column order.

        Args:
            rows: int32 row ids per token, layer index and column.
            token_step: the (non-decreasing) step of each token; steps may be empty.
            token_meta: per-token arrays (request, position, phase, domain, ...), repeated to
                every lookup of the token; ``column`` is added from the column index.
        """
        rows = np.asarray(rows)
        if rows.ndim != 3:
            raise CachelabError(f"rows must be [tokens, layers, columns], got shape {rows.shape}")
        t, n_layers, n_cols = rows.shape
        if n_layers != len(layers):
            raise CachelabError(f"rows has {n_layers} layers but layers lists {len(layers)}: {list(layers)}")
        token_step = np.asarray(token_step, dtype=np.int64)
        if token_step.shape != (t,):
            raise CachelabError(f"token_step has shape {token_step.shape}, expected ({t},)")
        if t and (token_step[0] < 0 or np.any(np.diff(token_step) < 0)):
            raise CachelabError("token_step must be non-negative and non-decreasing (tokens in step order)")
        keys = global_key(np.arange(n_layers)[None, :, None], rows).reshape(-1)
        per_token = n_layers * n_cols
        steps = int(token_step[-1]) + 1 if t else 0
        counts = np.bincount(token_step, minlength=steps) * per_token
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        meta = {"column": np.tile(np.arange(n_cols, dtype=np.int8), t * n_layers)}
        for name, arr in (token_meta or {}).items():
            arr = np.asarray(arr)
            if arr.shape != (t,):
                raise CachelabError(f"token_meta field {name!r} has shape {arr.shape}, expected ({t},)")
            meta[name] = np.repeat(arr, per_token)
        return cls(keys, offsets, row_bytes, tuple(layers), meta, tuple(domains))

    @classmethod
    def from_sequences(cls, addresser, sequences: Sequence[np.ndarray], tokens_per_step: int | None = 1,
                       prompt_lengths: Sequence[int] | None = None,
                       domains: Sequence[str] | None = None) -> "LookupStream":
        """Offline replay of whole requests, one request at a time, in the order given.

        Step semantics: a request's prompt (the first ``prompt_lengths[i]`` tokens; all of
        them by default) is prefilled in chunks of ``tokens_per_step`` tokens, each chunk one
        step (``None``: the whole prompt in one step); every later token is a decode step of
        one token. A step never mixes requests; a serving scheduler that batches requests
        builds its steps with ``from_rows`` instead.

        Args:
            addresser: a ``cachelab.engram.Addresser``.
            sequences: raw token ids per request.
            domains: an optional domain label per request (stored as codes + names).
        """
        if tokens_per_step is not None and tokens_per_step < 1:
            raise CachelabError(f"tokens_per_step must be at least 1 (or None), got {tokens_per_step}")
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        n = int(lengths.sum())
        prompt = lengths if prompt_lengths is None else np.asarray(prompt_lengths, dtype=np.int64)
        if prompt.shape != lengths.shape or np.any((prompt < 0) | (prompt > lengths)):
            raise CachelabError("prompt_lengths must give, per sequence, a length between 0 and its token count")
        seq_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if n else np.zeros(0, np.int64)
        rows = addresser.rows(tokens, seq_offsets)
        request = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
        position = (np.arange(n, dtype=np.int64) - seq_offsets[request]).astype(np.int32)
        phase = (position >= prompt[request]).astype(np.int8)
        chunk = n + 1 if tokens_per_step is None else int(tokens_per_step)
        # Per request: ceil(prompt / chunk) prefill steps, then one step per decode token.
        steps_per_request = -(-prompt // chunk) + (lengths - prompt)
        first_step = np.concatenate([[0], np.cumsum(steps_per_request)[:-1]])
        prompt_t = prompt[request]
        local = np.where(phase == PREFILL, position // chunk, -(-prompt_t // chunk) + position - prompt_t)
        token_step = first_step[request] + local
        meta = {"request": request, "position": position, "phase": phase}
        return cls.from_request_rows(addresser.config, rows, token_step, meta, domains, lengths.size)

    @classmethod
    def from_request_rows(cls, config, rows, token_step, token_meta: Mapping[str, np.ndarray],
                          domains: Sequence[str] | None, num_requests: int) -> "LookupStream":
        """``from_rows`` for layout ``config``'s rows of requests, with ``token_meta["request"]``
        set; ``domains`` (one label per request, or None) become ``domain`` codes and names."""
        meta, names = dict(token_meta), ()
        if domains is not None:
            if len(domains) != num_requests:
                raise CachelabError(f"domains has {len(domains)} labels for {num_requests} sequences")
            labels, codes = np.unique(np.asarray(domains, dtype=str), return_inverse=True)
            meta["domain"] = codes.astype(np.int16)[meta["request"]]
            names = tuple(str(x) for x in labels)
        return cls.from_rows(rows, token_step, config.row_bytes, config.layers, meta, names)

    @classmethod
    def from_texts(cls, addresser, texts: Sequence[str], request_tokens: int | None = None,
                   tokens_per_step: int | None = 1, max_tokens: int | None = None,
                   domains: Sequence[str] | None = None) -> "LookupStream":
        """Real text as requests: each text tokenized (BOS first) and, if ``request_tokens``
        is given, cut into requests of that many tokens; at most ``max_tokens`` tokens in all.
        Steps as in ``from_sequences`` (all tokens are prompt tokens)."""
        from cachelab.engram import encode

        seqs, labels = [], []
        for i, ids in enumerate(encode(list(texts), addresser.config.tokenizer, bos=True)):
            size = request_tokens or max(ids.size, 1)
            parts = [ids[lo:lo + size] for lo in range(0, ids.size, size)]
            seqs += parts
            labels += [domains[i]] * len(parts) if domains is not None else []
        if max_tokens is not None:
            ends = np.cumsum([s.size for s in seqs])
            keep = min(int(np.searchsorted(ends, max_tokens)) + 1, len(seqs))
            seqs = seqs[:keep]
            if seqs and ends[keep - 1] > max_tokens:
                seqs[-1] = seqs[-1][:seqs[-1].size - (ends[keep - 1] - max_tokens)]
            labels = labels[:keep]
        return cls.from_sequences(addresser, seqs, tokens_per_step, domains=labels if domains is not None else None)

    def save(self, path: str | Path) -> Path:
        """Write the stream as one ``.npz`` (uncompressed: loads at memory speed)."""
        path = Path(path)
        arrays = {f"meta_{k}": v for k, v in self.meta.items()}
        np.savez(path, version=np.int64(FORMAT_VERSION), keys=self.keys, step_offsets=self.step_offsets,
                 row_bytes=np.int64(self.row_bytes), layers=np.asarray(self.layers, dtype=np.int64),
                 domains=np.asarray(self.domains, dtype=str), **arrays)
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")

    @classmethod
    def load(cls, path: str | Path) -> "LookupStream":
        """Read a stream written by ``save``; errors name the file and the field at fault."""
        path = Path(path)
        if not path.is_file():
            raise CachelabError(f"lookup stream not found: {path}")
        try:
            with np.load(path, allow_pickle=False) as z:
                files = {k: z[k] for k in z.files}
        except Exception as exc:  # zipfile / format errors: report, don't trace back
            raise CachelabError(f"{path} is not a readable .npz lookup stream: {exc}") from None
        for name in ("version", "keys", "step_offsets", "row_bytes", "layers"):
            if name not in files:
                raise CachelabError(f"{path}: field {name!r} missing; not a cachelab lookup stream")
        if int(files["version"]) != FORMAT_VERSION:
            raise CachelabError(f"{path}: format version {int(files['version'])}, this cachelab reads {FORMAT_VERSION}")
        meta = {k[5:]: v for k, v in files.items() if k.startswith("meta_")}
        try:
            return cls(files["keys"], files["step_offsets"], int(files["row_bytes"]),
                       tuple(int(x) for x in files["layers"]), meta,
                       tuple(str(x) for x in files.get("domains", ())))
        except CachelabError as exc:
            raise CachelabError(f"{path}: {exc}") from None


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _first_seen_ids(keys, bits, ids, uniq):
    """One pass: a new key gets the next id; an open-addressing table of int32 ids (4 bytes a
    slot) finds a known one. Returns the number of distinct keys."""
    mask = (1 << bits) - 1
    table = np.full(1 << bits, -1, np.int32)
    shift = np.uint64(64 - bits)
    n = 0
    for i in range(keys.size):
        k = keys[i]
        h = np.int64((np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
        while True:
            j = table[h]
            if j == -1:
                table[h] = n
                uniq[n] = k
                ids[i] = n
                n += 1
                break
            if uniq[j] == k:
                ids[i] = j
                break
            h = (h + 1) & mask
    return n


def compact(keys) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids ``0..U-1`` in first-occurrence order: ``(ids, unique_keys)`` with
    ``unique_keys[ids] == keys``.

    One compiled pass over a hash table (load <= 1/2); ids depend only on the order of
    first occurrences, not on key values. Several times faster than
    ``np.unique(..., return_inverse=True)`` on 10 M keys.
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
    if keys.size >= 2**31:
        raise CachelabError(f"{keys.size:,} keys in one compaction: more than the 2^31 dense ids a policy can index")
    ids = np.empty(keys.size, np.int64)
    uniq = np.empty(keys.size, np.int64)
    bits = max(4, int(np.ceil(np.log2(max(keys.size, 1)))) + 1)
    n = _first_seen_ids(keys, bits, ids, uniq)
    return ids, uniq[:n].copy()


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _dedup_kernel(ids, step_offsets, num_keys, distinct, distinct_offsets, inverse):
    last_step = np.full(num_keys, -1, np.int64)
    slot = np.empty(num_keys, np.int64)
    n = 0
    for s in range(step_offsets.size - 1):
        for i in range(step_offsets[s], step_offsets[s + 1]):
            k = ids[i]
            if last_step[k] != s:
                last_step[k] = s
                slot[k] = n
                distinct[n] = k
                n += 1
            inverse[i] = slot[k]
        distinct_offsets[s + 1] = n
    return n


@dataclass(frozen=True, slots=True)
class StepDedup:
    """Each step's distinct keys in first-occurrence order, and where every lookup went.

    ``keys[offsets[s]:offsets[s+1]]`` are step ``s``'s distinct keys; lookup ``i`` is
    distinct entry ``inverse[i]``; ``counts[j]`` lookups share distinct entry ``j``.
    """

    keys: np.ndarray
    offsets: np.ndarray
    inverse: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        return np.bincount(self.inverse, minlength=self.keys.size)


def dedup_steps(ids, step_offsets, num_keys: int | None = None) -> StepDedup:
    """Distinct keys per step for dense ``ids`` (from ``compact``), one compiled pass."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    offs = np.ascontiguousarray(step_offsets, dtype=np.int64)
    if num_keys is None:
        num_keys = int(ids.max()) + 1 if ids.size else 1
    distinct = np.empty(ids.size, np.int64)
    d_offs = np.zeros(offs.size, np.int64)
    inverse = np.empty(ids.size, np.int64)
    n = _dedup_kernel(ids, offs, num_keys, distinct, d_offs, inverse)
    return StepDedup(distinct[:n].copy(), d_offs, inverse)
