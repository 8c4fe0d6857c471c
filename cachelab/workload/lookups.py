"""The lookup stream: every Engram row read, grouped into serving steps.

A stream is CSR-shaped: ``keys[step_offsets[s]:step_offsets[s+1]]`` are the lookups of step
``s``. A key is a global row key ``(layer_index << 32) | row``, so the two (or more) layer
tables share one key space and a row keeps its table identity (the SSD page model needs it).
Optional per-lookup metadata (column, request, position, phase, domain) rides along for
predictors and reports; the engine itself reads only keys and steps.

Steps are the unit of deduplication: a serving step gathers its rows at once, so a row
looked up twice in one step is fetched once (``dedup_steps``, in ``cachelab.workload.compaction``,
whose names this module also gives its long-standing importers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.paths import replacing

__all__ = ["CHUNK", "COMPARED", "DECODE", "FORMAT_VERSION", "LAYER_SHIFT", "META_DTYPES", "PREFILL", "ROW_MASK",
           "LookupStream", "first_tokens", "global_key", "split_key"]

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


COMPARED = 1 << 16  # step offsets compared at a time by ``_rising``
CHUNK = 1 << 20  # lookups given their token ids at a time by ``with_tokens``


def _rising(offsets: np.ndarray) -> bool:
    """Whether ``offsets`` never fall, ``COMPARED`` at a time: a whole-array comparison made an
    array of a byte a step (a key trace's 10 MB of fresh pages for 10 M keys); a slice's reuses
    the allocator's memory."""
    parts = (offsets[lo:lo + COMPARED + 1] for lo in range(0, offsets.size - 1, COMPARED))
    return not any(np.any(part[1:] < part[:-1]) for part in parts)


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
        layout: the signature of the Engram layout that addressed the rows
            (``cachelab.learning.streams.layout_signature``), saved with the stream so that it
            is checked where it is read as a layout; None: not recorded (a key trace, or a
            stream saved before layouts were).
        ids: where the keys are ranks of uint64 ids past int64 (a key trace of hashed ids,
            ``keytrace.dense_ids``), the id each key stands for (``ids[key]``), which a policy
            that hashes row ids is given (``raw_keys``), as libCacheSim hashes them; None: each
            key is its own id.
    """

    keys: np.ndarray
    step_offsets: np.ndarray
    row_bytes: int
    layers: tuple = (0,)
    meta: Mapping[str, np.ndarray] = field(default_factory=dict)
    domains: tuple[str, ...] = ()
    layout: dict | None = None
    ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        keys = np.ascontiguousarray(self.keys, dtype=np.int64)
        offs = np.ascontiguousarray(self.step_offsets, dtype=np.int64)
        if keys.ndim != 1:
            raise CachelabError(f"keys must be one-dimensional, got shape {keys.shape}")
        if offs.ndim != 1 or offs.size < 1 or offs[0] != 0 or offs[-1] != keys.size or not _rising(offs):
            raise CachelabError(f"step_offsets must rise from 0 to {keys.size} (the lookup count), "
                                f"got {offs[:5].tolist()}...{offs[-2:].tolist()}")
        if keys.size and keys.min() < 0:
            raise CachelabError(f"keys must be non-negative, found {int(keys.min())}")
        if int(self.row_bytes) < 1:
            raise CachelabError(f"row_bytes must be positive, got {self.row_bytes}")
        if self.layout is not None and not isinstance(self.layout, dict):
            raise CachelabError(f"layout must be an Engram layout's signature (an object), got {self.layout!r:.80}")
        meta = {}
        for name, arr in self.meta.items():
            arr, given = np.ascontiguousarray(arr, dtype=META_DTYPES.get(name)), np.asarray(arr)
            if arr.dtype != given.dtype and arr.shape == given.shape and not np.array_equal(arr, given):
                bad = given.reshape(-1)[np.flatnonzero(arr.reshape(-1) != given.reshape(-1))[0]]
                info = np.iinfo(arr.dtype)
                raise CachelabError(f"meta field {name!r} holds {bad.item()!r}, not an integer that its {arr.dtype} "
                                    f"holds ({info.min}..{info.max}); it would be stored as another value")
            if arr.shape != keys.shape:
                raise CachelabError(f"meta field {name!r} has shape {arr.shape}, expected {keys.shape}")
            meta[name] = arr
        if self.ids is not None:
            ids = np.ascontiguousarray(self.ids)
            if ids.ndim != 1 or ids.dtype != np.uint64 or (keys.size and keys.max() >= ids.size):
                raise CachelabError(f"ids must be a uint64 id for each key 0..{int(keys.max()) if keys.size else 0}, "
                                    f"got {ids.dtype} of shape {ids.shape}")
            object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "step_offsets", offs)
        object.__setattr__(self, "row_bytes", int(self.row_bytes))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "meta", meta)
        object.__setattr__(self, "domains", tuple(self.domains))

    def check_tables(self, config, source: str, remedy: str) -> None:
        """Refuse to read this stream as ``config``'s rows (an ``EngramConfig``) when its table
        count or row size differ: its keys then address other tables. The decoder layers that
        read the tables are not compared (a live model moves them; the rows stay). ``source``
        names the stream (a flag and path) and ``remedy`` says what to give instead."""
        if (len(self.layers), self.row_bytes) != (len(config.layers), config.row_bytes):
            raise CachelabError(f"{source} has {len(self.layers)} table layers of {self.row_bytes}-byte rows, but "
                                f"layout {config.name!r}, which it is read as, has {len(config.layers)} of "
                                f"{config.row_bytes} bytes: {remedy}")

    @property
    def num_steps(self) -> int:
        return self.step_offsets.size - 1

    @property
    def num_lookups(self) -> int:
        return self.keys.size

    def raw_keys(self, keys: np.ndarray) -> np.ndarray:
        """Each of ``keys``' row id as a policy that hashes ids takes it (``needs_raw_keys``): the
        uint64 id a rank stands for, its 64 bits as int64 (``ids``), else the key itself."""
        return keys if self.ids is None else self.ids[keys].view(np.int64)

    @classmethod
    def from_keys(cls, keys, row_bytes: int = 1, ids: np.ndarray | None = None) -> "LookupStream":
        """A plain key trace: every request is its own step (no deduplication); ``ids`` as the field."""
        keys = np.asarray(keys, dtype=np.int64)
        return cls(keys, np.arange(keys.size + 1, dtype=np.int64), row_bytes, ids=ids)

    @classmethod
    def from_rows(cls, rows, token_step, row_bytes: int, layers: Sequence[int],
                  token_meta: Mapping[str, np.ndarray] | None = None,
                  domains: Sequence[str] = (), *, meta: bool = True) -> "LookupStream":
        """Flatten addresser rows ``[T, L, C]`` in token -> layer -> column order.

        Args:
            rows: int32 row ids per token, layer index and column.
            token_step: the (non-decreasing) step of each token; steps may be empty.
            token_meta: per-token arrays (request, position, phase, domain, ...), repeated to
                every lookup of the token; ``column`` is added from the column index.
            meta: False: keys and steps alone, no per-lookup metadata (``token_meta`` and
                ``domains`` unused), for a replay, which reads nothing else.
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
        if n_cols > np.iinfo(META_DTYPES["column"]).max + 1:
            raise CachelabError(f"rows has {n_cols} columns per layer; the column metadata holds at most "
                                f"{np.iinfo(META_DTYPES['column']).max + 1} ((max_ngram - 1) * heads)")
        keys = np.empty(rows.shape, np.int64)  # global_key in place: its int64 temporaries were 16 B a lookup
        keys[...] = rows
        for layer in range(1, n_layers):
            keys[:, layer, :] |= layer << LAYER_SHIFT
        keys = keys.reshape(-1)
        per_token = n_layers * n_cols
        steps = int(token_step[-1]) + 1 if t else 0
        counts = np.bincount(token_step, minlength=steps) * per_token
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if not meta:
            return cls(keys, offsets, row_bytes, tuple(layers))
        lookup_meta = {"column": np.tile(np.arange(n_cols, dtype=np.int8), t * n_layers)}
        for name, arr in (token_meta or {}).items():
            arr = np.asarray(arr)
            if arr.shape != (t,):
                raise CachelabError(f"token_meta field {name!r} has shape {arr.shape}, expected ({t},)")
            lookup_meta[name] = np.repeat(arr, per_token)
        return cls(keys, offsets, row_bytes, tuple(layers), lookup_meta, tuple(domains))

    @classmethod
    def from_sequences(cls, addresser, sequences: Sequence[np.ndarray], tokens_per_step: int | None = 1,
                       prompt_lengths: Sequence[int] | None = None,
                       domains: Sequence[str] | None = None, *, meta: bool = True) -> "LookupStream":
        """Offline replay of whole requests, one request at a time, in the order given.

        Step semantics: a request's prompt (the first ``prompt_lengths[i]`` tokens; all of
        them by default) is prefilled in chunks of ``tokens_per_step`` tokens, each chunk one
        step (``None``: the whole prompt in one step); every later token but the last is a
        decode step of one token. The last output token is sampled by the step before and the
        request ends: serving never feeds it back, so it has no lookups (as in
        ``cachelab.workload.steps.scheduled_stream``). A step never mixes requests; a serving
        scheduler that batches requests builds its steps with ``from_rows`` instead.

        Args:
            addresser: a ``cachelab.engram.Addresser``.
            sequences: raw token ids per request.
            domains: an optional domain label per request (stored as codes + names).
            meta: False: keys and steps alone (``from_rows``).
        """
        if tokens_per_step is not None and tokens_per_step < 1:
            raise CachelabError(f"tokens_per_step must be at least 1 (or None), got {tokens_per_step}")
        full = np.array([len(s) for s in sequences], dtype=np.int64)
        prompt = full if prompt_lengths is None else np.asarray(prompt_lengths, dtype=np.int64)
        if prompt.shape != full.shape or np.any((prompt < 0) | (prompt > full)):
            raise CachelabError("prompt_lengths must give, per sequence, a length between 0 and its token count")
        lengths = full - (full > prompt)  # the tokens fed: every one but an output's last
        n = int(lengths.sum())
        seq_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = (np.concatenate([np.asarray(s[:k], dtype=np.int64) for s, k in zip(sequences, lengths.tolist())])
                  if n else np.zeros(0, np.int64))
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
        if not meta:
            return cls.from_rows(rows, token_step, addresser.config.row_bytes, addresser.config.layers, meta=False)
        token_meta = {"request": request, "position": position, "phase": phase}
        return cls.from_request_rows(addresser.config, rows, token_step, token_meta, domains, lengths.size)

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
            if labels.size > np.iinfo(META_DTYPES["domain"]).max + 1:
                raise CachelabError(f"{labels.size} distinct domains; the domain metadata holds at most "
                                    f"{np.iinfo(META_DTYPES['domain']).max + 1}")
            meta["domain"] = codes.astype(np.int16)[meta["request"]]
            names = tuple(str(x) for x in labels)
        return cls.from_rows(rows, token_step, config.row_bytes, config.layers, meta, names)

    def with_tokens(self, addresser, sequences: Sequence[np.ndarray]) -> "LookupStream":
        """This stream with each lookup's compressed token id (``meta["token"]``, which learned
        policies' features read), for a stream of ``sequences`` (``from_sequences``' requests)."""
        starts = np.concatenate([[0], np.cumsum([len(s) for s in sequences])[:-1]]).astype(np.int64)
        compressed = addresser.compress(np.concatenate(sequences))
        request, position = self.meta["request"], self.meta["position"]
        token = np.empty(self.keys.size, np.int32)
        for lo in range(0, token.size, CHUNK):  # whole, its int64 index and ids were 24 B a lookup
            token[lo:lo + CHUNK] = compressed[starts[request[lo:lo + CHUNK]] + position[lo:lo + CHUNK]]
        return replace(self, meta={**self.meta, "token": token})

    @classmethod
    def from_texts(cls, addresser, texts: Sequence[str], request_tokens: int | None = None,
                   tokens_per_step: int | None = 1, max_tokens: int | None = None,
                   domains: Sequence[str] | None = None) -> "LookupStream":
        """Real text as requests: each text tokenized (BOS first) and, if ``request_tokens``
        is given, cut into requests of that many tokens; at most ``max_tokens`` tokens in all.
        Steps as in ``from_sequences`` (all tokens are prompt tokens)."""
        from cachelab.engram import encode

        # each refused by name: request_tokens = -5 cut every text into no request at all (an empty
        # stream), max_tokens = -2 kept a text less its last 2 tokens, a short domains an IndexError
        if request_tokens is not None and request_tokens < 1:
            raise CachelabError(f"request_tokens must be at least 1 (or None: a text is one request), got {request_tokens}")
        if max_tokens is not None and max_tokens < 0:
            raise CachelabError(f"max_tokens must be at least 0 (or None: every token), got {max_tokens}")
        if domains is not None and len(domains) != len(texts):
            raise CachelabError(f"domains has {len(domains)} labels for {len(texts)} texts")
        seqs, labels = [], []
        for i, ids in enumerate(encode(list(texts), addresser.config.tokenizer, bos=True)):
            size = request_tokens or max(ids.size, 1)
            parts = [ids[lo:lo + size] for lo in range(0, ids.size, size)]
            seqs += parts
            labels += [domains[i]] * len(parts) if domains is not None else []
        if max_tokens is not None:
            seqs = first_tokens(seqs, max_tokens)
            labels = labels[:len(seqs)]
        return cls.from_sequences(addresser, seqs, tokens_per_step, domains=labels if domains is not None else None)

    def save(self, path: str | Path) -> Path:
        """Write the stream as one ``.npz`` (uncompressed: loads at memory speed)."""
        path = Path(path)
        path = path if path.suffix == ".npz" else path.with_name(path.name + ".npz")
        arrays = {f"meta_{k}": v for k, v in self.meta.items()}
        if self.layout is not None:
            arrays["layout"] = np.asarray(json.dumps(self.layout))
        if self.ids is not None:
            arrays["ids"] = self.ids
        with replacing(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, version=np.int64(FORMAT_VERSION), keys=self.keys, step_offsets=self.step_offsets,
                     row_bytes=np.int64(self.row_bytes), layers=np.asarray(self.layers, dtype=np.int64),
                     domains=np.asarray(self.domains, dtype=str), **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path, meta: bool = True) -> "LookupStream":
        """Read a stream written by ``save``; errors name the file and the field at fault. ``meta``
        False: its keys and steps alone, the metadata not read (``from_rows``)."""
        path = Path(path)
        if not path.is_file():
            raise CachelabError(f"lookup stream not found: {path}")
        try:
            with np.load(path, allow_pickle=False) as z:
                files = {k: z[k] for k in z.files if meta or not k.startswith("meta_")}
        except Exception as exc:  # zipfile / format errors: report, don't trace back
            raise CachelabError(f"{path} is not a readable .npz lookup stream: {exc}") from None
        for name in ("version", "keys", "step_offsets", "row_bytes", "layers"):
            if name not in files:
                raise CachelabError(f"{path}: field {name!r} missing; not a cachelab lookup stream")
        if int(files["version"]) != FORMAT_VERSION:
            raise CachelabError(f"{path}: format version {int(files['version'])}, this cachelab reads {FORMAT_VERSION}")
        meta = {k[5:]: v for k, v in files.items() if k.startswith("meta_")}
        try:
            layout = json.loads(str(files["layout"])) if "layout" in files else None
        except ValueError as exc:
            raise CachelabError(f"{path}: field 'layout' is not JSON: {exc}") from None
        try:
            return cls(files["keys"], files["step_offsets"], int(files["row_bytes"]),
                       tuple(int(x) for x in files["layers"]), meta,
                       tuple(str(x) for x in files.get("domains", ())), layout, files.get("ids"))
        except CachelabError as exc:
            raise CachelabError(f"{path}: {exc}") from None


def first_tokens(sequences: Sequence[np.ndarray], max_tokens: int) -> list[np.ndarray]:
    """The first ``max_tokens`` tokens of ``sequences`` taken in order: each sequence that starts
    before the limit, the one that crosses it cut there (all of them where they hold fewer)."""
    ends = np.cumsum([len(s) for s in sequences])
    keep = min(int(np.searchsorted(ends, max_tokens)) + 1, len(sequences))
    out = list(sequences[:keep])
    if out and ends[keep - 1] > max_tokens:
        out[-1] = out[-1][:len(out[-1]) - int(ends[keep - 1] - max_tokens)]
    return out
