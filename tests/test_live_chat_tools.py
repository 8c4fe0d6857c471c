"""Chats in ``cachelab serve`` rendered as DeepSeek-V4 renders them in thinking mode (vLLM's default
for V4) and chat mode (its turn layout, content parts, an assistant's ``tool_calls`` and ``tool``
messages), checked token for token against DeepSeek-V4's own encoding (its encoding_dsv4, as vLLM
0.32 ships it), through the official openai client."""

import itertools
import json

import openai
import pytest

from cachelab.engram.vocab import DEEPSEEK_V4, load_tokenizer
from cachelab.live.launch import ServeOptions, running_server
from vllm_peer import deepseek_v4_encoding

MODEL = "cachelab-tiny"
T = 120  # s an answer may take on two busy cores


def call(cid: str, name: str, arguments) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = [call("c1", "get_weather", json.dumps({"city": "Paris"})),
           call("c2", "get_weather", json.dumps({"city": "東京", "days": 3, "units": ["C", "F"], "alerts": True,
                                                 "at": None, "where": {"lat": 35.7}}, ensure_ascii=False))]
# (what the client sends, what vLLM hands V4's encoding: a tool's text parts joined by a newline, a
# call's arguments that are no JSON object coerced to an empty one by vLLM's _postprocess_messages,
# refusal and thinking parts as text parts, a part whose text is null left out)
CHATS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Tokyo?"},
      {"role": "assistant", "content": None, "tool_calls": WEATHER},
      {"role": "tool", "tool_call_id": "c2", "content": "rain"},  # answered out of the calls' order
      {"role": "tool", "tool_call_id": "c1", "content": "sun"},
      {"role": "user", "content": "And tomorrow?"}], None),
    ([{"role": "user", "content": "Look it up."},
      {"role": "assistant", "content": "Let me check.", "tool_calls": [call("a", "search", '{"q": "engram"}')]},
      {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
      {"role": "assistant", "content": "Found two."}, {"role": "user", "content": "Thanks"}],
     [{"role": "user", "content": "Look it up."},
      {"role": "assistant", "content": "Let me check.", "tool_calls": [call("a", "search", '{"q": "engram"}')]},
      {"role": "tool", "tool_call_id": "a", "content": "one\ntwo"},
      {"role": "assistant", "content": "Found two."}, {"role": "user", "content": "Thanks"}]),
    ([{"role": "user", "content": "Run them."},
      {"role": "assistant", "content": "", "tool_calls": [call("x", "f", "not json"), call("y", "g", "[1, 2]"),
                                                          call("z", "h", "")]},
      {"role": "user", "content": "Before the results: hi."},  # a user message and tool results: one turn
      {"role": "tool", "tool_call_id": "z", "content": "3"}, {"role": "tool", "tool_call_id": "x", "content": "1"}],
     [{"role": "user", "content": "Run them."},
      {"role": "assistant", "content": "", "tool_calls": [call("x", "f", {}), call("y", "g", {}), call("z", "h", {})]},
      {"role": "user", "content": "Before the results: hi."},
      {"role": "tool", "tool_call_id": "z", "content": "3"}, {"role": "tool", "tool_call_id": "x", "content": "1"}]),
    ([{"role": "user", "content": "two user messages"}, {"role": "user", "content": "in a row: one turn"}], None),
    # V4's turn layout: a developer message is a user turn, a system message stays in its place (it was
    # moved into the system text at the start), an assistant's tag only where another role's turn ends
    ([{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
     None),
    ([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"},
      {"role": "assistant", "content": "b"}, {"role": "developer", "content": "d"}, {"role": "system", "content": "t"},
      {"role": "system", "content": "w"}], None),
    ([{"role": "assistant", "content": "first"}, {"role": "user", "content": "u"}], None),
    # content parts: V4 joins a message's by a blank line (they were joined by a newline)
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]},
      {"role": "user", "content": [{"type": "text", "text": None}, {"type": "refusal", "refusal": "e"},
                                   {"type": "thinking", "thinking": "f"}]}],
     [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]},
      {"role": "user", "content": [{"type": "text", "text": "e"}, {"type": "text", "text": "f"}]}]),
]


def v4_prompt(messages: list[dict], thinking: bool) -> str:
    """V4's encoding as vLLM calls it: thinking mode at effort high (its default), or chat mode."""
    if thinking:
        return deepseek_v4_encoding().encode_messages(messages, thinking_mode="thinking", reasoning_effort="high")
    return deepseek_v4_encoding().encode_messages(messages, thinking_mode="chat")


@pytest.fixture(scope="module")
def server():
    with running_server(ServeOptions(port=0, kv_cache_tokens=4096, threads=1)) as (url, engine):
        yield url, engine


def test_tool_history_renders_as_deepseek_v4_renders_it(server):
    """Tool calls were dropped (an assistant turn of its text alone, often empty) and each tool
    result was a user turn of its bare text; V4 writes the calls as a DSML block and merges the
    results, in their calls' order, with the user messages around them into one user turn."""
    url, _ = server
    tokenizer = load_tokenizer(DEEPSEEK_V4)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=T)
    for (sent, seen), thinking in itertools.product(CHATS, (True, False)):
        want = tokenizer.encode(v4_prompt(seen or sent, thinking), add_special_tokens=False).ids
        got = client.chat.completions.create(model=MODEL, messages=sent, max_tokens=1, extra_body={
            "return_token_ids": True, **({} if thinking else {"chat_template_kwargs": {"thinking": False}})})
        assert got.model_extra["prompt_token_ids"] == want, (sent, thinking)


def test_a_tool_call_of_another_type_or_without_a_name_is_a_400(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=T, max_retries=0)
    for calls, param in (([{"id": "a", "type": "custom", "custom": {"name": "f", "input": "x"}}], "tool_calls"),
                         ([{"id": "a", "type": "function", "function": {"arguments": "{}"}}],
                          "messages.1.tool_calls.0.function.name")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}])
        assert err.value.body["param"] == param, err.value.body


def test_continuing_a_final_message_without_text_is_a_400_in_transformers_words(server):
    """V4's renderer reads content as parts, so vLLM's continuation (transformers') puts its marker
    after the final message's last text part and refuses a message that has none; serve continued
    an empty text."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=T, max_retries=0)
    for last in ({"role": "assistant", "content": None}, {"role": "assistant", "content": []},
                 {"role": "assistant", "content": [{"type": "text", "text": None}]}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}, last],
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
        assert "could not find any text to continue" in err.value.body["message"], err.value.body
    got = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "return_prompt_text": True})
    assert got.model_extra["prompt_text"].endswith("<｜Assistant｜><think></think>")
