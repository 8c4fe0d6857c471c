"""What a whole (non-SSE, ``stream: false``) answer costs the capture, against a reference measured in
the same run.

``tokenize``: the record of a whole answer of text without ids (an upstream without vLLM's
``return_token_ids``: SGLang, a hosted API) built by the writer (``Exchange.to_records`` with the fallback
tokenizer), against one tokenization of the answer's text by the same tokenizer. The text was
tokenized twice (once for the output ids, once more for the answer's one token count): the ratio was
about 2, it is now about 1. The text is the repository's docs, so the tokenizer sees prose.

Run: .venv/bin/python benchmarks/bench_capture_whole.py tokenize [--chars 262144 --repeats 3]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import os
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prose(chars: int) -> str:
    """``chars`` characters of the repository's docs, repeated as needed."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    return (text * (chars // len(text) + 1))[:chars]


def tokenize(args) -> None:
    from cachelab.capture.exchange import Exchange
    from cachelab.capture.tokens import FallbackTokenizer

    text = prose(args.chars)
    tok = FallbackTokenizer(max_chars=2 * args.chars)
    tok.encode("warm up")  # loaded before anything is timed
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, status=200, response_time=1.0,
                 body={"model": "m", "prompt": "the row cache"},
                 response=json.dumps({"id": "c", "choices": [{"index": 0, "text": text}]}).encode())
    [rec] = x.to_records(tok)
    assert rec.token_source == "tokenizer" and rec.output_ids.tolist() == tok.encode(text)
    once = min(timeit.repeat(lambda: tok.encode(text), number=1, repeat=args.repeats))
    record = min(timeit.repeat(lambda: x.to_records(tok), number=1, repeat=args.repeats))
    print(f"load {os.getloadavg()[0]:.2f}; a whole answer of {len(text):,} characters, {len(rec.output_ids):,} tokens "
          f"(best of {args.repeats})")
    print(f"  one tokenization of its text  {once * 1e3:8.1f} ms")
    print(f"  its record (to_records)       {record * 1e3:8.1f} ms   = {record / once:.2f} tokenizations")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sections = ap.add_subparsers(dest="section", required=True)
    t = sections.add_parser("tokenize", help="a whole answer's record against one tokenization of its text")
    t.add_argument("--chars", type=int, default=256 << 10)
    t.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    {"tokenize": tokenize}[args.section](args)


if __name__ == "__main__":
    main()
