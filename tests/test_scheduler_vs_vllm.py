"""cachelab's scheduler and vLLM-style pool against vLLM 0.32's own V1 Scheduler, step for step.

``vllm_scheduler_peer.py`` drives vLLM's ``Scheduler`` and ``KVCacheManager`` offline in
vLLM's venv (no server, no model run); both sides get the same random workloads: shared
prefixes, block-aligned prompts (whose last block is recomputed into a copy), token budgets
from 16 to 8,192, sequence caps from 1 to 11, pools tight enough to preempt, prefix caching
on and off. Every step must schedule the same requests at the same positions, and the
prefix-cache queries and hits (vLLM's own ``PrefixCacheStats``) must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cachelab.workload.scheduler import Request, Scheduler, kv_pool
from cachelab.workload.steps import scheduled_steps


def _workloads(seed: int, n: int) -> tuple[list[dict], list[dict]]:
    """``n`` cases for the peer, and cachelab's steps and hit counts for each."""
    rng = np.random.default_rng(seed)
    cases, ours = [], []
    while len(cases) < n:
        bs = int(rng.choice([16, 32]))
        docs = [rng.integers(0, 40, 300).tolist() for _ in range(3)]
        seqs, prompts = [], []
        for _ in range(int(rng.integers(5, 30))):
            length = int(rng.integers(1, 200))
            if rng.random() < 0.5:
                length = max(bs, length - length % bs)
            prompt = docs[rng.integers(3)][:length]
            seqs.append(prompt + rng.integers(0, 40, int(rng.integers(1, 30))).tolist())
            prompts.append(len(prompt))
        longest = max(-(-len(s) // bs) for s in seqs)
        blocks = int(rng.integers(longest + 1, 4 * longest))
        case = {"bs": bs, "num_blocks": blocks + 1,  # + vLLM's null block
                "seqs": seqs, "prompts": prompts, "budget": int(rng.choice([16, 48, 64, 256, 8192])),
                "max_num_seqs": int(rng.integers(1, 12)), "caching": bool(rng.random() < 0.7)}
        pool = kv_pool("vllm" if case["caching"] else "off", blocks * bs, bs)
        requests = [Request(i, np.array(s), p, len(s) - p) for i, (s, p) in enumerate(zip(seqs, prompts))]
        steps = scheduled_steps(Scheduler(pool, case["budget"], case["max_num_seqs"]), requests)
        cases.append(case)
        ours.append({"steps": [sorted([int(r), int(a), int(b)] for r, a, b in zip(s.requests, s.starts, s.stops))
                               for s in steps],
                     "queries": pool.queried_tokens, "hits": pool.hit_tokens})
    return cases, ours


@pytest.mark.slow
def test_scheduler_steps_and_prefix_hits_equal_vllms_own(tmp_path):
    from vllm_peer import VENV_PYTHON, available, write_model_dir

    if not available():
        pytest.skip("vLLM's CPU build is not installed (run scripts/setup-vllm)")
    cases, ours = _workloads(seed=5, n=40)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(VENV_PYTHON), str(Path(__file__).with_name("vllm_scheduler_peer.py")),
                           str(tmp_path / "cases.json"), str(write_model_dir(tmp_path / "model"))],
                          capture_output=True, text=True, timeout=600, env={**env, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert sum(bool(o["hits"]) for o in ours) > 10 and sum(any(len(s) > 1 for s in o["steps"]) for o in ours) > 30
    for i, (mine, vllm) in enumerate(zip(ours, theirs)):
        steps = next((k for k, (a, b) in enumerate(zip(mine["steps"], vllm["steps"])) if a != b), None)
        assert steps is None and len(mine["steps"]) == len(vllm["steps"]), (
            f"case {i}: step {steps}: cachelab {mine['steps'][steps] if steps is not None else len(mine['steps'])}, "
            f"vLLM {vllm['steps'][steps] if steps is not None else len(vllm['steps'])}")
        assert (mine["queries"], mine["hits"]) == (vllm["queries"], vllm["hits"]), f"case {i}"  # caching off: 0, 0


@pytest.mark.slow
def test_per_gpu_batch_defaults_equal_vllms_own():
    """A serving replay's default budget and cap per hardware profile are those vLLM 0.32's
    server takes on that GPU (16384 / 1024 on B200 and B300, 8192 / 1024 on H100 and H200)."""
    from vllm_peer import VENV_PYTHON, available

    from cachelab.serving.hardware import builtin_names, load_profile
    from cachelab.workload.scheduler import vllm_batch_defaults

    if not available():
        pytest.skip("vLLM's CPU build is not installed (run scripts/setup-vllm)")
    memory = {f"NVIDIA {p.name}": p.gpu.hbm_bytes for p in map(load_profile, builtin_names()) if p.gpu is not None}
    memory["NVIDIA L40S"] = 48e9  # below 70 GiB, no profile
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(VENV_PYTHON), str(Path(__file__).with_name("vllm_batch_defaults_peer.py")),
                           json.dumps(memory)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name: list(vllm_batch_defaults(m)) for name, m in memory.items()} == theirs
    assert theirs["NVIDIA B200"] == [16384, 1024] and theirs["NVIDIA H100"] == [8192, 1024]
