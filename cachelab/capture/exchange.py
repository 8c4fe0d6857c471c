"""One proxied OpenAI request as raw bytes, and the record it becomes (built off the hot path).

The proxy keeps only what it must to stay byte-faithful while a response streams: the
request body, the complete SSE events of each upstream read (one or more events, as the
upstream sent them) with the read's arrival time, or the whole JSON body. The recorder
later calls ``Exchange.to_records`` (on its thread or in its process): it splits the reads
into events, reads token ids from the upstream's answer
(vLLM's ``return_token_ids``: ``prompt_token_ids`` and per-choice ``token_ids``), the cached
prompt tokens from ``usage.prompt_tokens_details.cached_tokens``, and falls back to the
model's tokenizer (``cachelab.capture.tokens``) when the upstream sent no ids. An exchange is
one record per choice (every prompt of a batch, each of its ``n`` choices, numbered by the
answer's ``index`` as ``cachelab serve --capture`` numbers its own), each with its own ids and
token times; those of an answer of several choices carry none of the server's cached tokens,
which are one engine request's there, not each choice's.

``cachelab.capture.injection`` adds to the request what the record needs (token ids, a stream's
usage) and the client did not ask for; ``Restorer`` and ``strip_body`` undo it, on the bytes (a read
of ordinary token events takes one pass of ``bytes.find``, whatever the number of
events in it; only a read holding a usage, a terminal or an id-only event is split): vLLM
writes the token-id fields as ``null`` when they were not asked for, so an injected
``"token_ids":[...]`` becomes ``"token_ids":null`` again; a usage-only event the client did
not ask for is dropped (its ``system_fingerprint`` goes back on the terminal chunk), and so
is a chat event that only exists to carry token ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from cachelab.capture.injection import echoes, n_choices
from cachelab.capture.json_bytes import loads, object_or_none
from cachelab.capture.recorder import CLIENT_CLOSED, RequestRecord

_EMPTY_DELTA = (b'"delta":{}', b'"finish_reason":null')
_FINGERPRINT = re.compile(rb'"system_fingerprint":"[^"]*"')
_RECORD_FIELDS = ("model", "prompt", "messages", "n", "echo", "stream", "user")  # of a request's body, what ``to_records`` reads
MIN_CREDENTIAL = 8  # characters of an Authorization credential from which it is starred in an error message
MAX_RECORDS = 1 << 16  # records of one exchange at most: choices answered, or asked for and never reached


@dataclass
class Exchange:
    """What the proxy saw of one request (raw), until the recorder turns it into a record."""

    endpoint: str
    arrival_unix_ns: int
    arrival: float                      # time.perf_counter() at arrival
    body: bytes | dict | None = None    # the request's body as the client sent it (``injection.apply``), or its fields
    session: str | None = None
    credential: str | None = None       # the client's Authorization credential: taken out of an error message
    stream: bool = False
    injected_ids: bool = False
    injected_usage: bool = False
    status: int = 0
    error: str | None = None
    response: bytes = b""               # the body of an answer that was not an event stream
    response_time: float | None = None  # perf_counter when it was complete (None: events, or no answer)
    events: list[bytes] = field(default_factory=list)        # per upstream read: its complete SSE events
    delim: bytes = b"\n\n"             # what ends an event: b"\r\n\r\n" or b"\r\r" for lines ending CRLF or CR
    event_times: list[float] = field(default_factory=list)   # perf_counter of that read

    def to_records(self, tokenizer) -> list[RequestRecord]:
        """The records of this exchange, one per choice (tokenizer: ``FallbackTokenizer``, used only
        without upstream ids)."""
        return to_records(self, tokenizer)

    def held_bytes(self) -> int:
        """The answer's bytes it holds, and its request's (bounded by ``--max-body-mb``)."""
        request = len(self.body) if isinstance(self.body, bytes) else 0
        return len(self.response) + sum(map(len, self.events)) + request


class Restorer:
    """Turns the upstream's events back into the stream the client would have got without the proxy.

    Besides nulling injected ids and dropping the injected usage event (not where the upstream
    sends usage unasked: ``_event``), it keeps vLLM's
    ``system_fingerprint`` where vLLM puts it: on the terminal chunk (a non-null
    ``finish_reason``) when no usage event follows, and only on the usage event otherwise. So
    when the proxy asked for usage (``injection.plan``: only of a request for one choice), the terminal
    chunk waits for the usage event, the next thing vLLM writes, and gets the fingerprint back.
    """

    def __init__(self, exchange: Exchange):
        self.x = exchange
        self.chat = exchange.endpoint.endswith("chat/completions")
        self.held: list[bytes] = []

    def feed(self, block: bytes) -> bytes:
        """What the client gets of ``block`` (one or more complete events of one upstream read). A read of
        ordinary token events (nothing to drop, hold or stamp: every token's read) has its injected ids
        nulled in one pass of ``bytes.find`` (``null_ids``); a read with an event to drop, hold or stamp
        goes event by event (docs/capture.md, "Where the proxy's CPU goes")."""
        x = self.x
        if self.held or b'"usage"' in block or b'"finish_reason":"' in block \
                or (self.chat and b'"delta":{}' in block):
            delim = x.delim
            return b"".join(out for event in _split(block, delim) for out in self._event(event + delim))
        return null_ids(block) if x.injected_ids else block

    def _event(self, event: bytes) -> list[bytes]:
        x = self.x
        if x.injected_usage and b'"usage"' in event and b'"choices":[]' not in event:
            # usage in a chunk of tokens, though the proxy asked for none there: the upstream forces
            # it (vLLM's --enable-force-include-usage: usage in every chunk and a usage event at the
            # end), so the client gets that event without the proxy too, and keeps it
            x.injected_usage = False
            held, self.held = self.held, []
            return held + self._event(event)
        if x.injected_usage and b'"choices":[]' in event and b'"usage"' in event:
            found = _FINGERPRINT.search(event)
            held, self.held = self.held, []
            return [_stamp(e, found.group(0)) for e in held] if found else held
        if x.injected_ids:
            event = null_ids(event)
            if self.chat and all(m in event for m in _EMPTY_DELTA) \
                    and b'"logprobs":{' not in event and b'"usage"' not in event:
                return []
        if x.injected_usage and (self.held or b'"finish_reason":"' in event):
            self.held.append(event)
            return []
        return [event]

    def close(self) -> bytes:
        held, self.held = self.held, []
        return b"".join(held)


def _split(block: bytes, delim: bytes) -> list[bytes]:
    """The events of a block of complete events, each without its blank-line delimiter."""
    return block.split(delim)[:-1]


def _stamp(event: bytes, fingerprint: bytes) -> bytes:
    """A terminal chunk with ``"system_fingerprint":"..."`` as vLLM appends it (last key)."""
    if b'"finish_reason":"' not in event or b'"system_fingerprint"' in event:
        return event
    end = event.rfind(b"}")
    return event[:end] + b"," + fingerprint + event[end:] if end > 0 else event


_TOKEN_IDS, _PROMPT_IDS = b'"token_ids":[', b'"prompt_token_ids":['
_NULL_TOKEN_IDS, _NULL_PROMPT_IDS = b'"token_ids":null', b'"prompt_token_ids":null'
_FIND_FROM = 1 << 10  # bytes from which ``null_ids`` nulls every list through views (``_null``)


def null_ids(data: bytes) -> bytes:
    """``"token_ids":[...]`` and ``"prompt_token_ids":[...]`` written as vLLM writes them when not
    asked: ``null`` (the bytes ``re.sub`` makes of ``"token_ids":\\[[^\\]]*\\]``, then of the prompt's
    pattern on that). Searched with ``bytes.find``: ``re`` scans byte by byte (a whole answer of
    1M prompt ids, 6 MB, took the event loop 11-12 ms of CPU here against 4-5 ms), and on a token's read
    its engine's code, run on the caches other processes left cold, cost the loop more than the finds
    (docs/capture.md, "Where the proxy's CPU goes"). A short block with one id list, a token event's, is
    cut around it; anything else goes through ``_null``, which copies once."""
    if len(data) < _FIND_FROM:
        start = data.find(_TOKEN_IDS)
        end = data.find(b"]", start + len(_TOKEN_IDS)) if start >= 0 else -1
        if end >= 0 and data.find(_TOKEN_IDS, end) < 0 and _PROMPT_IDS not in data:
            return data[:start + len(_TOKEN_IDS) - 1] + b"null" + data[end + 1:]
    return _null(data)


def _null(data: bytes) -> bytes:
    """``null_ids`` in one pass, copied once (the pieces are views, some 360 bytes a list nulled): two
    passes made two whole copies, a large answer held three times at once. The second pattern runs on
    the first one's output: a prompt's list ends at the first ``]`` that no output list (``token_ids``,
    nulled first) closed, and an output list inside it goes with it."""
    view, parts, at = memoryview(data), [], 0
    t, t_end = _next_list(data, _TOKEN_IDS, 0)
    p = data.find(_PROMPT_IDS)
    while t >= 0 or p >= 0:
        if p < 0 or 0 <= t < p:  # an output list, outside any prompt's
            parts += (view[at:t], _NULL_TOKEN_IDS)
            at = t_end + 1
            t, t_end = _next_list(data, _TOKEN_IDS, at)
            if 0 <= p < at:  # that one was inside the output list: the first pass left none of it
                p = data.find(_PROMPT_IDS, at)
            continue
        end, inside = data.find(b"]", p + len(_PROMPT_IDS)), []
        while 0 <= t < end:  # an output list in the prompt's closes the ] found: nulled first, it is no end
            inside.append((t, t_end))
            t, t_end = _next_list(data, _TOKEN_IDS, t_end + 1)
            end = data.find(b"]", end + 1)
        if end < 0:  # no prompt's list ends: nor would a later one; the output lists in it are nulled alone
            for start, stop in inside:
                parts += (view[at:start], _NULL_TOKEN_IDS)
                at = stop + 1
            break
        parts += (view[at:p], _NULL_PROMPT_IDS)
        at = end + 1
        p = data.find(_PROMPT_IDS, at)
    if not parts:
        return data
    parts.append(view[at:])
    return b"".join(parts)


def _next_list(data: bytes, key: bytes, at: int) -> tuple[int, int]:
    """The first ``key`` from ``at`` and the ``]`` that closes its list; (-1, -1) if none is closed (nor
    would a later one be)."""
    start = data.find(key, at)
    end = data.find(b"]", start + len(key)) if start >= 0 else -1
    return (start, end) if end >= 0 else (-1, -1)


def strip_body(body: bytes, exchange: Exchange) -> bytes:
    return null_ids(body) if exchange.injected_ids else body


_SCAN = json.JSONDecoder().scan_once  # the C scanner: no per-call wrapper cost, end offset checked
_NOT_JSON = object()  # ``_sse_data`` of an event whose data is not a JSON object


def _sse_data(event: bytes) -> dict | object | None:
    """The JSON of an SSE event's data lines: None for ``[DONE]`` or an event without data (a comment),
    ``_NOT_JSON`` for data that is not a JSON object; ``event`` without its delimiter."""
    if event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event:  # vLLM's one-line event
        data = event[6:]
    else:
        data = b"\n".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None
    parsed = object_or_none(data)  # jiter: a third of json's time for a vLLM chunk (``json_bytes``)
    return parsed if parsed is not None else _json_object(data)


def _json_object(data: bytes) -> dict | object:
    """An event's data as json's C scanner reads it, or ``_NOT_JSON``: the reference, which ``_sse_data``
    asks wherever jiter refuses the data."""
    try:
        text = data.decode(errors="replace")  # a stray byte in a text field must not hide the event's ids
        parsed, end = _SCAN(text, 0)
    except (ValueError, StopIteration, RecursionError):
        return _NOT_JSON
    return parsed if isinstance(parsed, dict) and (end == len(text) or text[end:].isspace()) else _NOT_JSON


def _choice_text(choice: dict):
    """A choice's text as the answer sent it (a string where it is well formed; None: none): a completion's
    ``text``, a chat's ``delta`` or ``message`` content, or that ``delta`` or ``message`` where it is no object."""
    if "text" in choice:
        return choice["text"]
    part = choice.get("delta") or choice.get("message")
    return part.get("content") if part.__class__ is dict else part


def _what(value) -> str:
    """A value of an answer, as an error names it: its JSON type, and the value where it is short."""
    shown = json.dumps(value) if isinstance(value, (int, float, str)) else ""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}
    return f"{kind.get(value.__class__, 'null')}{' ' + shown if shown and len(shown) <= 40 else ''}"


def _error_text(message: dict, credential: str | None) -> str | None:
    """The upstream's error message, the client's credential taken out where it echoes it ("Incorrect API
    key provided: Bearer sk-..."): no capture file holds what the client sent in ``Authorization``. One
    under ``MIN_CREDENTIAL`` characters is no secret (a placeholder such as "x" or "EMPTY") and is left,
    lest every "x" of a message be starred."""
    error = message.get("error")
    if error is None and message.get("object") == "error":
        error = message
    if error is None:
        return None
    text = str(error.get("message") if isinstance(error, dict) else error)
    return (text.replace(credential, "***") if credential and len(credential) >= MIN_CREDENTIAL else text)[:300]


@dataclass(slots=True)
class _Choice:
    """What the answer said of one choice (its ``index``): vLLM numbers prompt k's choices k*n .. k*n+n-1."""

    prompt_ids: list | None = None
    ids: list | None = field(default_factory=list)  # None: an event's ``token_ids`` was no list (no ids known)
    with_ids: bool = False     # an event of it carried token ids
    without_ids: bool = False  # an event of it carried none: vLLM's first chat event (the role alone) never does
    text_without_ids: bool = False  # an event carried text and no ids: the server's ids do not cover the output
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    counts: list[int | str] = field(default_factory=list)  # an event's ids, or its text (tokenized at the end)
    error: str | None = None   # what of it the answer sent that is no such field (a text that is no string)

    @property
    def have_ids(self) -> bool:
        """Whether the server's ids are the whole output: every event with text carried them, and some event
        did (or none lacked them). Any event without ids counted against it, so a chat stream from vLLM, whose
        role event carries no ``token_ids``, had its output ids taken from the fallback tokenizer."""
        return not self.text_without_ids and (self.with_ids or not self.without_ids)


def _request_prompts(body: dict) -> list[tuple[str | None, list[int] | None]]:
    """Each prompt of the request, as text or as token ids when the client sent ids: a completion's
    string, ids, or a batch of either; a chat's messages as ``role: content`` lines."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [(prompt, None)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [(None, prompt)]
    if isinstance(prompt, list) and prompt:
        return [(p, None) if isinstance(p, str) else
                (None, p) if isinstance(p, list) and all(isinstance(t, int) for t in p) else (None, None)
                for p in prompt]
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{m.get('role', '')}: {content or ''}" if isinstance(m, dict) else "")
        return [("\n".join(parts), None)]
    return []


def _last_user_text(body: dict) -> str | None:
    """A chat's last user message as sent (of content parts, its longest text: servers join them with
    their own separators), the tokenizer check's evidence (``Recorder``)."""
    messages = body.get("messages")
    for m in reversed(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                content = max((p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)),
                              key=len, default=None)
            return content if isinstance(content, str) else None
    return None


class _Fallback:
    """The fallback tokenizer's work on a request's prompts, done once per prompt, not once per choice
    (``n`` choices of one prompt tokenized it ``n`` times)."""

    def __init__(self, tokenizer, prompts: list[tuple[str | None, list[int] | None]]):
        self.tokenizer, self.prompts = tokenizer, prompts
        self.left = tokenizer.max_chars  # characters of text the exchange may still have tokenized
        self._prompt: dict[int, list[int] | None] = {}
        self._echoes: dict[int, list[str]] = {}

    def take(self, chars: int) -> bool:
        """Whether ``chars`` more characters fit the exchange's budget (taken from it if so)."""
        if chars > self.left:
            return False
        self.left -= chars
        return True

    def encode(self, text: str) -> list[int] | None:
        """An output's tokens, or None past the budget."""
        return self.tokenizer.encode(text) if self.take(len(text)) else None

    def prompt(self, k: int) -> list[int] | None:
        """Prompt ``k``'s tokens (its text, with the tokenizer's special tokens), or None past the budget."""
        if k not in self._prompt:
            text = self.prompts[k][0]
            self._prompt[k] = self.tokenizer.encode(text, prompt=True) if self.take(len(text)) else None
        return self._prompt[k]

    def echoes(self, k: int) -> list[str]:
        """What a server echoes of prompt ``k``: its text, or for ids its decoding, special tokens kept
        (vLLM's) or left out; the echo of ids was found only where the server left them out."""
        if k not in self._echoes:
            text, ids = self.prompts[k] if k < len(self.prompts) else (None, None)
            self._echoes[k] = [text] if ids is None else \
                list(dict.fromkeys(self.tokenizer.decode(ids, special=keep) for keep in (True, False)))
        return self._echoes[k]


def _token_events(c: _Choice, echoed: int, fallback: _Fallback, output: tuple[str, list[int]] | None
                  ) -> tuple[list[float], list[int], int]:
    """The choice's token-bearing events and their token counts; an event of text (no ids) is tokenized
    without the echoed prompt's first ``echoed`` characters (its tokens were counted as output). Events of
    text over the fallback's budget, all of them, are left out; their characters are the third value.
    ``output``: the output's text and the fallback's ids of it (the budget's already): an event of that
    text alone (a whole answer) counts those ids, not tokenized again (it was, doubling the writer's work)."""
    texts = sum(len(count) for count in c.counts if isinstance(count, str)) - echoed
    tokenize = texts <= 0 or output is not None or fallback.take(texts)
    times, counts = [], []
    for when, count in zip(c.times, c.counts):
        if isinstance(count, str):
            cut = min(echoed, len(count))
            echoed -= cut
            text = count[cut:] if cut else count
            if not tokenize or not text:
                count = 0
            elif output is not None and text == output[0]:
                count = len(output[1])
            else:
                count = len(fallback.tokenizer.encode(text))
        if count:
            times.append(when)
            counts.append(count)
    return times, counts, 0 if tokenize else texts


def to_records(x: Exchange, tokenizer) -> list[RequestRecord]:
    """Parse what the upstream answered into one ``RequestRecord`` per choice (tokenizer:
    ``FallbackTokenizer``): every prompt of a batch and every one of its ``n`` choices, each with
    its ``index``, its prompt's ids, its own output ids and token times; an answer without any
    choice (an error, no answer at all) is one record."""
    body = _record_fields(x.body)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    # read here, not on the request's path: a request the proxy records without serving it (its client gone
    # first) has its body parsed by no one else
    stream = x.stream or body.get("stream") is True
    user = body.get("user")
    session = x.session or (user if isinstance(user, str) else None)
    error, upstream_id, usage, top_prompt = x.error, None, None, None
    choices: dict[int, _Choice] = {}
    if x.response_time is None:  # an event stream (or no answer at all)
        # parsed one at a time (a list of every parsed event of a stream of tiny ones took ~40x its bytes)
        messages = ((t, _sse_data(e)) for t, block in zip(x.event_times, x.events) for e in _split(block, x.delim))
        if x.status == 200 and error is None and not ends_done(x.events):
            error = "upstream stream ended without [DONE]"  # e.g. closed where only its close ended the body
    else:  # a whole body: the answer to a request that did not stream, or an error answer to one that did
        whole = _json_body(x.response)
        messages = [(x.response_time, whole if isinstance(whole, dict) else None)]
        if not isinstance(whole, dict) and x.status == 200 and error is None:
            error = "upstream answered 200 with a body that is not a JSON object"  # passed on as it came
    not_json = 0  # events whose data is not a JSON object: passed on to the client, and the record failed, saying so
    for when, message in messages:
        if message is None or message is _NOT_JSON:
            not_json += message is _NOT_JSON
            continue
        get = message.get  # bound once: the loop runs per event of every stream
        error = error or _error_text(message, x.credential)
        upstream_id = upstream_id or get("id")
        model = get("model") or model
        if get("usage"):
            usage = message["usage"]
        if top_prompt is None and get("prompt_token_ids"):
            top_prompt = message["prompt_token_ids"]  # a chat's, at the top
        listed = get("choices")
        if listed is not None and listed.__class__ is not list:
            error = error or f"upstream answer's choices are {_what(listed)}, not an array: not read"
            continue
        for position, choice in enumerate(listed or ()):
            if choice.__class__ is not dict:  # parsed JSON: no subclasses
                error = error or f"upstream answered a choice that is {_what(choice)}: not read"
                continue
            index = choice.get("index", position)  # one left out: its place (0 in an event of one choice)
            if index.__class__ is not int or index < 0:  # (an int subclass is a bool)
                error = error or f"upstream answered a choice's index that is {_what(index)}: not read"
                continue
            c = choices.get(index)
            if c is None:
                if len(choices) >= MAX_RECORDS:  # a hostile answer of millions of choices: a record each took GBs
                    error = error or f"upstream answered over {MAX_RECORDS} choices: the rest not recorded"
                    continue
                c = choices[index] = _Choice()
            if c.prompt_ids is None and choice.get("prompt_token_ids"):
                c.prompt_ids = choice["prompt_token_ids"]  # a completion's, in each choice's first
            ids = choice.get("token_ids")
            text = _choice_text(choice)
            if text is None:
                text = ""
            elif text.__class__ is not str:  # the output's text unknown: the record fails, saying why
                c.error = c.error or f"upstream choice {index}'s text is {_what(text)}, not a string: not read"
                text = ""
            if ids is None:
                c.without_ids = True
                c.text_without_ids = c.text_without_ids or bool(text)
            else:
                c.with_ids = True
                if ids.__class__ is not list:  # "token_ids": 5: no ids known of this choice's output (``_ids``)
                    c.ids, ids = None, (ids,)
                elif c.ids is not None:
                    c.ids.extend(ids)
            c.texts.append(text)
            if (text if ids is None else ids) and when is not None:
                c.times.append(when - x.arrival)
                c.counts.append(text if ids is None else len(ids))
    if not_json and error is None:  # its tokens, if any, are not in the record: it is no whole answer
        error = f"upstream stream had {not_json} event{'s' if not_json > 1 else ''} whose data is not a JSON object"
    if not choices and x.status == 200 and error is None:  # vLLM answers each choice asked for (a chat stream its
        error = "upstream answered 200 without any choice"  # role first): none is no answer, not an empty output
    if x.status != 200 and error is None:
        error = f"upstream answered HTTP {x.status}"
    prompts = _request_prompts(body)
    echo = echoes(body, x.endpoint)
    n = n_choices(body)
    # the choices asked for that the answer never reached (a stream cut after prompt 0's) are failed requests too,
    # and so is each one a client withdrew before any came (499, as cachelab serve --capture records them);
    # an answer of none (an error, the upstream's or the proxy's) is one record
    asked = range(min(len(prompts) * n, MAX_RECORDS))
    indices = sorted(choices.keys() | asked)[:MAX_RECORDS] if choices or (x.status == CLIENT_CLOSED and asked) else [None]
    fallback = _Fallback(tokenizer, prompts)
    user_text = _last_user_text(body) if x.endpoint.endswith("chat/completions") else None
    records = []
    for index in indices:
        c = choices.get(index)
        if c is None:  # nothing of it came: no ids; one asked for that an answer of others left out fails, saying so
            c = _Choice(without_ids=True, error=None if index is None else
                        f"upstream answered no choice {index} of the {len(asked)} asked for")
        rec = RequestRecord(endpoint=x.endpoint, arrival_unix_ns=x.arrival_unix_ns, status=x.status,
                            error=error or c.error, model=model, stream=stream, session=session,
                            upstream_id=upstream_id, index=index)
        k = 0 if index is None else index // n
        prompt_text, request_ids = prompts[k] if k < len(prompts) else (None, None)
        server_prompt, output_ids = c.prompt_ids or top_prompt, c.ids
        upstream_ids = server_prompt is not None and c.have_ids
        output_text = "".join(c.texts)
        echoed = 0  # characters of the echoed prompt before the output (vLLM echoes no text where it sends ids)
        if echo and output_text and not upstream_ids:
            echoed = next((len(e) for e in fallback.echoes(k) if e and output_text.startswith(e)), 0)
            output_text = output_text[echoed:]
        if isinstance(usage, dict) and len(indices) == 1:
            # the answer's totals, and one engine request's cached tokens: with several choices (n > 1, a batch)
            # they are not this choice's (vLLM reports its last prompt's last-finished choice's in a whole answer)
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):  # as sent: stored as an integer, or null where it is none ("lots")
                rec.cached_tokens = details.get("cached_tokens")
        prompt_ids = server_prompt
        if upstream_ids:
            rec.token_source = "upstream"
        elif x.status == 200 and rec.error is None and (server_prompt is not None or prompt_text is not None
                                                    or request_ids is not None):
            # the output's ids are the fallback's; the prompt's the server's where it sent them (vLLM does with
            # a streamed echo), else the client's ids or the fallback's tokens of its text
            rec.token_source = "tokenizer"
            if prompt_ids is None:
                prompt_ids = request_ids if request_ids is not None else fallback.prompt(k)
            output_ids = fallback.encode(output_text)
            if prompt_ids is None or output_ids is None:  # past the budget: no ids, the text's length kept
                rec.token_source, prompt_ids = None, None
                rec.untokenized_chars = len(output_text) + len(prompt_text or "")
        if rec.token_source is not None:
            rec.prompt_ids, rec.output_ids = _ids(prompt_ids), _ids(output_ids)
            if rec.prompt_ids is None or rec.output_ids is None:
                rec.token_source, rec.prompt_ids, rec.output_ids = None, None, None
                rec.error = rec.error or "upstream token ids out of range (not integers from 0 to 2^31-1)"
        times, counts, untimed = _token_events(c, echoed, fallback, (output_text, output_ids)
                                               if rec.token_source == "tokenizer" else None)
        rec.untokenized_chars = rec.untokenized_chars or untimed
        if rec.untokenized_chars:
            rec.error = rec.error or (f"fallback tokenizer: {rec.untokenized_chars:,} characters of text not "
                                      f"tokenized, past its {tokenizer.max_chars:,} per answer (--max-tokenize-mb)")
        if times:
            rec.token_times_s = np.asarray(times)
            rec.token_counts = np.asarray(counts, dtype=np.int32)
            rec.first_token_s, rec.last_token_s = times[0], times[-1]
        rec.prompt_text, rec.output_text, rec.user_text = prompt_text, output_text, user_text
        records.append(rec)
    return records



def _ids(values) -> np.ndarray | None:
    """Token ids as int32, or None where they are no token ids (negative, past int32, fractions, no list, lists
    of lists): a negative one failed the whole ``trace build --from-capture``, a fraction was cut unsaid, and
    ``"token_ids": [1, [2]]`` raised, which lost the record."""
    if values.__class__ is not list:
        return None
    try:
        ids = np.asarray(values)
    except (ValueError, TypeError, RecursionError):  # ragged, or nested past NumPy's dimensions
        return None
    if ids.size == 0:
        return np.zeros(0, dtype=np.int32)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        return None
    return ids.astype(np.int32)


def _record_fields(body: bytes | dict | None) -> dict:
    """The request's fields a record reads (``_RECORD_FIELDS``), from its body as the client sent it."""
    if isinstance(body, (bytes, bytearray)):
        parsed = _json_body(body)
        return {key: parsed[key] for key in _RECORD_FIELDS if key in parsed} if isinstance(parsed, dict) else {}
    return body or {}


def _json_body(body: bytes):
    try:
        return loads(body) if body else None
    except (ValueError, RecursionError):
        return None


def ends_done(events: list[bytes]) -> bool:
    """Whether the stream's last event is ``data: [DONE]``, which every OpenAI-compatible server
    writes last: without it the stream was cut, however its connection ended."""
    lines = events[-1].rstrip().splitlines() if events else []  # LF, CRLF or CR
    last = lines[-1] if lines else b""
    return last.startswith(b"data:") and last[5:].strip() == b"[DONE]"
