"""The CLI capture proxy against an OpenAI-compatible upstream that answers with fields of other shapes
than vLLM's (a raw socket serving written answers): each request is still recorded, with what the upstream
sent or an error naming the field, never lost to a record the writer could not build. And a streaming
client that hangs up before its first token ends the upstream request at once, as vLLM's own server does."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from capture_upstream import PROXY_EXIT_S, RawUpstream, cli_proxy
from cachelab.capture.to_trace import read_requests
from cachelab.capture.tokens import FallbackTokenizer

PROMPT_IDS = [5, 6, 7]
GOOD_CHOICE = {"index": 0, "text": " a b", "token_ids": [7, 8], "finish_reason": "length"}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}


def whole(**fields) -> bytes:
    """A whole completion as vLLM writes it with ids (no model: the record keeps the one asked for), ``fields``
    replaced (None: left out)."""
    answer = {"id": "cmpl-1", "object": "text_completion", "choices": [GOOD_CHOICE],
              "usage": USAGE, "prompt_token_ids": PROMPT_IDS, **fields}
    return json.dumps({k: v for k, v in answer.items() if v is not None}, separators=(",", ":")).encode()


def events(*data: str) -> bytes:
    """A stream of these events' data, then ``[DONE]``."""
    return b"".join(b"data: %s\n\n" % d.encode() for d in (*data, "[DONE]"))


CHUNK = json.dumps({"id": "cmpl-s", "prompt_token_ids": PROMPT_IDS, "choices": [GOOD_CHOICE]},
                   separators=(",", ":"))

NO_CHOICE = "upstream answered 200 without any choice"
# the upstream's answer to each model, and what the record of its choice 0 holds:
# (error, or None; cached tokens; output ids)
ANSWERS = {
    "cached-text": (whole(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": "lots"}}), None, None, [7, 8]),
    "cached-list": (whole(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": [2]}}), None, None, [7, 8]),
    "cached-true": (whole(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": True}}), None, None, [7, 8]),
    "cached-float": (whole(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": 2.0}}), None, 2, [7, 8]),
    "ids-ragged": (whole(choices=[{**GOOD_CHOICE, "token_ids": [7, [8]]}]), "upstream token ids", 2, None),
    "ids-scalar": (whole(choices=[{**GOOD_CHOICE, "token_ids": 7}]), "upstream token ids", 2, None),
    "ids-text": (whole(choices=[{**GOOD_CHOICE, "token_ids": ["7", 8]}]), "upstream token ids", 2, None),
    "prompt-ragged": (whole(prompt_token_ids=[[5], [6, 7]]), "upstream token ids", 2, None),
    "choices-object": (whole(choices={"0": GOOD_CHOICE}), "upstream answer's choices are an object, not an array",
                       2, None),
    "choices-number": (whole(choices=5), "upstream answer's choices are a number 5, not an array", 2, None),
    "index-text": (whole(choices=[{**GOOD_CHOICE, "index": "0"}]),
                   "upstream answered a choice's index that is a string \"0\": not read", 2, None),
    "index-null": (whole(choices=[{**GOOD_CHOICE, "index": None}]),
                   "upstream answered a choice's index that is null: not read", 2, None),
    "index-left-out": (whole(choices=[{k: v for k, v in GOOD_CHOICE.items() if k != "index"}]), None, 2, [7, 8]),
    "text-number": (whole(choices=[{**GOOD_CHOICE, "text": 5}]),
                    "upstream choice 0's text is a number 5, not a string: not read", 2, [7, 8]),  # its ids kept
    "data-array": (events(CHUNK, "[1, 2]"), "upstream stream had 1 event whose data is not a JSON object", None,
                   [7, 8]),
    "body-array": (b"[1, 2]", "upstream answered 200 with a body that is not a JSON object", None, None),
    # no choice at all, to a request for one (vLLM answers each choice asked for; a chat stream begins with its
    # role): passed on unchanged (``UNCHANGED``), recorded as failed, not as served with an empty output
    "choices-empty": (whole(choices=[], prompt_token_ids=None), NO_CHOICE, 2, None),
    "choices-left-out": (whole(choices=None, prompt_token_ids=None), NO_CHOICE, 2, None),
    "stream-no-choice": (events('{"id":"cmpl-s","object":"text_completion","choices":[]}'), NO_CHOICE, None, None),
    "stream-done-only": (events(), NO_CHOICE, None, None),
}
UNCHANGED = ("choices-empty", "choices-left-out", "stream-no-choice", "stream-done-only")
# an answer without ids whose text holds JSON's "\ud800" (half a UTF-16 pair): the fallback tokenizes it
SURROGATE_TEXT = whole(choices=[{"index": 0, "text": "a\ud800", "finish_reason": "length"}], prompt_token_ids=None)


class WrittenUpstream(RawUpstream):
    """An upstream that answers each request with ``ANSWERS[model]`` (a stream where the body begins
    ``data:``; another model: ``whole()``). To model ``first-token-late`` it sends a stream's head at once and
    would send its first event after ``late_s``, to ``head-late`` nothing before then; either notes in
    ``closed`` when the proxy closed that connection (None: not before then)."""

    def __init__(self, late_s: float = 30.0):
        self.late_s, self.closed, self.asked = late_s, [], threading.Event()
        super().__init__()

    def answer(self, conn: socket.socket, body: dict) -> None:
        model = body["model"]
        if model.endswith("-late"):
            if model == "first-token-late":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: "
                             b"chunked\r\n\r\n")
            self.asked.set()
            conn.settimeout(self.late_s)
            try:
                gone = conn.recv(1) == b""  # the proxy's close, or nothing until the first token is due
            except TimeoutError:
                gone = False
            self.closed.append(time.monotonic() if gone else None)
            return
        answer = ANSWERS[model][0] if model in ANSWERS else SURROGATE_TEXT if model == "surrogate-text" else whole()
        kind = b"text/event-stream" if answer.startswith(b"data:") else b"application/json"
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (kind, len(answer), answer))


def _stopped(proc, out) -> dict:
    proc.terminate()
    _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert "Traceback" not in err, err
    table, _ = read_requests(out)
    return {row["model"]: row for row in table.iter_rows(named=True)}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every model of ``ANSWERS`` asked once through the CLI proxy (a whole answer, or a stream where the
    upstream sends one), a completion whose ``user`` is a lone surrogate and one answered ``SURROGATE_TEXT``;
    their records by model."""
    out = tmp_path_factory.mktemp("answers") / "cap"
    upstream = WrittenUpstream()
    with cli_proxy(upstream.url, out) as (base, proc), httpx.Client(base_url=base, timeout=30) as client:
        for model, (answer, *_) in ANSWERS.items():
            r = client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2,
                                                     "stream": answer.startswith(b"data:")})
            assert r.status_code == 200, (model, r.content)
            assert model not in UNCHANGED or r.content == answer, (model, r.content)
        r = client.post("/v1/completions", content=b'{"model": "surrogate-user", "prompt": "x", "user": "\\ud800"}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 200
        assert client.post("/v1/completions", json={"model": "surrogate-text", "prompt": "x"}).status_code == 200
        return _stopped(proc, out)


@pytest.mark.parametrize("model", list(ANSWERS))
def test_an_answers_field_of_another_shape_is_recorded_as_sent_or_as_an_error(recorded, model):
    """``cached_tokens: "lots"`` raised in the writer (``int()``), ``"token_ids": [7, [8]]`` (NumPy's ragged
    array) and ``"token_ids": 7``, ``"choices": 5`` and ``"text": 5`` too: the request was recorded only as
    "record not built", its ids and times lost. ``"choices"`` of an object and a choice's index that is no
    number were passed over: a 200 recorded with an empty output and no error."""
    _, error, cached, output_ids = ANSWERS[model]
    rec = recorded[model]
    assert rec["status"] == 200 and rec["arrival_ns"] > 0 and rec["index"] in (0, None), rec
    assert (rec["error"] is None) if error is None else rec["error"].startswith(error), rec["error"]
    assert (rec["cached"], rec["output_ids"]) == (cached, output_ids), rec
    if output_ids is not None:
        assert rec["prompt_ids"] == PROMPT_IDS and rec["token_source"] == "upstream"


def test_a_lone_surrogate_for_a_user_still_keys_a_session(recorded):
    """A client's ``"user": "\\ud800"`` (JSON's half of a UTF-16 pair) raised as its session was hashed: the
    record was lost to "record not built"."""
    rec = recorded["surrogate-user"]
    assert rec["error"] is None and rec["session"] is not None and rec["output_ids"] == [7, 8], rec


def test_a_lone_surrogate_in_an_answers_text_is_tokenized_as_the_record_stores_it(recorded):
    """The fallback tokenizer refused the text of an upstream without ids holding ``"\\ud800"``: the record was
    lost to "record not built". It is tokenized as ``?``, as a stored text has it."""
    rec = recorded["surrogate-text"]
    assert rec["error"] is None and rec["token_source"] == "tokenizer", rec
    assert rec["output_ids"] == FallbackTokenizer().encode("a?"), rec


def test_a_whole_answer_that_leaves_out_a_choice_asked_for_says_so(tmp_path):
    """An upstream that ignores ``n``: the second choice asked for was recorded as served, with no output."""
    upstream = WrittenUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap") as (base, proc):
        r = httpx.post(base + "/v1/completions", json={"model": "one-choice", "prompt": "x", "n": 2}, timeout=30)
        assert r.status_code == 200
        proc.terminate()
        proc.communicate(timeout=PROXY_EXIT_S)
    rows = read_requests(tmp_path / "cap")[0].sort("index")
    assert rows["index"].to_list() == [0, 1] and rows["output_ids"].to_list() == [[7, 8], None]
    assert rows["error"].to_list() == [None, "upstream answered no choice 1 of the 2 asked for"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("model", ["first-token-late", "head-late"])
def test_a_stream_whose_client_hangs_up_before_its_first_token_ends_the_upstream_request(tmp_path, model, loop):
    """vLLM's server ends a request whose client went away (its ``with_cancellation``, then Starlette's
    ``StreamingResponse``, wait for the ASGI ``http.disconnect``); through the proxy it must see that at once,
    not when the first token comes and the proxy finds the client gone as it writes it. The upstream sends
    a stream's head at once (or nothing) and would send its first token 30 s later: the proxy closes the
    upstream connection within a second of the client's leaving and records a 499 without tokens."""
    upstream = WrittenUpstream(late_s=30.0)
    with cli_proxy(upstream.url, tmp_path / "cap", "--loop", loop) as (base, proc):
        client = socket.create_connection((base.rsplit(":", 1)[0][7:], int(base.rsplit(":", 1)[1])))
        body = json.dumps({"model": model, "prompt": "x", "stream": True}).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        assert upstream.asked.wait(10)
        if model == "first-token-late":  # read, as a client does: unread bytes would make its close a reset
            client.settimeout(10)
            assert client.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)  # the request is upstream; no token yet
        left = time.monotonic()
        client.close()
        deadline = left + 5
        while not upstream.closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert upstream.closed and upstream.closed[0] is not None and upstream.closed[0] - left < 1.0, upstream.closed
        rec = _stopped(proc, tmp_path / "cap")[model]
    assert (rec["status"], rec["error"], rec["ttft_s"]) == (499, "client disconnected", None), rec
