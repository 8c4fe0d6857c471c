"""The live engine's per-token host work over one long answer, which must not grow with its length.

Block hashing: each time an output block fills, the engine extends the request's key; it hashes
the new block alone (``BlockPrefixCache.extend_key``), timed beside rehashing the whole sequence
at every fill, as it did. Admission: a long prompt waiting at the head of the queue while another
as long decodes is tried at every step; the scheduler keeps its key across the tries (its new
blocks alone are hashed), timed beside the same scheduler hashing it whole at each try, as it
did (the scheduler's whole time, its per-try prefix match included). Detokenizing: microseconds a token over a short and a long answer,
optionally beside another version's ``Detokenizer`` (its sampling.py), run by turns in this
process (separate processes' malloc states alone moved the figure by half):

    .venv/bin/python benchmarks/bench_live_host.py [--answer 32000] [--prompt 100000] [--detokenizer-from FILE]

Each prints its ratio: rehashing over incremental hashing (at block fills, and at admission
tries), and the long answer's microseconds a token over the short one's (1.0: flat in the
answer's length).
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import importlib.util
import sys
import time

import numpy as np

from cachelab.engram.vocab import load_tokenizer
from cachelab.live.sampling import Detokenizer
from cachelab.serving.hardware.probe import _best
from cachelab.workload.prefix_cache import BlockPrefixCache, block_hashes
from cachelab.workload.scheduler import Request, Scheduler

PROMPT, BLOCK, REPEATS = 256, 16, 3


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

    inc, full = _best(incremental, REPEATS), _best(rehash, REPEATS)
    print(f"block hashing over a {answer}-token answer ({len(fills)} fills): incremental {inc * 1e3:.1f} ms, "
          f"full rehash at each fill {full * 1e3:.1f} ms (best of {REPEATS}): rehash / incremental {full / inc:.1f}x")


class _Rehashed(Request):
    """The admission before: no key kept, the request hashed whole at each try."""

    key = property(lambda self: None, lambda self, value: None)


def admission(prompt: int, answer: int = 256) -> None:
    seqs = np.random.default_rng(1).integers(0, 130_000, (2, prompt + answer))

    def run(kind):
        sched = Scheduler(BlockPrefixCache(num_blocks=prompt * 3 // 2 // BLOCK, block_size=BLOCK), 8192)
        for rid, seq in enumerate(seqs):
            sched.add(kind(rid, seq, prompt, answer))
        tries = 0
        while sched.num_unfinished:
            waiting = bool(sched.waiting)
            step = sched.schedule()
            tries += waiting and step.num_tokens < sched.max_num_batched_tokens
            sched.complete(step)
        return tries

    tries = run(Request)
    assert run(_Rehashed) == tries
    kept, rehashed = _best(lambda: run(Request), REPEATS), _best(lambda: run(_Rehashed), REPEATS)
    print(f"admission of a {prompt}-token prompt tried at {tries} steps while another decodes {answer} tokens: "
          f"scheduler {kept * 1e3:.1f} ms with its key kept, {rehashed * 1e3:.1f} ms hashing it whole at each try "
          f"(best of {REPEATS}): rehash / incremental {rehashed / kept:.1f}x")


def _detokenizer_from(path: str):
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Detokenizer


def detokenizing(baseline: str | None = None, lengths: tuple[int, ...] = (1_000, 16_000, 64_000)) -> None:
    tok = load_tokenizer()
    text = open(np.__file__.replace("__init__.py", "linalg/_linalg.py")).read() * 3
    ids = tok.encode(text, add_special_tokens=False).ids
    kinds = {"this": Detokenizer, **({baseline: _detokenizer_from(baseline)} if baseline else {})}
    per_token = {}
    for n in lengths:
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(REPEATS):
            for name, kind in kinds.items():
                d, out, t0 = kind(tok, stop=("never in this text",)), [], time.perf_counter()
                for t in ids[:n]:
                    d.add(t)
                    out.append(d.take())
                best[name] = min(best[name], time.perf_counter() - t0)
                assert "".join(out) + d.take(final=True) == tok.decode(ids[:n])
        per_token[n] = {name: t / n for name, t in best.items()}
        print(f"detokenizing {n} tokens, us a token (best of {REPEATS}): "
              + ", ".join(f"{name} {t / n * 1e6:.2f}" for name, t in best.items()))
    short, long = per_token[lengths[0]], per_token[lengths[-1]]
    print(f"detokenizing, {lengths[-1]} over {lengths[0]} tokens' time a token: "
          + ", ".join(f"{name} {long[name] / short[name]:.2f}x" for name in kinds))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer", type=int, default=32_000, help="output tokens of the answer")
    parser.add_argument("--prompt", type=int, default=100_000, help="prompt tokens of the request admitted")
    parser.add_argument("--detokenizer-from", help="a sampling.py whose Detokenizer to time beside this one")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1_000, 16_000, 64_000],
                        help="answer lengths the detokenizer is timed at")
    args = parser.parse_args()
    block_fills(args.answer)
    admission(args.prompt)
    detokenizing(args.detokenizer_from, tuple(args.lengths))
