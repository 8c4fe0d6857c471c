"""Token ids -> Engram row ids, bit-exact with DeepSeek's reference.

One compiled kernel serves prefill and decode: it walks each sequence chunk with a small
look-back history (the last N-1 compressed ids, -1 where the look-back is blocked by a
sequence start or a DEAD token), so a sequence fed in one piece, in chunks or token by token
gives the same rows. The modulo by each head's prime is a multiply by its precomputed
reciprocal plus one exact integer correction: for mix < 2^63 the float quotient is off by
less than 3 * 2^10 / prime, so at most one for a prime above ``_EXACT_BELOW``; a smaller
prime (a custom layout's tiny table) takes the integer ``%`` instead.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.engram.config import EngramConfig, get_preset
from cachelab.engram.vocab import compressed_map
from cachelab.errors import CachelabError

_EXACT_BELOW = 1 << 16  # primes below this take the integer modulo (see the module doc)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _address_chunks(cids, dead, chunk_offsets, chunk_seq, history, mults, primes, inv_primes,
                    offsets, pad, out):
    """Fill ``out[t, layer, column]`` for every position of every chunk; update ``history``."""
    n_layers, n_max = mults.shape
    n_cols = primes.shape[1]
    heads = n_cols // (n_max - 1)
    tau = np.empty(n_max, np.int64)
    for c in range(chunk_offsets.size - 1):
        hist = history[chunk_seq[c]]
        for t in range(chunk_offsets[c], chunk_offsets[c + 1]):
            blocked = dead[t]
            tau[0] = pad if blocked else cids[t]
            for k in range(1, n_max):
                if not blocked and hist[k - 1] < 0:
                    blocked = True
                tau[k] = pad if blocked else hist[k - 1]
            for layer in range(n_layers):
                acc = tau[0] * mults[layer, 0]
                for k in range(1, n_max):
                    acc ^= tau[k] * mults[layer, k]
                    facc = np.float64(acc)
                    base = (k - 1) * heads
                    for h in range(heads):
                        j = base + h
                        p = primes[layer, j]
                        if p < _EXACT_BELOW:
                            r = acc % p
                        else:
                            r = acc - np.int64(facc * inv_primes[layer, j]) * p
                            if r < 0:
                                r += p
                            elif r >= p:
                                r -= p
                        out[t, layer, j] = offsets[layer, j] + r
            for k in range(n_max - 2, 0, -1):
                hist[k] = hist[k - 1]
            if n_max > 1:
                hist[0] = -1 if dead[t] else cids[t]


class Addresser:
    """Row ids for one Engram layout.

    ``rows`` addresses many variable-length sequences at once (a flat token array plus
    offsets); ``stream`` keeps per-sequence look-back so decode can go token by token.
    Output is int32 ``[positions, layers, (N-1)*H]``, column order order-major then head.
    """

    def __init__(self, config: EngramConfig | str):
        self.config = get_preset(config) if isinstance(config, str) else config
        cfg = self.config
        self.cmap = compressed_map(cfg.tokenizer)
        size = int(self.cmap.max()) + 1
        if size != cfg.compressed_vocab:
            raise CachelabError(
                f"tokenizer {cfg.tokenizer!r} compresses to V = {size}, but the layout "
                f"{cfg.name!r} expects compressed_vocab = {cfg.compressed_vocab}"
            )
        if int(cfg.table_rows.max()) >= 2**31:
            raise CachelabError(f"layout {cfg.name!r} has a table over 2^31 rows; int32 row ids cannot hold it")
        if not 0 <= cfg.pad_id < self.cmap.size:
            raise CachelabError(f"pad_id {cfg.pad_id} is outside the vocabulary of {self.cmap.size} ids")
        self.pad = np.int64(self.cmap[cfg.pad_id])
        self._mults = cfg.multiplier_array
        self._primes = cfg.primes
        self._inv = 1.0 / cfg.primes.astype(np.float64)
        self._offsets = cfg.offsets

    @property
    def history_len(self) -> int:
        return self.config.max_ngram - 1

    def compress(self, token_ids) -> np.ndarray:
        """Raw ids -> compressed ids, refusing any id outside the vocabulary by value and position."""
        ids = np.asarray(token_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise CachelabError(f"token ids must be integers, got dtype {ids.dtype}")
        # checked in the ids' own dtype: a uint64 id past 2^63 is named as given, not as the
        # negative int64 a cast first made of it
        bad = np.flatnonzero((ids < 0) | (ids >= self.cmap.size))
        if bad.size:
            pos = np.unravel_index(int(bad[0]), ids.shape)
            raise CachelabError(
                f"token id {ids[pos].item()} at position {int(pos[0]) if ids.ndim == 1 else tuple(map(int, pos))} "
                f"is outside the vocabulary [0, {self.cmap.size}) of {self.config.tokenizer!r}"
            )
        return self.cmap[ids.astype(np.int64, copy=False)].astype(np.int64)

    def _run(self, token_ids, chunk_offsets, chunk_seq, history, dead) -> np.ndarray:
        cids = self.compress(token_ids)
        n = cids.size
        dead_arr = np.zeros(n, np.bool_) if dead is None else np.asarray(dead, dtype=np.bool_)
        if dead_arr.shape != (n,):
            raise CachelabError(f"dead mask has shape {dead_arr.shape}, expected ({n},)")
        out = np.empty((n, len(self.config.layers), self.config.columns), dtype=np.int32)
        _address_chunks(cids, dead_arr, chunk_offsets, chunk_seq, history, self._mults,
                        self._primes, self._inv, self._offsets, self.pad, out)
        return out

    def rows(self, token_ids, offsets=None, dead=None) -> np.ndarray:
        """One-shot prefill of sequences ``token_ids[offsets[i]:offsets[i+1]]``.

        Args:
            token_ids: flat raw token ids.
            offsets: sequence boundaries (len = sequences + 1); one sequence if None.
            dead: optional bool mask of DEAD positions (latching look-back block, §2.3).
        """
        token_ids = _flat_ids(token_ids)
        n = token_ids.size
        offs = _check_offsets(np.array([0, n]) if offsets is None else offsets, n)
        history = np.full((offs.size - 1, self.history_len), -1, dtype=np.int64)
        return self._run(token_ids, offs, np.arange(offs.size - 1, dtype=np.int64), history, dead)

    def stream(self, num_sequences: int) -> "AddressStream":
        return AddressStream(self, num_sequences)


class AddressStream:
    """Incremental addressing: chunks of any sequences, in order per sequence."""

    def __init__(self, addresser: Addresser, num_sequences: int):
        self.addresser = addresser
        self.history = np.full((num_sequences, addresser.history_len), -1, dtype=np.int64)

    def feed(self, token_ids, offsets=None, seq=None, dead=None) -> np.ndarray:
        """Address the next chunk of each listed sequence.

        Args:
            token_ids: flat raw ids of the chunks; offsets: chunk boundaries.
            seq: the sequence index of each chunk (default 0..chunks-1).
        """
        token_ids = _flat_ids(token_ids)
        n = token_ids.size
        offs = _check_offsets(np.array([0, n]) if offsets is None else offsets, n)
        chunks = offs.size - 1
        seq_idx = np.arange(chunks, dtype=np.int64) if seq is None else _indices("seq", seq)
        if seq_idx.shape != (chunks,) or (chunks and (seq_idx.min() < 0 or seq_idx.max() >= len(self.history))):
            raise CachelabError(f"seq must give one index in [0, {len(self.history)}) per chunk")
        if np.unique(seq_idx).size != chunks:
            raise CachelabError("seq lists a sequence twice in one feed; feed its chunks in order")
        return self.addresser._run(token_ids, offs, seq_idx, self.history, dead)

    def reset(self, seq: int) -> None:
        """Start sequence ``seq`` afresh (a new request in a reused slot)."""
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < len(self.history):
            # a negative index reset another sequence (-1: the last), without a word
            raise CachelabError(f"seq {seq!r} is not a sequence index in [0, {len(self.history)})")
        self.history[seq] = -1


def _flat_ids(token_ids) -> np.ndarray:
    """Token ids as one flat array; several sequences are concatenated and told apart by offsets
    (a ``[batch, seq]`` array went on to the compiled kernel, which failed with a Numba typing error)."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise CachelabError(f"token ids must be one flat array (sequences concatenated, told apart by offsets), "
                            f"got shape {ids.shape}")
    return ids


def _indices(name: str, values) -> np.ndarray:
    """``values`` as int64, refusing any that is not a whole number: a cast truncated 1.7 to 1,
    silently moving a sequence boundary (offsets) or a chunk to another sequence (seq)."""
    given = np.asarray(values)
    if given.dtype.kind not in "iubf":
        raise CachelabError(f"{name} must be integers, got dtype {given.dtype}")
    if given.dtype.kind == "f":
        flat = given.reshape(-1)
        bad = flat[~(np.isfinite(flat) & (flat == np.floor(flat)))]
        if bad.size:
            raise CachelabError(f"{name} must be whole numbers, got {bad[0]}")
    return given.astype(np.int64)


def _check_offsets(offsets, n: int) -> np.ndarray:
    offs = _indices("offsets", offsets)
    if offs.ndim != 1 or offs.size < 1 or offs[0] != 0 or offs[-1] != n or np.any(np.diff(offs) < 0):
        raise CachelabError(f"offsets must rise from 0 to the token count {n}, got {offs[:8].tolist()}...")
    return offs
