"""vLLM's own per-GPU scheduler defaults, run in vLLM's venv by tests/test_scheduler_vs_vllm.py.

Argument: a JSON object of GPU name -> device memory in bytes. Prints, per GPU, the
``max_num_batched_tokens`` and ``max_num_seqs`` that vLLM's OpenAI server takes by default
(``EngineArgs.get_batch_defaults``), with the platform's device queries answered by those values
(this CPU build has no GPU to ask).
"""

import json
import sys
from unittest import mock

from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext

if __name__ == "__main__":
    platform, out = type(current_platform), {}
    for name, memory in json.loads(sys.argv[1]).items():
        with mock.patch.object(platform, "get_device_total_memory", return_value=int(memory), create=True), \
             mock.patch.object(platform, "get_device_name", return_value=name, create=True), \
             mock.patch.object(platform, "is_cpu", return_value=False), \
             mock.patch.object(platform, "is_tpu", return_value=False):
            tokens, seqs = EngineArgs.get_batch_defaults(1)
        out[name] = [tokens[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER]]
    print(json.dumps(out))
