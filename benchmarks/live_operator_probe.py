"""The live engine's operators profiled one at a time (Vidur's way of identifying a latency
model's terms): the paged attention at chosen (new tokens, context) shapes, and what the step
log's per-operator clock costs a step.

1. Attention: one layer's paged attention of the tiny preset (the KV-cache write, the block
   gather, the mask and the scaled dot-product attention, the code the engine runs), timed by
   its ``OpClock`` for a prefill chunk of ``q`` new tokens after ``context - q`` cached ones,
   and for a batch of decodes. Per shape: the median time, the (query, key) pairs a causal
   kernel computes (the triangle the latency model charges: each query attends to the positions
   up to its own) and the pairs the masked kernel computes (every query against every gathered
   position, ``q x context`` rounded up to whole blocks), and a least-squares line through each
   count with its worst relative error: the count whose line fits is the one the kernel pays.
2. The clock: the time of one ``now()`` + ``gemm()`` pair, times the reads a step makes (half a
   pair each, counted in a forward of the tiny preset), and
   whole forwards of the tiny model with the clock against without it (alternated).
3. GEMM rows: the step's GEMM time (``OpClock.gemm_s`` over a whole forward) for a chunk of M
   new tokens, M around 256, per row against M = 256: the latency model charges GEMMs linearly
   in the rows, and the CPU's BF16 kernels may not be linear at row counts off a multiple of 8
   (a 256-token chunk with three decode rows beside it is M = 259).

    .venv/bin/python benchmarks/live_operator_probe.py [--threads 1] [--reps 200] [--section gemm-rows]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import time

import numpy as np
import torch

from cachelab.live.config import PRESETS
from cachelab.live.kv_cache import NO_CLOCK, OpClock, PagedKVCache, StepBatch
from cachelab.live.model import build_model

BLOCK = 16
PREFILL_SHAPES = ((16, 272), (64, 320), (128, 256), (128, 384), (256, 256), (256, 512), (512, 512), (128, 1024))
DECODE_SHAPES = ((1, 272), (4, 272), (8, 272), (4, 1024))  # (sequences, context)


def batch_for(q: int, context: int, sequences: int = 1, clock=NO_CLOCK) -> StepBatch:
    """``sequences`` sequences each computing positions ``[context - q, context)`` on their own blocks."""
    blocks = -(-context // BLOCK)
    tables = [np.arange(i * blocks, (i + 1) * blocks) for i in range(sequences)]
    ids = np.random.default_rng(q).integers(100, 90_000, (sequences, q))
    return StepBatch.build(list(ids), [context - q] * sequences, tables, [True] * sequences, BLOCK, clock=clock)


def attention_profile(reps: int) -> None:
    cfg = PRESETS["tiny"]
    layer = build_model(cfg).layers[0].attn
    kv = PagedKVCache(cfg.layers, 8 * 64, BLOCK, cfg.kv_heads, cfg.head_dim, getattr(torch, cfg.dtype))
    rows = []
    for kind, shapes in (("prefill", PREFILL_SHAPES), ("decode", DECODE_SHAPES)):
        for a, context in shapes:
            q, seqs = (a, 1) if kind == "prefill" else (1, a)
            x = torch.randn(q * seqs, cfg.hidden, dtype=getattr(torch, cfg.dtype))
            pos = torch.arange(context - q, context).repeat(seqs)
            inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
            angles = torch.outer(pos.double(), inv)
            rope = (angles.cos().float(), angles.sin().float())
            times = []
            with torch.inference_mode():
                for i in range(reps + 5):
                    clock = OpClock()
                    layer(x, batch_for(q, context, seqs, clock), kv, rope)
                    if i >= 5:
                        times.append(clock.attention_s)
            padded = -(-context // BLOCK) * BLOCK
            tri = seqs * (q * (context - q) + q * (q + 1) / 2)
            rows.append((kind, q, seqs, context, float(np.median(times)), tri, float(seqs * q * padded)))
    print("| kind | new tokens x sequences | context | attention us | causal pairs | masked pairs (blocks) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, q, seqs, context, t, tri, rect in rows:
        print(f"| {kind} | {q} x {seqs} | {context} | {t * 1e6:.1f} | {tri:.0f} | {rect:.0f} |")
    prefill = [r for r in rows if r[0] == "prefill"]
    y = np.array([r[4] for r in prefill])
    for label, col in (("causal pairs (the latency model's)", 5), ("masked pairs (every gathered position)", 6)):
        x = np.array([r[col] for r in prefill])
        coef = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)[0]
        err = (np.column_stack([np.ones_like(x), x]) @ coef - y) / y
        print(f"prefill attention = {coef[0] * 1e6:.1f} us + {coef[1] * 1e9:.2f} ns x {label}: "
              f"worst relative error {np.abs(err).max():.1%}, RMS {np.sqrt((err ** 2).mean()):.1%}")


class CountingClock(OpClock):
    """An ``OpClock`` that counts its clock reads (``now``, ``attention``, ``gemm``: one each), so
    the reads a step makes are counted in a forward, not derived from a list of operators."""

    __slots__ = ("reads",)

    def __init__(self):
        super().__init__()
        self.reads = 0

    def now(self) -> float:
        self.reads += 1
        return time.perf_counter()

    def attention(self, since: float) -> float:
        self.reads += 1
        return super().attention(since)

    def gemm(self, since: float) -> float:
        self.reads += 1
        return super().gemm(since)


def clock_overhead(reps: int) -> None:
    clock = OpClock()
    n = 100_000
    t = time.perf_counter()
    for _ in range(n):
        clock.gemm(clock.now())
    pair = (time.perf_counter() - t) / n
    cfg = PRESETS["tiny"]
    model = build_model(cfg)
    kv = PagedKVCache(cfg.layers, 8 * 64, BLOCK, cfg.kv_heads, cfg.head_dim, getattr(torch, cfg.dtype))
    rows = torch.zeros(1, len(cfg.engram_layers), 24, 256)
    counting = CountingClock()
    with torch.inference_mode():
        model(batch_for(1, 272, 4, counting), kv, lambda e=rows.expand(4, -1, -1, -1): e)
    reads = counting.reads  # an operator's end read starts the next one's span where they follow (attention, out)
    print(f"one now() + gemm() pair: {pair * 1e9:.0f} ns; {reads} clock reads a step (counted in a forward): "
          f"{reads * pair / 2 * 1e6:.1f} us per step")
    for label, q, seqs in (("decode, 4 sequences at 272", 1, 4), ("prefill, 256 fresh tokens", 256, 1)):
        engram = rows.expand(q * seqs, -1, -1, -1)
        spent = {"with": [], "without": []}
        with torch.inference_mode():
            for i in range(2 * reps + 10):
                which = "with" if i % 2 else "without"
                batch = batch_for(q, 272 if q == 1 else 256, seqs, OpClock() if which == "with" else NO_CLOCK)
                t = time.perf_counter()
                model(batch, kv, lambda e=engram: e)
                if i >= 10:
                    spent[which].append(time.perf_counter() - t)
        w, wo = np.median(spent["with"]), np.median(spent["without"])
        print(f"forward, {label}: {w * 1e3:.3f} ms with the clock, {wo * 1e3:.3f} ms without "
              f"({(w - wo) * 1e6:+.1f} us, {(w - wo) / wo:+.2%}; medians of {reps} each, alternated)")


def gemm_rows(reps: int, sizes=(256, 257, 259, 260, 264, 272, 288, 320)) -> None:
    cfg = PRESETS["tiny"]
    model = build_model(cfg)
    kv = PagedKVCache(cfg.layers, 8 * 64, BLOCK, cfg.kv_heads, cfg.head_dim, getattr(torch, cfg.dtype))
    rows = torch.zeros(1, len(cfg.engram_layers), 24, 256)
    per_row = {}
    with torch.inference_mode():
        for m in sizes:
            spent = []
            for i in range(reps + 3):
                clock = OpClock()
                model(batch_for(m, m, 1, clock), kv, lambda e=rows.expand(m, -1, -1, -1): e)
                if i >= 3:
                    spent.append(clock.gemm_s)
            per_row[m] = float(np.median(spent)) / m
    print("| GEMM rows M | GEMM ms per step | per row against M = 256 |")
    print("|---:|---:|---:|")
    for m, t in per_row.items():
        print(f"| {m} | {t * m * 1e3:.2f} | {t / per_row[sizes[0]]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--section", choices=("all", "attention", "clock", "gemm-rows"), default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.section in ("all", "attention"):
        attention_profile(args.reps)
    if args.section in ("all", "clock"):
        clock_overhead(args.reps)
    if args.section in ("all", "gemm-rows"):
        gemm_rows(args.reps)


if __name__ == "__main__":
    main()
