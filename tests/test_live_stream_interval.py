"""vLLM's stream interval in ``cachelab serve``: the server's ``--stream-interval`` and a request's
``stream_interval``, through the official openai client, and against the real vLLM server."""

import httpx
import openai
import pytest

from cachelab.live.launch import ServeOptions, running_server

MODEL = "cachelab-tiny"
T = 120  # s an answer may take on two busy cores


@pytest.fixture(scope="module")
def server():  # a server-wide interval of 3
    with running_server(ServeOptions(port=0, kv_cache_tokens=4096, threads=1, stream_interval=3)) as (url, engine):
        yield url, engine


def streamed_ids(base_url: str, model: str, chat: bool = False, **extra) -> list[list[int]]:
    """The token ids of each chunk that carries any, of one greedy 10-token stream."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", timeout=T)
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    if chat:
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Engram rows"}],
                                                max_tokens=10, temperature=0, stream=True, extra_body=body)
    else:
        chunks = client.completions.create(model=model, prompt="Engram rows", max_tokens=10, temperature=0,
                                           stream=True, extra_body=body)
    return [ids for c in chunks for ch in c.choices if (ids := (ch.model_extra or {}).get("token_ids"))]


def test_tokens_stream_in_chunks_of_the_servers_interval_the_first_at_once(server):
    """``--stream-interval 3`` was taken by no flag and a request's ``stream_interval`` dropped: every
    token went out as its own event. vLLM sends the first token at once, then chunks of the
    interval, the rest as the answer ends; a request may raise the interval, never lower it."""
    url, _ = server
    whole = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=T).completions.create(
        model=MODEL, prompt="Engram rows", max_tokens=10, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].model_extra["token_ids"]
    for chat in (False, True):
        chunks = streamed_ids(url, MODEL, chat)
        assert [len(c) for c in chunks] == [1, 3, 3, 3], chat
        assert chat or sum(chunks, []) == whole  # the same tokens, in fewer events
        assert [len(c) for c in streamed_ids(url, MODEL, chat, stream_interval=4)] == [1, 4, 4, 1]
        assert [len(c) for c in streamed_ids(url, MODEL, chat, stream_interval=2)] == [1, 3, 3, 3]  # raised to 3


def test_a_stream_interval_below_one_is_refused_as_vllms_schema_refuses_it(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", "stream": True,
                                                  "stream_interval": 0}, timeout=T)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.stream_interval", r.text


def test_a_requests_stream_interval_chunks_as_the_real_vllm(server, vllm_server):
    """The peer runs at vLLM's default interval (1): a request's interval of 4 chunks its stream."""
    url, _ = server
    for chat in (False, True):
        ours = [len(c) for c in streamed_ids(url, MODEL, chat, stream_interval=4)]
        theirs = [len(c) for c in streamed_ids(vllm_server.base_url, vllm_server.model, chat, stream_interval=4)]
        assert ours == theirs == [1, 4, 4, 1], chat
