"""A capture names the tokenizer its ids are of where that is known (``cachelab serve --capture``'s
own, the proxy's ``--upstream-tokenizer``), and ``trace build --from-capture`` carries it into the
trace, so that a layout of another tokenizer is refused; where it is not known nothing is recorded.
Before, a capture named none and every trace built from one was addressed by any layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cachelab.capture.recorder import Recorder, RequestRecord
from cachelab.capture.segments import read_stream
from cachelab.capture.to_trace import build_from_capture, capture_to_trace
from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.trace.schema import recorded_tokenizer, tokenizer_record
from test_trace_tokenizer import tiny_tokenizer


def _served(i: int) -> RequestRecord:
    return RequestRecord(endpoint="/v1/completions", arrival_unix_ns=1_000_000_000 * (10 + i),
                         prompt_ids=np.arange(3, 9, dtype=np.int32), output_ids=np.arange(3, 6, dtype=np.int32),
                         token_source="server")


def _capture(directory, ids_tokenizer, first=0, n=2):
    with Recorder(directory, ids_tokenizer=ids_tokenizer) as rec:
        for i in range(first, first + n):
            rec.submit(_served(i))


def test_a_named_tokenizer_goes_into_the_trace_and_is_checked(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    _capture(tmp_path / "cap", tok)
    out = tmp_path / "t.parquet"
    report = build_from_capture(tmp_path / "cap", out)
    assert report.tokenizer == tokenizer_record(tok) == recorded_tokenizer(out)
    assert report.unknown_tokenizer_requests == 0
    refused = CliRunner().invoke(app, ["trace", "info", str(out), "--engram-tokens", "100"])
    assert refused.exit_code != 0 and "its token ids are of tokenizer" in refused.output  # the V4 layout
    assert "a capture's ids are its server's tokenizer's" in " ".join(refused.output.split())

    info = CliRunner().invoke(app, ["capture", "info", str(tmp_path / "cap"), "--json"])
    assert json.loads(info.output)["tokenizers"] == [{**tokenizer_record(tok), "requests": 2}]


def test_a_capture_that_names_none_records_none(tmp_path):
    _capture(tmp_path / "cap", None)
    out = tmp_path / "t.parquet"
    report = build_from_capture(tmp_path / "cap", out)
    assert report.tokenizer is None and report.unknown_tokenizer_requests == 2
    assert recorded_tokenizer(out) is None


def test_runs_of_two_tokenizers_are_refused_and_an_unnamed_run_records_none(tmp_path):
    """Two servers captured into one directory: their ids are of two vocabularies, which one trace
    cannot say; a run that names none beside one that names a tokenizer leaves it unknown."""
    tok = tiny_tokenizer(tmp_path)
    _capture(tmp_path / "two", tok)
    _capture(tmp_path / "two", "deepseek-v4", first=2)
    with pytest.raises(CachelabError, match="token ids of 2 tokenizers"):
        capture_to_trace(tmp_path / "two")
    _capture(tmp_path / "some", tok)
    _capture(tmp_path / "some", None, first=2, n=3)
    _, report = capture_to_trace(tmp_path / "some")
    assert report.tokenizer is None and report.unknown_tokenizer_requests == 3


def test_serve_capture_names_its_own_tokenizer(tmp_path):
    from cachelab.live.launch import ServeOptions, open_capture

    recorder = open_capture(ServeOptions(capture=tmp_path / "cap"))
    with recorder:
        recorder.submit(_served(0))
    _, report = capture_to_trace(tmp_path / "cap")
    assert report.tokenizer == tokenizer_record("deepseek-v4")


def test_the_proxy_writer_process_names_the_upstream_tokenizer(tmp_path):
    from cachelab.capture.writer import CaptureWriter

    tok = tiny_tokenizer(tmp_path)
    CaptureWriter(tmp_path / "cap", tokenizer=tok, ids_tokenizer=tok, sched="normal").close()
    heads = [r for r in read_stream(tmp_path / "cap", "requests") if r.get("kind") == "segment"]
    assert [h.get("tokenizer") for h in heads] == [tokenizer_record(tok)]


def test_the_proxy_refuses_a_fallback_other_than_the_upstream_tokenizer(tmp_path):
    from cachelab.cli.capture import fallback_tokenizer

    tok = tiny_tokenizer(tmp_path)
    assert fallback_tokenizer(None, tok) == tok  # the upstream's is the fallback
    assert fallback_tokenizer(None, None) == "deepseek-v4"
    result = CliRunner().invoke(app, ["capture", "proxy", "--upstream", "http://127.0.0.1:9", "--out",
                                      str(tmp_path / "cap"), "--listen", "127.0.0.1:0", "--upstream-tokenizer", tok,
                                      "--tokenizer", "deepseek-v4"])
    assert result.exit_code != 0 and "is not --upstream-tokenizer" in result.output
    assert not (tmp_path / "cap").exists(), "refused before anything is created"


def test_serve_refuses_a_layout_of_another_tokenizer(tmp_path):
    """A model file's layout of another tokenizer had the server's DeepSeek-V4 ids addressed as that
    tokenizer's, and its capture would name them DeepSeek-V4's beside a layout that reads them otherwise."""
    from cachelab.live.launch import ServeOptions, model_for
    from test_trace_tokenizer import tiny_layout

    model = tmp_path / "model.json"
    model.write_text(json.dumps({"name": "t", "hidden": 64, "layers": 4, "heads": 2, "kv_heads": 1, "head_dim": 32,
                                 "intermediate": 128, "engram_layers": [1, 3],
                                 "layout": tiny_layout(tmp_path, tiny_tokenizer(tmp_path))}))
    with pytest.raises(CachelabError, match="addresses ids of tokenizer .*tiny.* cachelab serve reads and writes"):
        model_for(ServeOptions(preset=str(model)))
    model.write_text(json.dumps({**json.loads(model.read_text()), "layout": "deepseek-v4.1-flash"}))
    assert model_for(ServeOptions(preset=str(model))).layout == "deepseek-v4.1-flash"


def _text_completion(prompt: str, served_ids: list[int]):
    """An exchange of the proxy's: a completion of a text prompt, the server's ids of it in the answer."""
    from cachelab.capture.exchange import Exchange

    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=10**18, arrival=0.0, status=200, response_time=0.5,
                 body=json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode())
    x.response = json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": " a", "token_ids": [3],
                                                          "prompt_token_ids": served_ids}]}).encode()
    return x


@pytest.mark.parametrize("named_right", [True, False], ids=["the-servers", "another"])
def test_a_named_tokenizer_whose_tokens_are_not_the_servers_ids_is_not_recorded(tmp_path, named_right):
    """``--upstream-tokenizer`` named wrong (not the upstream's) named another tokenizer's ids in every
    segment header, and the trace built from the capture recorded it: a layout of the named tokenizer
    addressed them unchecked. The server's prompt ids of a text completion are compared with the named
    tokenizer's tokens of its text (the first few such records, in the writer): where they differ the
    record says so, and the build records no tokenizer for its run, saying why."""
    from cachelab.capture.tokens import FallbackTokenizer
    from cachelab.engram.vocab import DEEPSEEK_V4

    tok = tiny_tokenizer(tmp_path)
    text = "the cat a b"
    served = FallbackTokenizer(tok if named_right else DEEPSEEK_V4).encode(text, prompt=True)
    with Recorder(tmp_path / "cap", tokenizer=tok, ids_tokenizer=tok) as rec:
        for _ in range(2):
            rec.submit(_text_completion(text, served))
    out = tmp_path / "t.parquet"
    report = build_from_capture(tmp_path / "cap", out)
    assert (report.tokenizer == tokenizer_record(tok) == recorded_tokenizer(out)) is named_right
    assert report.tokenizer_mismatches == (0 if named_right else 1)
    assert report.unknown_tokenizer_requests == (0 if named_right else 2)
    if not named_right:
        built = CliRunner().invoke(app, ["trace", "build", "--from-capture", str(tmp_path / "cap"), "-o",
                                         str(tmp_path / "t2.parquet")])
        assert built.exit_code == 0 and "was not the upstream's" in " ".join(built.output.split())
        info = CliRunner().invoke(app, ["capture", "info", str(tmp_path / "cap"), "--json"])
        assert json.loads(info.output)["tokenizer_mismatches"] == 1


def _chat(messages: list, served_ids: list[int], stream: bool):
    """An exchange of the proxy's: a chat, the server's ids of its rendering in the answer (vLLM's, at the top)."""
    from cachelab.capture.exchange import Exchange

    x = Exchange(endpoint="/v1/chat/completions", arrival_unix_ns=10**18, arrival=0.0, status=200,
                 body=json.dumps({"model": "m", "messages": messages, "max_tokens": 1, "stream": stream}).encode())
    if stream:  # vLLM's: the role alone (no ids), then the token, then [DONE]
        first = {"id": "chatcmpl-1", "prompt_token_ids": served_ids,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        token = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": " a"}, "token_ids": [3]}]}
        x.events = [b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in (first, token)) + b"data: [DONE]\n\n"]
        x.event_times = [0.5]
    else:
        x.response_time = 0.5
        x.response = json.dumps({"id": "chatcmpl-1", "prompt_token_ids": served_ids, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": " a"}, "token_ids": [3]}]}).encode()
    return x


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("named_right", [True, False], ids=["the-servers", "another"])
def test_a_chat_whose_ids_are_not_the_named_tokenizers_is_found(tmp_path, named_right, stream):
    """Chats, the common case, were never checked: a wrong ``--upstream-tokenizer`` in front of a chat-only
    workload named another tokenizer's ids unchallenged. The server's ids of a chat are its template's
    rendering, so the check is the named tokenizer's decoding of them: it must hold the last user message."""
    from cachelab.capture.tokens import FallbackTokenizer
    from cachelab.engram.vocab import DEEPSEEK_V4

    tok = tiny_tokenizer(tmp_path)
    messages = [{"role": "system", "content": "b c"}, {"role": "user", "content": "a b"},
                {"role": "assistant", "content": "d"}, {"role": "user", "content": [{"type": "text", "text": " the cat a b "}]}]
    rendered = "system: b c\nuser: a b\nassistant: d\nuser: the cat a b\nassistant:"  # a template of the server's
    served = FallbackTokenizer(tok if named_right else DEEPSEEK_V4).encode(rendered, prompt=True)
    with Recorder(tmp_path / "cap", tokenizer=tok, ids_tokenizer=tok) as rec:
        for _ in range(2):
            rec.submit(_chat(messages, served, stream))
    report = build_from_capture(tmp_path / "cap", tmp_path / "t.parquet")
    assert report.requests == 2
    assert (report.tokenizer == tokenizer_record(tok)) is named_right
    assert report.tokenizer_mismatches == (0 if named_right else 1)
    assert report.unknown_tokenizer_requests == (0 if named_right else 2)


def _text_exchange(i: int, prompt: str, texts: list[str], stream: bool):
    """An upstream's answer of text, no token ids (SGLang's, a hosted API's): the fallback tokenizes it."""
    from cachelab.capture.exchange import Exchange

    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=1_000_000_000 * (10 + i), arrival=100.0,
                 body={"model": "m", "prompt": prompt, "stream": stream}, session=None, stream=stream, status=200)
    if stream:
        for k, text in enumerate(texts):
            x.events.append(b"data: " + json.dumps({"id": f"c{i}", "choices": [{"index": 0, "text": text}]}).encode()
                            + b"\n\n")
            x.event_times.append(100.01 + 0.01 * k)
        x.events.append(b"data: [DONE]\n\n")
        x.event_times.append(100.1)
    else:
        x.response = json.dumps({"id": f"c{i}", "choices": [{"index": 0, "text": "".join(texts)}]}).encode()
        x.response_time = 100.1
    return x


def test_text_past_the_fallbacks_budget_is_recorded_without_ids_not_tokenized_for_minutes(tmp_path):
    """The writer process tokenized whatever text an upstream answered: 8 Mi characters took it 6-20 s
    (64 MiB, the --max-response-mb bound, minutes), while the records behind it waited and, the backlog
    full, were dropped. Past ``max_tokenize_chars`` of an answer, the record keeps no ids, says why and
    how much text (``untokenized_chars``), and ``capture info`` counts it; the answers within it are
    tokenized as before."""
    from cachelab.capture.tokens import FallbackTokenizer
    from cachelab.capture.writer import CaptureWriter

    budget, huge = 1 << 20, "a" * (8 << 20)
    sent = [_text_exchange(0, "the row cache", [huge], stream=False),          # a whole answer past it
            _text_exchange(1, "the row cache", [" of", " Engram"], stream=True),  # within it
            _text_exchange(2, "the row cache", [" of", huge[:budget]], stream=True)]  # an event past it
    writer = CaptureWriter(tmp_path / "cap", sched="normal", max_tokenize_chars=budget)
    try:
        assert all(writer.submit(x) for x in sent)
        assert writer.flush(60) and writer.stats()["acknowledged"] == 3
    finally:
        writer.close()
    got = {r["upstream_id"]: r for r in read_stream(tmp_path / "cap", "requests") if r.get("kind") == "request"}
    whole, ok, streamed = got["c0"], got["c1"], got["c2"]
    for r, chars in ((whole, len(huge) + 13), (streamed, budget + 3 + 13)):
        assert r["status"] == 200 and r["token_source"] is None and r["prompt_ids"] is None and r["output_ids"] is None
        assert r["untokenized_chars"] == chars and f"{chars:,} characters of text not tokenized" in r["error"]
    assert whole["tok_n"] is None and streamed["tok_n"] is None  # its events' counts are the tokenizer's too
    fallback = FallbackTokenizer()
    assert ok["token_source"] == "tokenizer" and "untokenized_chars" not in ok and ok["error"] is None
    assert np.frombuffer(ok["output_ids"], "<i4").tolist() == fallback.encode(" of Engram")
    assert np.frombuffer(ok["prompt_ids"], "<i4").tolist() == fallback.encode("the row cache", prompt=True)
    info = json.loads(CliRunner().invoke(app, ["capture", "info", str(tmp_path / "cap"), "--json"]).stdout)
    assert (info["requests"], info["ok"], info["untokenized"]) == (3, 1, 2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_whole_answers_text_is_tokenized_once_and_its_count_is_its_ids(stream):
    """A whole answer of text (no ids) within the fallback's budget was tokenized twice by the writer: once
    for its output ids, once more for its one event's token count. Its count is now its ids', tokenized
    once; the ids and counts are what tokenizing each text gives (a stream's events are still tokenized
    each, as their counts need)."""
    from cachelab.capture.tokens import FallbackTokenizer

    class Counting(FallbackTokenizer):
        def __init__(self):
            super().__init__()
            self.texts = []

        def encode(self, text, prompt=False):
            self.texts.append(text)
            return super().encode(text, prompt)

    texts = [" of the Engram rows", " in DRAM", " and on SSD"]
    tok, reference = Counting(), FallbackTokenizer()
    [rec] = _text_exchange(0, "the row cache", texts, stream=stream).to_records(tok)
    output = "".join(texts)
    assert rec.token_source == "tokenizer" and rec.output_ids.tolist() == reference.encode(output)
    assert rec.prompt_ids.tolist() == reference.encode("the row cache", prompt=True)
    if stream:
        assert rec.token_counts.tolist() == [len(reference.encode(t)) for t in texts]
        assert sorted(tok.texts) == sorted(["the row cache", output, *texts])
    else:
        assert rec.token_counts.tolist() == [len(rec.output_ids)]
        assert sorted(tok.texts) == sorted(["the row cache", output]), tok.texts
