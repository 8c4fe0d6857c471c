"""The live engine's per-token host work over one long answer, which must not grow with its length.

Block hashing: each time an output block fills, the engine extends the request's key; it hashes
the new block alone (``BlockPrefixCache.extend_key``), timed beside rehashing the whole sequence
at every fill, as it did. Detokenizing: microseconds a token over a short and a long answer.

    PYTHONPATH=. .venv/bin/python scripts/live_host_bench.py [--answer 32000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cachelab.engram.vocab import load_tokenizer
from cachelab.live.sampling import Detokenizer
from cachelab.workload.prefix_cache import BlockPrefixCache, block_hashes

PROMPT, BLOCK, REPEATS = 256, 16, 3


def _best(run) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def block_fills(answer: int) -> None:
    toks = np.random.default_rng(0).integers(0, 130_000, PROMPT + answer)
    fills = range(PROMPT + BLOCK - PROMPT % BLOCK, toks.size + 1, BLOCK)

    def incremental():
        pool = BlockPrefixCache(num_blocks=toks.size // BLOCK + 2, block_size=BLOCK)
        pool.admit(0, pool.prefix_key(toks[:PROMPT]), PROMPT, 0)
        for n in fills:
            pool.extend_key(0, toks[:n])
        assert np.array_equal(pool._req[0][3], block_hashes(toks, BLOCK)), "the incremental chain is not the full one"

    def rehash():
        for n in fills:
            block_hashes(toks[:n], BLOCK)

    print(f"block hashing over a {answer}-token answer ({len(fills)} fills): incremental "
          f"{_best(incremental) * 1e3:.1f} ms, full rehash at each fill {_best(rehash) * 1e3:.1f} ms (best of {REPEATS})")


def detokenizing() -> None:
    tok = load_tokenizer()
    text = open(np.__file__.replace("__init__.py", "linalg/_linalg.py")).read() * 3
    ids = tok.encode(text, add_special_tokens=False).ids
    for n in (1_000, 64_000):
        def stream():
            d = Detokenizer(tok, stop=("never in this text",))
            out = []
            for t in ids[:n]:
                d.add(t)
                out.append(d.take())
            assert "".join(out) + d.take(final=True) == tok.decode(ids[:n])
        print(f"detokenizing {n} tokens: {_best(stream) / n * 1e6:.1f} us a token (best of {REPEATS})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer", type=int, default=32_000, help="output tokens of the answer")
    block_fills(parser.parse_args().answer)
    detokenizing()
