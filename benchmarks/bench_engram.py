"""Row ids per second: cachelab's compiled addresser against a plain NumPy version of the spec.

Both run in this process on the same >= 1 M tokens of real text (the standard library), and
must agree bit for bit. Run: .venv/bin/python benchmarks/bench_engram.py [--chars N]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import time

import numpy as np

from cachelab import registry
from cachelab.engram import Addresser, encode, get_preset


def numpy_rows(cids: np.ndarray, offsets: np.ndarray, cfg, pad: int) -> np.ndarray:
    """ENGRAM.md §3.6 written the obvious NumPy way: shifted look-backs, XOR, %."""
    n, n_max = cids.size, cfg.max_ngram
    pos_in_seq = np.arange(n) - np.repeat(offsets[:-1], np.diff(offsets))
    tau = np.empty((n_max, n), np.int64)
    for k in range(n_max):
        shifted = np.full(n, pad, np.int64)
        shifted[k:] = cids[:n - k] if k else cids
        tau[k] = np.where(pos_in_seq >= k, shifted, pad)
    out = np.empty((n, len(cfg.layers), cfg.columns), np.int32)
    for li in range(len(cfg.layers)):
        mults = cfg.multiplier_array[li]
        acc = tau[0] * mults[0]
        for k in range(1, n_max):
            acc = acc ^ (tau[k] * mults[k])
            for h in range(cfg.heads):
                j = (k - 1) * cfg.heads + h
                out[:, li, j] = cfg.offsets[li, j] + acc % cfg.primes[li, j]
    return out


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chars", type=int, default=5_000_000, help="characters of stdlib text")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    docs = list(registry.get(registry.WORKLOADS, "stdlib")(max_chars=args.chars).documents())
    addresser = Addresser(get_preset("deepseek-v4.1-flash"))
    ids = encode([d.text for d in docs], bos=True)
    offsets = np.concatenate([[0], np.cumsum([x.size for x in ids])])
    flat = np.concatenate(ids)
    cids = addresser.compress(flat)
    addresser.rows(flat[:100])  # compile outside the clock

    fast = addresser.rows(flat, offsets)
    plain = numpy_rows(cids, offsets, addresser.config, int(addresser.pad))
    assert np.array_equal(fast, plain), "the two implementations disagree"

    t_fast = best_of(lambda: addresser.rows(flat, offsets), args.repeats)
    t_plain = best_of(lambda: numpy_rows(cids, offsets, addresser.config, int(addresser.pad)), args.repeats)
    n_rows = fast.size
    print(f"tokens: {flat.size:,}  row ids: {n_rows:,}  (identical in both)")
    print(f"cachelab addresser : {n_rows / t_fast / 1e6:8.1f} M row ids/s")
    print(f"plain NumPy        : {n_rows / t_plain / 1e6:8.1f} M row ids/s")
    print(f"ratio              : {t_plain / t_fast:8.2f}x")


if __name__ == "__main__":
    main()
