"""Recompute tests/golden/miss_counts.json: libCacheSim's hits and misses for every policy both
implement (the mapping of tests/test_differential_libcachesim.py's CASES), each checked equal
to cachelab's, and cachelab's own figures for the built-ins libCacheSim lacks.

    .venv/bin/python tests/golden/make_miss_counts.py            # counts from the bundled streams
    .venv/bin/python tests/golden/make_miss_counts.py --streams  # also regenerate the streams

The streams are bundled (tests/golden/miss_streams.npz) so the test does not depend on these
generators staying the same; ``--streams`` rewrites them (and so changes every figure).
libCacheSim reads each stream as the tier sees it (each step's distinct rows, in order) with
the very ids cachelab's policies see, so sketch hashes agree too.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from cachelab import registry  # noqa: E402
from cachelab.workload.compaction import compact, dedup_steps  # noqa: E402
from cachelab.workload.lookups import LookupStream
from lcs_reference import lcs_misses, write_oracle_general  # noqa: E402
from test_differential_libcachesim import CASES  # noqa: E402
from test_golden_miss_counts import COUNTS, STREAMS, cachelab_counts, load_streams  # noqa: E402

SEED = 13
LOOKUPS = 40_000
CAPACITY_SHARES = (50, 10, 4)  # capacities: unique rows / each, at least MIN_CAPACITY
MIN_CAPACITY = 100  # above every Case's min_capacity (W-TinyLFU's 1% window holds a row)
DESCRIPTIONS = {
    "zipf": f"{LOOKUPS:,} lookups, one per step, Zipf(0.9) over 10,000 keys (seed {SEED})",
    "scan-loop": f"{LOOKUPS:,} lookups in steps of 16: blocks of 2,000 lookups that cycle a 3,000-key "
                 f"loop, scan fresh keys, or draw Zipf(1.0) from 300 hot keys (seed {SEED})",
    "engram-stdlib": "DeepSeek-V4.1-Flash Engram rows (both layers) of the first 834 tokens of the "
                     "standard library corpus (traces.stdlib, this Python), 8 tokens per step",
}


def _zipf(rng, n, num_keys, alpha):
    p = 1.0 / np.arange(1, num_keys + 1) ** alpha
    return rng.permutation(num_keys)[rng.choice(num_keys, size=n, p=p / p.sum())]


def make_streams() -> dict[str, LookupStream]:
    """The three streams, as dense ids (first-seen order, as the engine compacts them)."""
    from cachelab.engram import Addresser
    from traces.stdlib import StdlibCorpus

    rng = np.random.default_rng(SEED)
    zipf = LookupStream.from_keys(_zipf(rng, LOOKUPS, 10_000, 0.9))
    blocks, fresh = [], 10_000_000
    for b in range(LOOKUPS // 2_000):
        kind = rng.integers(3)
        if kind == 0:
            blocks.append((np.arange(2_000) + b * 2_000) % 3_000)
        elif kind == 1:
            blocks.append(np.arange(fresh, fresh + 2_000))
            fresh += 2_000
        else:
            blocks.append(1_000_000 + _zipf(rng, 2_000, 300, 1.0))
    mix = np.concatenate(blocks)
    scan_loop = LookupStream(mix, np.arange(0, mix.size + 1, 16), 1)
    texts = [doc.text for doc in StdlibCorpus(max_chars=20_000).documents()]
    engram = LookupStream.from_texts(Addresser("deepseek-v4.1-flash"), texts, tokens_per_step=8, max_tokens=834)
    out = {}
    for name, stream in {"zipf": zipf, "scan-loop": scan_loop, "engram-stdlib": engram}.items():
        out[name] = LookupStream(compact(stream.keys)[0], stream.step_offsets, 1)
    return out


def save_streams(streams: dict[str, LookupStream]) -> None:
    arrays = {}
    for name, s in streams.items():
        arrays[f"{name}_keys"] = s.keys.astype(np.uint16 if s.keys.max() < 1 << 16 else np.int32)
        arrays[f"{name}_offsets"] = s.step_offsets.astype(np.int32)
    np.savez_compressed(STREAMS, **arrays)


def cases() -> list[tuple[str, dict, str | None, dict]]:
    """(policy, params, libCacheSim class or None, its params): CASES, then every other built-in."""
    out = [(c.ours, dict(c.params), c.theirs, dict(c.lcs_params)) for c in CASES]
    checked = {c.ours for c in CASES}
    out += [(p.name, {}, None, {}) for p in registry.discover(registry.POLICIES)
            if p.distribution == "cachelab" and p.name not in checked]
    return out


def main(argv: list[str]) -> int:
    import libcachesim

    if "--streams" in argv:
        save_streams(make_streams())
    load_streams.cache_clear()
    streams = load_streams()
    records, info = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, stream in streams.items():
            dedup = dedup_steps(stream.keys, stream.step_offsets, int(stream.keys.max()) + 1)
            unique = int(stream.keys.max()) + 1
            info[name] = {"made": DESCRIPTIONS[name], "lookups": stream.num_lookups, "steps": stream.num_steps,
                          "requests": int(dedup.keys.size), "unique": unique}
            trace = write_oracle_general(Path(tmp) / f"{name}.oracleGeneral", dedup.keys)
            capacities = sorted({max(MIN_CAPACITY, unique // share) for share in CAPACITY_SHARES})
            for policy, params, theirs, lcs_params in cases():
                for capacity in capacities:
                    ours = cachelab_counts(stream, policy, params, capacity)
                    if theirs is not None:
                        misses = lcs_misses(trace, theirs, capacity, **lcs_params)
                        if misses != ours["misses"]:
                            print(f"{name} {policy} {params} @ {capacity}: libCacheSim {theirs} {misses} misses, "
                                  f"cachelab {ours['misses']}", file=sys.stderr)
                            return 1
                    records.append({"stream": name, "policy": policy, "params": params, "capacity": capacity,
                                    **ours, "reference": theirs or "cachelab-only"})
    golden = {
        "about": "Hits and misses of one tier's requests (each step's distinct rows) per bundled stream, "
                 "policy and capacity (rows). reference: the libCacheSim class that computed the figure "
                 "(checked equal to cachelab's when recorded), or cachelab-only (a regression figure; "
                 "learned policies read fixed_scores of tests/test_golden_miss_counts.py).",
        "command": ".venv/bin/python tests/golden/make_miss_counts.py",
        "libcachesim": getattr(libcachesim, "__version__", "unknown"),
        "streams": info,
        "counts": records,
    }
    COUNTS.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {COUNTS.relative_to(TESTS.parent)}: {len(records)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
