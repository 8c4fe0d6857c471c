"""``cachelab serve`` renders a chat in DeepSeek-V4's thinking mode by default and in chat mode
where the request asks, reading ``chat_template_kwargs`` and ``reasoning_effort`` as vLLM 0.32
reads them for a V4 model: every chat, with every option, checked token for token (and each
refusal) against vLLM's own rendering (its request model, kwargs, message parsing and V4
tokenizer, run in its venv: ``vllm_peer.v4_rendered``), through the openai client."""

import httpx
import openai
import pytest

from cachelab.engram.vocab import DEEPSEEK_V4, load_tokenizer
from cachelab.live.launch import ServeOptions, running_server
from vllm_peer import v4_rendered

MODEL = "cachelab-tiny"
T = 120  # s an answer may take on two busy cores
U = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
CHATS = [
    [U], [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, U],
    # earlier turns' reasoning (reasoning, or reasoning_content, its old name) and developer messages
    [U, {"role": "assistant", "content": "a", "reasoning": "r1"}, {"role": "developer", "content": "d"},
     {"role": "user", "content": "u2"}, {"role": "assistant", "content": "b", "reasoning_content": "r2"}],
    [U, {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "plan"},
     {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "assistant", "content": "ok", "reasoning": 5}],
    [U, {"role": "assistant", "content": "x", "reasoning": "r", "reasoning_content": "old"}],
    # V4's refusals where a message is rendered, and what thinking mode drops before the last user turn
    [{"role": "developer", "content": ""}, U], [U, {"role": "developer", "content": []}],
    [{"role": "bogus", "content": "x"}, U], [U, {"role": "function", "content": "x", "name": "f"}],
    [U, {"role": "direct_search_results", "content": "x"}],
    # V4's latest_reminder: its own tag, no assistant tag after it
    [U, {"role": "latest_reminder", "content": "rem"}],
    [{"role": "latest_reminder", "content": "rem"}, U, {"role": "latest_reminder", "content": "r2"},
     {"role": "assistant", "content": "a"}],
    [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}, U],
]
OPTIONS = [{}, {"reasoning_effort": "none"}, {"reasoning_effort": "low"}, {"reasoning_effort": "max"},
           {"reasoning_effort": "xhigh"}, {"chat_template_kwargs": {"thinking": False}},
           {"chat_template_kwargs": {"enable_thinking": False}}, {"chat_template_kwargs": {"drop_thinking": False}},
           {"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "medium"},
           {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"},
           {"chat_template_kwargs": {"reasoning_effort": "max", "unknown": 1}},
           {"chat_template_kwargs": {"thinking": None, "reasoning_effort": 3}},
           {"chat_template_kwargs": {"reasoning_effort": "none", "chat_template": None}}]


@pytest.fixture(scope="module")
def server():
    with running_server(ServeOptions(port=0, kv_cache_tokens=4096, threads=1)) as (url, engine):
        yield url, engine


def test_chats_render_in_thinking_and_chat_mode_as_vllm_renders_them_for_v4(server):
    """Serve rendered chat mode only and refused ``chat_template_kwargs`` (``reasoning_effort`` not
    read): a plain "hi" was 5 prompt tokens where vLLM's default for V4 (thinking mode, effort
    high) is 84. Now the same ids for every chat and option, the same chats refused (an unknown
    role, an empty developer message, where rendered), unknown kwargs ignored."""
    url, _ = server
    bodies = [{"messages": m, **o} for m in CHATS for o in OPTIONS]
    theirs = v4_rendered(bodies)
    tokenizer = load_tokenizer(DEEPSEEK_V4)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=T, max_retries=0)
    differ, served = [], 0
    for body, (error, text) in zip(bodies, theirs):
        try:
            got = client.chat.completions.create(model=MODEL, max_tokens=1, messages=body["messages"], extra_body={
                "return_token_ids": True, **{k: v for k, v in body.items() if k != "messages"}})
        except openai.BadRequestError as err:
            if error is None or err.body["message"].split(":")[0] != text.split(":")[0]:
                differ.append((body, err.body, error, text))
            continue
        served += 1
        want = tokenizer.encode(text, add_special_tokens=False).ids if error is None else None
        if got.model_extra["prompt_token_ids"] != want:
            differ.append((body, error, text))
    assert differ == []
    assert served >= 100 and len(bodies) - served >= 30, served
    modes = {(b.get("reasoning_effort"), str(b.get("chat_template_kwargs"))): text[:60] for b, (e, text)
             in zip(bodies, theirs) if b["messages"] == [U]}
    assert len(set(modes.values())) == 4  # thinking at effort high, low, max; chat mode


def test_tokenize_reads_the_template_kwargs_as_vllm_does(server):
    """vLLM's /tokenize of a chat takes ``chat_template_kwargs`` (serve refused them) but has no
    ``reasoning_effort``, and reads an assistant's ``reasoning`` alone (a chat completion renames
    ``reasoning_content``)."""
    url, _ = server
    chats = [[U], [U, {"role": "assistant", "content": "a", "reasoning_content": "r"}],
             [U, {"role": "assistant", "content": "a", "reasoning": "r"}]]
    bodies = [{"messages": m, **o} for m in chats for o in ({}, {"chat_template_kwargs": {"thinking": False}},
                                                            {"reasoning_effort": "none"})]
    theirs = v4_rendered([{**b, "tokenize": True} for b in bodies])
    tokenizer = load_tokenizer(DEEPSEEK_V4)
    for body, (error, text) in zip(bodies, theirs):
        assert error is None, text
        r = httpx.post(f"{url}/tokenize", json={"model": MODEL, **body}, timeout=T).json()
        assert r["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids, body


def test_a_template_in_the_kwargs_is_refused_in_vllms_words(server):
    """vLLM refuses a ``chat_template`` in ``chat_template_kwargs`` (no --trust-request-chat-template)."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=T, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[U],
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ messages }}"}})
    assert err.value.body["message"].startswith("Chat template is passed with request, but "
                                                 "--trust-request-chat-template is not set."), err.value.body


def test_a_developer_messages_tools_are_refused_as_a_requests_are(server):
    """vLLM hands a developer message's ``tools`` to V4, which offers them to the model in that
    message (and then keeps every reasoning); serve left them out, a prompt other than vLLM's,
    where a request's ``tools`` are refused. Now refused too, the message's field named."""
    url, _ = server
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    developer = {"role": "developer", "content": "d", "tools": [tool]}
    (_, offered), (_, plain) = v4_rendered([{"messages": [developer, U]},
                                            {"messages": [{**developer, "tools": None}, U]}])
    assert "## Tools" in offered and "## Tools" not in plain
    for path, body in (("v1/chat/completions", {"max_tokens": 1}), ("tokenize", {})):
        r = httpx.post(f"{url}/{path}", json={"model": MODEL, "messages": [U, developer], **body}, timeout=T)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages.1.tools"), r.text
    assert httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": [U, {**developer, "tools": []}]},
                      timeout=T).status_code == 200
