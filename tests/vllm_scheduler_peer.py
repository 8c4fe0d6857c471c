"""vLLM's own V1 Scheduler and KV-cache manager, driven offline: no server, no model run.

Run with vLLM's venv (``.venv-vllm``, ``scripts/setup-vllm``), never imported by cachelab:
``python vllm_scheduler_peer.py CASES.json MODEL_DIR`` prints, per case, every step's
``[request, first position, one past the last]`` and the prefix cache's queried and hit
tokens of requests never preempted (vLLM's ``PrefixCacheStats`` terms). A case gives the
block size, the pool (``num_blocks``, one of them vLLM's null block), the step budget, the
sequence cap, whether prefix caching is on, and each request's tokens (prompt, then the
outputs it samples) and prompt length; all arrive before the first step. A request that
computed every position it knows samples its next token from the case, so both sides see
the same tokens.
"""

import json
import sys

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MAX_MODEL_LEN = 4096


def run(case: dict, model_config: ModelConfig) -> dict:
    bs, caching = case["bs"], case["caching"]
    sched_cfg = SchedulerConfig(max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=case["budget"],
                                max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                                is_encoder_decoder=False, async_scheduling=False)
    cache_cfg = CacheConfig(block_size=bs, enable_prefix_caching=caching)
    cache_cfg.num_gpu_blocks = case["num_blocks"]
    config = VllmConfig(model_config=model_config, scheduler_config=sched_cfg, cache_config=cache_cfg)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=case["num_blocks"], kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sched = Scheduler(vllm_config=config, kv_cache_config=kv, block_size=bs, log_stats=True,
                      structured_output_manager=StructuredOutputManager(config))
    totals = {"queries": 0, "hits": 0}
    hasher = get_request_block_hasher(bs, sha256) if caching else None
    seqs = case["seqs"]
    for i, (seq, p) in enumerate(zip(seqs, case["prompts"])):
        sched.add_request(Request(str(i), seq[:p], SamplingParams(max_tokens=len(seq) - p, ignore_eos=True), None,
                                  block_hasher=hasher, arrival_time=float(i)))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        stats = sched.kv_cache_manager.make_prefix_cache_stats()  # vLLM's own counts of the step (and reset)
        totals["queries"] += stats.queries
        totals["hits"] += stats.hits
        ids, step, sampled = list(out.num_scheduled_tokens), [], []
        for rid in ids:
            r, n = sched.requests[rid], out.num_scheduled_tokens[rid]
            start = r.num_computed_tokens - n  # schedule() has advanced it already
            step.append([int(rid), start, start + n])
            sampled.append([seqs[int(rid)][r.num_tokens]] if r.num_computed_tokens >= r.num_tokens else [])
        steps.append(sorted(step))
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                                       sampled_token_ids=sampled))
    return {"steps": steps, **totals}


if __name__ == "__main__":
    init_none_hash(sha256)
    model = sys.argv[2]
    model_config = ModelConfig(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    print(json.dumps([run(case, model_config) for case in json.load(open(sys.argv[1]))]))
