"""Every choice recorded: a batch of prompts and an ``n > 1`` answer through the capture proxy in
front of ``cachelab serve --capture``, streamed and whole, make one record per (prompt, choice) on
both sides, with the same index, answer id and token ids; and ``serve --capture`` records what its
client got (a refusal, an abort it answered with 503, a client gone: 499)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from capture_upstream import ProxyThread
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import capture_to_trace, read_requests
from cachelab.capture.tokens import FallbackTokenizer
from cachelab.live.launch import ServeOptions, running_server

MODEL = "cachelab-tiny"
PROMPTS = ["The row cache keeps", "Engram rows are hashed", "A third prompt of the batch"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``cachelab serve --capture`` and two proxies in front of it: one asks for ids, one tokenizes."""
    tmp = tmp_path_factory.mktemp("choices")
    opts = ServeOptions(port=0, kv_cache_tokens=16_384, threads=1, capture=tmp / "served")
    with running_server(opts) as (url, engine):
        ids, text = Recorder(tmp / "cap"), Recorder(tmp / "text")
        with ProxyThread(ProxyConfig(upstream=url), ids) as proxy, \
                ProxyThread(ProxyConfig(upstream=url, token_ids=False), text) as tokenizing:
            yield url, engine, proxy, ids, tokenizing, text, tmp


def _post(base: str, path: str, body: dict) -> tuple[int, bytes]:
    with httpx.stream("POST", f"{base}/v1/{path}", json=body, timeout=60) as r:
        return r.status_code, b"".join(r.iter_raw())


def _rows(directory, upstream_id: str, wait: int = 0) -> list[dict]:
    """The records of one answer, by index (waiting up to 10 s for ``wait`` of them)."""
    deadline = time.monotonic() + 10
    while True:
        table, _ = read_requests(directory)
        rows = sorted((r for r in table.iter_rows(named=True) if r["upstream_id"] == upstream_id),
                      key=lambda r: r["index"])
        if len(rows) >= wait or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def _answer_id(raw: bytes) -> str:
    return raw.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()


CASES = {
    "batch": ("completions", {"prompt": PROMPTS, "temperature": 0}, 3),
    "batch-of-ids": ("completions", {"prompt": [[11, 12, 13, 14], [21, 22, 23], [31, 32]], "temperature": 0}, 3),
    "n=2": ("completions", {"prompt": PROMPTS[0], "n": 2, "temperature": 1.0, "seed": 3}, 2),
    "chat n=2": ("chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}], "n": 2,
                                      "temperature": 1.0, "seed": 5}, 2),
    "batch n=2": ("completions", {"prompt": PROMPTS[:2], "n": 2, "temperature": 1.0, "seed": 7}, 4),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_prompt_and_choice_is_a_record_on_both_sides(served, case, stream):
    url, _, proxy, recorder, _, _, tmp = served
    path, body, count = CASES[case]
    status, raw = _post(proxy.url, path, {"model": MODEL, "max_tokens": 5, "stream": stream, **body})
    assert status == 200, raw
    answer = _answer_id(raw)
    assert recorder.flush(30)
    proxied, own = _rows(tmp / "cap", answer), _rows(tmp / "served", answer, count)
    assert [r["index"] for r in proxied] == [r["index"] for r in own] == list(range(count)), (proxied, own)
    n = body.get("n", 1)
    for p, s in zip(proxied, own):
        assert p["status"] == s["status"] == 200 and p["error"] is None and s["error"] is None
        assert p["token_source"] == "upstream" and s["token_source"] == "server"
        assert p["prompt_ids"] == s["prompt_ids"] and p["output_ids"] == s["output_ids"] and len(p["output_ids"]) == 5
        assert p["prompt_ids"] == own[p["index"] // n * n]["prompt_ids"]  # a prompt's choices share it
        assert p["seq"] == proxied[0]["seq"] and p["arrival_ns"] == proxied[0]["arrival_ns"]  # one submission
        assert p["cached"] is None and s["cached"] is not None  # the answer's cached tokens are no one choice's
        if stream:  # each choice's own token events, from the SSE chunks of its index
            assert p["tok_n"] is not None and sum(p["tok_n"]) == 5 and len(p["tok_t"]) == len(p["tok_n"])
            assert p["ttft_s"] == p["tok_t"][0] and p["last_s"] == p["tok_t"][-1]
    if case.startswith("batch"):
        assert len({tuple(r["prompt_ids"]) for r in proxied}) == count // n  # every prompt, not prompt 0 again


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_tokenizer_fallback_tokenizes_each_prompt(served, stream):
    """An upstream that answers text only: each prompt of the batch tokenized on its own, each choice's
    output text on its own."""
    _, _, _, _, tokenizing, recorder, tmp = served
    status, raw = _post(tokenizing.url, "completions", {"model": MODEL, "prompt": PROMPTS, "max_tokens": 4,
                                                        "temperature": 0, "stream": stream})
    assert status == 200 and b'"token_ids":[' not in raw
    assert recorder.flush(30)
    rows = _rows(tmp / "text", _answer_id(raw))
    own = _rows(tmp / "served", _answer_id(raw), 3)
    tok = FallbackTokenizer()
    assert [r["index"] for r in rows] == [0, 1, 2] and {r["token_source"] for r in rows} == {"tokenizer"}
    assert [r["prompt_ids"] for r in rows] == [tok.encode(p, prompt=True) for p in PROMPTS]
    assert [r["output_ids"] for r in rows] == [tok.encode(tok.decode(s["output_ids"])) for s in own]


def test_the_trace_makes_the_same_requests_from_either_capture(tmp_path):
    """``trace build --from-capture``: the proxy's capture and the server's give the same requests, in
    the same order (a request's choices by index), whatever the order its choices finished in."""
    opts = ServeOptions(port=0, kv_cache_tokens=16_384, threads=1, capture=tmp_path / "served")
    with running_server(opts) as (url, _):
        recorder = Recorder(tmp_path / "cap")
        with ProxyThread(ProxyConfig(upstream=url), recorder) as proxy:
            for stream in (False, True):
                assert _post(proxy.url, "completions", {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "n": 2,
                                                        "temperature": 1.0, "seed": 1, "stream": stream,
                                                        "user": "one-session"})[0] == 200
            assert recorder.flush(30)
    proxied, report = capture_to_trace(tmp_path / "cap")
    own, _ = capture_to_trace(tmp_path / "served")
    assert proxied.height == own.height == 12 and report.sessions == 1
    for column in ("session_id", "turn", "domain", "prompt_ids", "output_ids"):
        assert proxied[column].to_list() == own[column].to_list(), column


def _new_rows(directory, before: int, wait: int) -> list[dict]:
    """The records after the first ``before`` (waiting up to 10 s for ``wait`` of them)."""
    deadline = time.monotonic() + 10
    while True:
        rows = list(read_requests(directory)[0].iter_rows(named=True))[before:]
        if len(rows) >= wait or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def test_serve_records_a_request_it_refuses(served):
    """A completion refused before the engine ran it is recorded with the status and message the
    client got: by the server's checks (400), and by the engine at submit (503: shutting down)."""
    url, engine, *_, tmp = served
    before = read_requests(tmp / "served")[0].height
    greedy = _post(url, "completions", {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0, "user": "u1"})
    assert greedy[0] == 400
    engine.refuse_new()
    try:
        closed = _post(url, "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                 "stream": True})
    finally:
        engine.closed = False
    assert closed[0] == 503
    rows = _new_rows(tmp / "served", before, 2)
    assert [(r["status"], r["endpoint"], r["stream"]) for r in rows] == [
        (400, "/v1/completions", False), (503, "/v1/chat/completions", True)], rows
    assert rows[0]["error"] == "n must be 1 when using greedy sampling, got 2." and rows[0]["session"] is not None
    assert rows[1]["error"] == "the server is shutting down" and rows[1]["index"] is None


def test_a_client_gone_before_any_answer_is_a_record_per_choice_on_both_sides(served):
    """A batch of two prompts with n = 2 whose client gives up before any of its answer: the server
    records a 499 for each of the four choices it ran, and the proxy in front of it (which recorded
    one, without an index) does the same."""
    url, _, proxy, recorder, _, _, tmp = served
    before = {side: read_requests(tmp / side)[0].height for side in ("cap", "served")}
    body = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "temperature": 1.0, "max_tokens": 2000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=0.5)
    proxied, own = (_new_rows(tmp / side, before[side], 4) for side in ("cap", "served"))
    assert [(r["index"], r["status"], r["error"]) for r in proxied] == \
        sorted((r["index"], r["status"], r["error"]) for r in own) == \
        [(i, 499, "client disconnected") for i in range(4)], (proxied, own)


def test_serve_records_an_abort_as_what_its_client_got(tmp_path):
    """The server aborting requests whose clients are still there (shutting down) answers them 503
    (a whole answer) or with an error event (a stream, 200): recorded so, not as 499; a client
    that went away is still 499."""
    opts = ServeOptions(port=0, kv_cache_tokens=16_384, threads=1, capture=tmp_path / "served")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "n": 2, "temperature": 1.0, "ignore_eos": True}
    with running_server(opts) as (url, engine):
        with pytest.raises(httpx.ReadTimeout):  # a whole answer's client gives up
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            next(r.iter_raw())  # a stream's client reads its first event and goes
        gone = _new_rows(tmp_path / "served", 0, 4)
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                events = r.iter_raw()
                streamed = next(events)
                while engine.num_live < 4:  # both requests' choices running
                    time.sleep(0.01)
                engine.abort_all()
                streamed += b"".join(events)
            whole = whole.result()
        rows = _new_rows(tmp_path / "served", 4, 4)
    assert [(r["status"], r["error"]) for r in gone] == [(499, "client disconnected")] * 4, gone
    assert whole.status_code == 503 and b"the server is shutting down" in streamed
    aborted = "the server is shutting down; the request was aborted"
    assert sorted((r["stream"], r["status"], r["error"]) for r in rows) == \
        [(False, 503, aborted)] * 2 + [(True, 200, aborted)] * 2, rows


def test_a_stream_asking_for_continuous_usage_alone_gets_no_usage_through_the_proxy(served):
    """``continuous_usage_stats`` without ``include_usage`` asks for no usage (vLLM's should_include_usage,
    and cachelab serve's). The proxy added ``include_usage`` and kept the client's flag: the upstream then
    put usage in every chunk, and the client got it in every chunk through the proxy."""
    url, _, proxy, recorder, _, _, tmp = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}

    def events(base: str) -> list:
        raw = _post(base, "completions", body)[1]
        return [{k: v for k, v in json.loads(e[6:]).items() if k not in ("id", "created")}
                for e in raw.split(b"\n\n") if e.startswith(b"data: {")]

    direct, proxied = events(url), events(proxy.url)
    assert proxied == direct and not any("usage" in e for e in direct), proxied
    assert recorder.flush(30)
    last = read_requests(tmp / "cap")[0].row(-1, named=True)
    assert len(last["output_ids"]) == 4 and last["cached"] is not None


def _timed_events(base: str, path: str, body: dict) -> list[tuple[float, dict]]:
    """A stream's events, each with the time its last byte reached the client."""
    events, buffer = [], b""
    with httpx.stream("POST", f"{base}/v1/{path}", json=body, timeout=60) as r:
        for piece in r.iter_raw():
            now = time.perf_counter()
            *done, buffer = (buffer + piece).split(b"\n\n")
            events += [(now, json.loads(e[6:])) for e in done if e.startswith(b"data: {")]
    return events


def test_the_choices_of_a_stream_reach_the_client_as_they_come(served):
    """n = 2, choice 0 stopped early (a stop token from its own output), choice 1 running on: the
    client gets choice 1's later events as the upstream sends them. The proxy asked for usage, to
    drop its event again, and held every event after choice 0's terminal chunk until that usage
    event, the answer's end: the client's inter-token times through the proxy were wrong."""
    url, _, proxy, recorder, _, _, tmp = served
    body = {"model": MODEL, "prompt": PROMPTS[2], "n": 2, "temperature": 1.0, "seed": 13, "max_tokens": 96,
            "ignore_eos": True}
    probe = json.loads(_post(url, "completions", {**body, "return_token_ids": True})[1])
    first, second = (c["token_ids"] for c in sorted(probe["choices"], key=lambda c: c["index"]))
    stop = next(t for i, t in enumerate(first[1:8], 1) if t not in second and t not in first[:i])
    events = _timed_events(proxy.url, "completions", {**body, "stop_token_ids": [stop], "stream": True})
    assert not any("usage" in e for _, e in events)  # not asked for by the client: none came
    choices = [e["choices"][0] for _, e in events]
    ended = next(i for i, c in enumerate(choices) if c["index"] == 0 and c["finish_reason"])
    later = [t for (t, _), c in zip(events[ended + 1:], choices[ended + 1:]) if c["index"] == 1]
    assert recorder.flush(30)
    zero, one = _rows(tmp / "cap", events[0][1]["id"])
    upstream = one["last_s"] - zero["last_s"]  # how long the upstream took over choice 1's later events
    assert len(later) > 40 and upstream > 0.02, (len(later), upstream)
    assert later[-1] - events[ended][0] > upstream / 2, (later[-1] - events[ended][0], upstream)


def test_a_request_nested_deeper_than_json_reads_goes_upstream_as_it_came(served):
    """A body nested deeper than Python's json can read (a client's, or a hostile one): the proxy sends it
    on as it came, as any body it cannot parse, and records the answer. Parsing it raised RecursionError
    in the parser's callback: the proxy answered 400 `malformed HTTP request` itself and recorded nothing."""
    url, _, proxy, recorder, _, _, tmp = served
    body = b'{"model":"%s","prompt":"x","nested":%s%s}' % (MODEL.encode(), b"[" * 100_000, b"]" * 100_000)
    before = read_requests(tmp / "cap")[0].height

    def post(base: str) -> httpx.Response:
        return httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=60)

    direct, proxied = post(url), post(proxy.url)
    assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content), proxied.content
    [row] = _new_rows(tmp / "cap", before, 1)
    assert row["status"] == direct.status_code and row["error"] == direct.json()["error"]["message"][:300], row


def test_a_refused_capture_directory_stops_serve_before_its_model_loads(tmp_path, monkeypatch):
    """`serve --capture` opens its capture before it builds the engine: a directory others can enter
    is refused without the model load (about 7 s) the old order paid first, and without an engine
    left running behind the error."""
    from cachelab.errors import CachelabError
    from cachelab.live import launch

    def build_engine(opts):
        raise AssertionError("the engine was built before the capture was opened")

    monkeypatch.setattr(launch, "build_engine", build_engine)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    with pytest.raises(CachelabError, match="is mode 0755"):
        with running_server(ServeOptions(port=0, capture=open_dir)):
            pass
