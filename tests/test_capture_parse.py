"""The capture reads JSON with jiter (pydantic-core's parser) where it can (``cachelab.capture.json_bytes``):
each SSE event in the writer, a request's body in the writer and on the event loop. Whatever jiter takes
must read exactly as the reference does, for every shape an upstream or a client may send: json's C
scanner as ``_sse_data`` used it (``exchange._json_object``) for an event, ``json.loads`` for a body;
what jiter refuses goes to the reference itself."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab.capture.exchange import _NOT_JSON, _json_object, _sse_data
from cachelab.capture.json_bytes import loads


def canon(value):
    """A value with its exact types (1, 1.0 and True differ; -0.0 and NaN are kept apart) and key order."""
    if isinstance(value, dict):
        return ("d", tuple((k, canon(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("l", tuple(canon(v) for v in value))
    if isinstance(value, float):
        return ("f", "nan" if math.isnan(value) else value.hex())
    return (type(value).__name__, value)


def agrees(data: bytes) -> None:
    """``_sse_data`` of a one-line event of ``data`` reads as the reference does."""
    data = data.replace(b"\n", b" ").replace(b"\r", b" ")  # one line (the reference reads lines' data alike)
    got, want = _sse_data(b"data: " + data), _json_object(data)
    if want is _NOT_JSON:
        assert got is _NOT_JSON, data
    else:
        assert got is not _NOT_JSON and canon(got) == canon(want), data


def read(parse, data: bytes):
    try:
        return "value", canon(parse(data))
    except (ValueError, RecursionError) as exc:
        return "error", type(exc)


def agrees_whole(data: bytes) -> None:
    """``loads`` of a whole body (any value, any whitespace, any encoding json detects) reads as json.loads."""
    assert read(loads, data) == read(json.loads, data), data


# vLLM's (pydantic, exclude_unset), SGLang's and cachelab serve's chunks, escapes, ids, usage, errors
SHAPES = [
    b'{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":" the",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[279],"prompt_token_ids":[1,2,3]}]}',
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"line\\nnext \\"quoted\\" \\\\ \\u00e9\\ud83d\\ude00 \xc3\xa9"},"logprobs":null,'
    b'"finish_reason":null,"token_ids":[12,13]}],"prompt_token_ids":null}',
    b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":3,"delta":{"role":null,'
    b'"content":"a","reasoning_content":null,"tool_calls":null},"logprobs":null,"finish_reason":null,'
    b'"matched_stop":null}],"usage":null}',
    b'{"id":"x","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":24,'
    b'"total_tokens":40,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":16}},'
    b'"system_fingerprint":"fp"}',
    b'{"error":{"message":"Token id 1000000 is out of vocabulary","type":"BadRequestError","param":null,"code":400}}',
    b'{"object":"error","message":"boom","code":500}',
    b'{"a":1,"a":2}', b'{"a":1,"b":2,"a":3}', b'{"choices":[{"index":0}],"choices":[{"text":"b"}]}',
    b'{"a":NaN}', b'{"a":-NaN}', b'{"a":Infinity}', b'{"a":-Infinity}', b'{"a":+1}', b'{"a":1e400}', b'{"a":-1e400}',
    b'{"a":1e-400}', b'{"a":123456789012345678901234567890}', b'{"a":-0}', b'{"a":-0.0}', b'{"a":0.1e1}', b'{"a":1E+2}',
    b'{"a":9007199254740993.0}', b'{"a":1.7976931348623157e308}', b'{"a":2.2250738585072014e-308}',
    b'{"a":"\\ud800"}', b'{"a":"\\udc00\\ud800"}', b'{"a":"\x01"}', b'{"a":"\x7f"}', b'{"a":"\\u0000"}', b'{"a":"\\/"}',
    b'{"a":"\\x"}', b'{"a":"\xff"}', b'{"a":"\xed\xa0\x80"}', b'{"\xc3\xa9":1}', b'{"a":01}', b'{"a":1.}', b'{"a":-}',
    b'{"a":tru}', b'{"a":true }', b'{"a" :1}', b'{ }', b'{}', b'{"a":1,}', b'{"a":1} ', b'{"a":1}\x0c', b'{"a":1}\x1c',
    b'{"a":1}\xc2\x85', b'{"a":1} x', b'{"a":1}{"b":2}', b'{"a":1},{"b":2}', b'\xef\xbb\xbf{"a":1}', b' {"a":1}',
    b'{"a":\xef\xbb\xbf1}', b'[{"a":1}]', b'"text"', b'1', b'null',
    b'{"a":' + b'[' * 300 + b']' * 300 + b'}', b'{"a":' + b'[' * 3000 + b']' * 3000 + b'}',
    b'{"a":"' + b'\\u00e9' * 1000 + b'"}', b'{"ids":[' + b','.join(b'%d' % i for i in range(10_000)) + b']}',
]


@pytest.mark.parametrize("data", SHAPES)
def test_shapes_read_as_json_reads_them(data):
    agrees(data)
    agrees_whole(data)
    agrees_whole(b" \n" + data + b"\r\n")
    agrees_whole(data.decode("utf-8", "replace").encode("utf-16"))  # json detects UTF-16: jiter refuses it


def json_values():
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(st.characters(codec=None)))
    keys = st.sampled_from(["id", "model", "choices", "index", "text", "delta", "content", "token_ids", "usage",
                            "prompt_token_ids", "error", "object"]) | st.text(max_size=4)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(keys, inner, max_size=5), max_leaves=20)


def dumped(value, ensure_ascii: bool, compact: bool, duplicate: bool) -> bytes:
    """``value`` as an upstream may write it (any escapes, spacing), lone surrogates as their UTF-8-style bytes."""
    text = json.dumps({"v": value, "k": 1}, ensure_ascii=ensure_ascii,
                      separators=(",", ":") if compact else (", ", ": "))
    if duplicate:  # a key written twice: the last one counts
        text = text[:-1] + ',"v":0}'
    return text.encode("utf-8", "surrogatepass")


# bytes that make JSON invalid or strange at any place: quotes, backslashes, brackets, controls, stray bytes
EDITS = st.sampled_from([b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b" ", b"\x00", b"\x1f", b"\n", b"\xff",
                         b"\xc3", b"\x85", b"e", b"-", b"+", b".", b"0", b"N", b"I", b"u", b"\\u", b"\\ud800"])


@settings(max_examples=1500, deadline=None)
@given(json_values(), st.booleans(), st.booleans(), st.booleans(),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2), EDITS), max_size=3))
def test_any_object_reads_as_json_reads_it(value, ensure_ascii, compact, duplicate, edits):
    data = dumped(value, ensure_ascii, compact, duplicate)
    for at, how, piece in edits:  # insert, replace or delete at a position: valid or not, both must agree
        at %= len(data) + 1
        data = data[:at] + (b"" if how == 2 else piece) + data[at + (how > 0):]
    agrees_whole(data)
    agrees(data)


def test_event_shapes_other_than_one_line():
    """Multi-line data, CRLF, a comment, [DONE]: the same reading as before (the reference's)."""
    assert _sse_data(b"data: [DONE]") is None and _sse_data(b": keep-alive") is None
    assert _sse_data(b'data: {"a":\ndata: 1}') == {"a": 1}
    assert _sse_data(b'event: x\r\ndata:{"a":2}') == {"a": 2}
    assert _sse_data(b'data: {"a":') is _NOT_JSON
