"""The paged KV cache: torch tensors of KV blocks, addressed through the prefix cache's block tables.

Memory is ``[layers, num_blocks, block_size, kv_heads, head_dim]`` for keys and for values;
block ``b`` of the tensors is block ``b`` of the scheduler's ``BlockPrefixCache``, so when the
pool hands a new request a cached block, the keys and values of that prefix are already here
and its positions are not computed (vLLM's layout and protocol). ``StepBatch`` is one step's
input laid out for the model: flat tokens, their cache slots, and per sequence its block table.
``OpClock`` times the step's operators (the paged attention, the GEMMs) around their torch
calls, for the per-step log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cachelab.errors import CachelabError


class PagedKVCache:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens, per layer."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str = "cpu"):
        if num_blocks < 1:
            raise CachelabError(f"the KV cache needs at least one block, got {num_blocks}")
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values [T, kv_heads, head_dim] at flat slots [T]."""
        self.k[layer].view(-1, *k.shape[1:])[slots] = k.to(self.k.dtype)
        self.v[layer].view(-1, *v.shape[1:])[slots] = v.to(self.v.dtype)

    def gather(self, layer: int, tables: torch.Tensor, lengths: torch.Tensor):
        """Keys, values [B, kv_heads, L, head_dim] of the blocks ``tables`` [B, blocks] and the
        mask [B, 1, 1, L] of the first ``lengths[b]`` positions of each sequence."""
        b, n = tables.shape
        keys = self.k[layer][tables].view(b, n * self.block_size, *self.k.shape[-2:]).transpose(1, 2)
        values = self.v[layer][tables].view(b, n * self.block_size, *self.v.shape[-2:]).transpose(1, 2)
        mask = torch.arange(n * self.block_size, device=tables.device)[None, :] < lengths[:, None]
        return keys, values, mask[:, None, None, :]


class OpClock:
    """Seconds one step spent in each operator family, timed around the torch calls on the
    calling thread: exact on the CPU, where torch runs an operator to its end before returning
    (on a GPU the calls only launch kernels; use ``NO_CLOCK`` there). ``attention_s``: the
    paged attention (the KV-cache write, the block gather, the mask and the scaled dot-product
    attention) of every layer; ``gemm_s``: the weight GEMMs (``qkv``, ``out``, the MLP's
    ``gate_up`` and ``down``, Engram's ``wkv``, the output head). The model calls
    ``t = clock.now()`` before an operator and ``t = clock.attention(t)`` / ``clock.gemm(t)``
    after it (each adds the time since ``t`` and returns the new time)."""

    __slots__ = ("attention_s", "gemm_s")

    def __init__(self):
        self.attention_s = self.gemm_s = 0.0

    now = staticmethod(time.perf_counter)

    def attention(self, since: float) -> float:
        t = time.perf_counter()
        self.attention_s += t - since
        return t

    def gemm(self, since: float) -> float:
        t = time.perf_counter()
        self.gemm_s += t - since
        return t


class _NoClock:
    """An ``OpClock`` that reads no clock (the default: nothing timed, nothing kept)."""

    __slots__ = ()

    def now(self) -> float:
        return 0.0

    def attention(self, since: float) -> float:
        return 0.0

    gemm = attention


NO_CLOCK = _NoClock()


@dataclass
class StepBatch:
    """One step's tokens for the model (see module doc); ``prefills`` holds per chunk its flat
    token range, block table and positions; decodes are batched."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    decode_idx: torch.Tensor
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefills: list
    sample_idx: torch.Tensor
    clock: OpClock | _NoClock = NO_CLOCK  # where the model adds its operators' times

    @classmethod
    def build(cls, chunks: list[np.ndarray], starts: list[int], tables: list[np.ndarray], samples: list[bool],
              block_size: int, device: str = "cpu", clock: OpClock | _NoClock = NO_CLOCK) -> "StepBatch":
        """From each sequence's new token ids ``chunks[i]`` at positions ``starts[i]`` on, its
        block table, and whether its last position is sampled; ``clock`` times its operators."""
        lens = np.array([c.size for c in chunks], np.int64)
        ends = np.cumsum(lens)
        firsts = ends - lens
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
        owner = np.repeat(np.arange(len(chunks)), lens)
        width = max(t.size for t in tables)
        padded = np.zeros((len(tables), width), np.int64)  # block 0 pads; the mask hides it
        for i, t in enumerate(tables):
            padded[i, : t.size] = t
        slots = padded[owner, positions // block_size] * block_size + positions % block_size

        def tensor(a):
            return torch.as_tensor(np.asarray(a, np.int64), device=device)

        dec = np.flatnonzero(lens == 1)
        dec_lens = positions[firsts[dec]] + 1
        dec_width = int(-(-dec_lens.max() // block_size)) if dec.size else 1
        prefills = [(int(firsts[i]), int(ends[i]), tensor(tables[i]), tensor(positions[firsts[i]:ends[i]]))
                    for i in np.flatnonzero(lens > 1)]
        return cls(input_ids=tensor(np.concatenate(chunks)), positions=tensor(positions), slots=tensor(slots),
                   decode_idx=tensor(firsts[dec]), decode_tables=tensor(padded[dec, :dec_width]),
                   decode_lens=tensor(dec_lens), prefills=prefills,
                   sample_idx=tensor(ends[np.asarray(samples, bool)] - 1), clock=clock)
