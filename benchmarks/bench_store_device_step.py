"""A store step on the compute device against the old work of the same step, in the same run.

- ``waits``: steps with the store's stream waited for after its 4 device stages (HBM gather,
  copy, slot writes, dequantisation: the store now) against the same steps with each of its 5
  host-stage clocks waiting too (dedup, policies, DRAM gather, backing read: 9 waits a step,
  the store before, the 5 extra on an idle stream). Both count their waits a step.
- ``out``: ``lookup(out=)`` (the dequantiser's lookup writes into the caller's tensor) against
  ``lookup()`` and a copy of its rows into that tensor (what ``out=`` did before: a new output
  copied in), on the same steps.

Steps of 1, 8 and 64 tokens of ``--trace``'s rows (a saved stream of the V4.1 layout, its tokens
in order), the tables at ``--scale``, an HBM row cache (LRU, 1 %) and a DRAM cache (LRU, 5 %) on
the ``dram`` backing; interleaved rounds, the median of each. A ratio is the store now over the old work (below 1: faster). On
the CPU no stream is waited for and ``out=`` always wrote straight into the caller's tensor: a
dry run of the script, not a figure (its ratios are 1 but for the copy the old side adds).

    .venv/bin/python benchmarks/bench_store_device_step.py --trace S.npz [--device cuda] [--scale 2e-4] [--json]

(a stream: ``cachelab trace lookups gsm8k --requests 20 -o S.npz``, as scripts/device-prepare writes it)
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import statistics
import tempfile
import time
import types

import numpy as np
import torch

import cachelab.store.store as store_module
from cachelab.engram.config import get_preset
from cachelab.store import TieredStore, build_tables
from cachelab.store.bench import step_rows, table_stream

LAYOUT = "deepseek-v4.1-flash"


def token_rows(directory, trace: str) -> np.ndarray:
    """Every token's full-layout row ids of the stream ``trace``, ``[tokens, layers, columns]``."""
    stream = table_stream(directory, trace, None, "bench")
    cfg = get_preset(LAYOUT)
    return np.concatenate([step_rows(stream, s, len(cfg.layers), cfg.columns) for s in range(stream.num_steps)])


def counting_waits(store) -> list:
    """A list that gets one entry per wait for the store's stream (none on the CPU)."""
    waits = []
    if store.cuda:
        wait = store._stream.synchronize
        store._stream.synchronize = lambda: waits.append(1) or wait()
    return waits


class OldWaits:
    """While entered, every stage clock of ``store`` waits for its stream, as before: the store's
    module reads ``time.perf_counter`` for its host stages, replaced here by a waiting clock."""

    def __init__(self, store):
        self.store = store

    def clock(self) -> float:
        if self.store.cuda:
            self.store._stream.synchronize()
        return time.perf_counter()

    def __enter__(self):
        store_module.time = types.SimpleNamespace(perf_counter=self.clock)
        self.store._clock = self.clock

    def __exit__(self, *exc):
        store_module.time = time
        del self.store._clock


def step_seconds(fn, steps) -> float:
    """Median seconds of ``fn(rows)`` over ``steps``, the device idle at each start and end."""
    times = []
    for rows in steps:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(rows)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(directory, rows: np.ndarray, device: str, tokens: int, rounds: int, steps: int) -> dict:
    steps = min(steps, rows.shape[0] // tokens)
    stream = [rows[i * tokens:(i + 1) * tokens] for i in range(steps)]
    tiers = dict(backing="dram", hbm_policy="lru", hbm_capacity="1%", dram_policy="lru", dram_capacity="5%",
                 device=device)
    with TieredStore.open(directory, **tiers) as store:
        waits = counting_waits(store)
        out = torch.empty((*stream[0].shape, store.row_dim), dtype=torch.bfloat16, device=store.device)

        def old_out(rows):
            out.copy_(store.lookup(rows))

        cases = {"now": lambda rows: store.lookup(rows), "old_waits": lambda rows: store.lookup(rows),
                 "out": lambda rows: store.lookup(rows, out=out), "old_out": old_out}
        for rows in stream[:3]:  # warm: compilation, allocations, the caches' first rows
            store.lookup(rows)
        seconds = {name: [] for name in cases}
        waits_a_step = {}
        for _ in range(rounds):
            for name, fn in cases.items():
                store.reset()
                del waits[:]
                if name == "old_waits":
                    with OldWaits(store):
                        seconds[name].append(step_seconds(fn, stream))
                else:
                    seconds[name].append(step_seconds(fn, stream))
                waits_a_step[name] = len(waits) / len(stream)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    return {"tokens": tokens, "step_us": {k: round(v * 1e6, 1) for k, v in med.items()},
            "waits_a_step": waits_a_step, "waits_ratio": med["now"] / med["old_waits"],
            "out_ratio": med["out"] / med["old_out"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=float, default=2e-4)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cachelab-step-") as d:
        build_tables(LAYOUT, args.scale, d, seed=1, progress=False)
        rows = token_rows(d, args.trace)
        runs = [run(d, rows, args.device, int(t), args.rounds, args.steps) for t in args.tokens.split(",")]
    if args.json:
        print(json.dumps({"device": args.device, "runs": runs}))
        return
    print(f"device {args.device}{'' if args.device != 'cpu' else ' (a dry run: no stream, out= always straight)'}")
    for r in runs:
        us, w = r["step_us"], r["waits_a_step"]
        print(f"{r['tokens']:>3} tokens: waits {w['now']:.0f} vs {w['old_waits']:.0f} a step, step {us['now']} vs "
              f"{us['old_waits']} us, ratio {r['waits_ratio']:.3f}; out= {us['out']} us vs new output + copy "
              f"{us['old_out']} us, ratio {r['out_ratio']:.3f}")


if __name__ == "__main__":
    main()
