"""The OpenAI API as the live server speaks it: request models and responses (chats rendered by chat_format).

Field names are OpenAI's, plus vLLM's extensions where vLLM has one: ``return_token_ids``
(``prompt_token_ids`` and ``token_ids`` in each choice of a completion; ``prompt_token_ids``
at the top of a chat completion and ``token_ids`` in its choice; in a stream the prompt ids
come once per choice, in its first chunk, and each chunk carries its new ids), ``ignore_eos``,
``stop_token_ids``, ``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``stream_options.
continuous_usage_stats`` (usage in every chunk), a chat's ``return_prompt_text`` and
``usage.prompt_tokens_details.cached_tokens``. Errors have OpenAI's
shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cachelab.live.sampling import SamplingParams

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
               413: "RequestEntityTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


# vLLM's type for a body its schema refuses (FastAPI's RequestValidationError: malformed JSON, a field
# missing or of the wrong type), HTTPStatus.BAD_REQUEST.phrase; its own checks' 400s are BadRequestError
INVALID_BODY = "Bad Request"


class APIError(Exception):
    """A request the server refuses: HTTP ``status``, OpenAI-shaped body; ``kind``: its ``type``
    where it is not the status's own (``INVALID_BODY``)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind or ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


def invalid(message: str, param: str | None = None, value=None) -> APIError:
    """A 400 as vLLM answers its VLLMValidationError: ``param`` is its ``parameter`` (null where it
    names none), and the message ends ``(parameter=..., value=...)`` with those it names
    (vllm/exceptions.py's ``__str__``; the real server's, checked)."""
    named = [f"{key}={v}" for key, v in (("parameter", param), ("value", value)) if v is not None]
    return APIError(400, f"{message} ({', '.join(named)})" if named else message, param)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk too (with include_usage)


TokenId = Annotated[int, Field(ge=0)]
MAX_STOP_STRINGS = 4  # OpenAI's limit, and vLLM's (VLLM_MAX_STOP_STRINGS)
# Fields OpenAI's API (and vLLM's, as ``X | None``) lets a client send as null, meaning the default:
# the openai client sends an argument given as None as null. A completion's null max_tokens is its
# default 16 (vLLM's normalize_null_max_tokens; it ran to the end of the context), a chat's no limit
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                             "frequency_penalty", "n", "stream", "stop_token_ids", "return_token_ids", "echo",
                             "max_tokens"})


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data
    model: str | None = None  # vLLM serves its model to a request that names none
    max_tokens: int | None = None
    temperature: float = 1.0  # the bounds of these four: check_bounds
    top_p: float = 1.0
    top_k: int | None = None  # vLLM's: -1 or 0 is every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's bounds: torch takes a 64-bit seed
    return_token_ids: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | bool | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: dict | None = None
    # vLLM's extensions that change the answer; this server does none of them (see unsupported)
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict | None = None
    cache_salt: str | None = None  # vLLM keeps each salt's prefix-cache blocks apart; not done here
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict | None = None  # vLLM ends an answer that repeats an n-gram
    skip_special_tokens: bool = True
    user: str | None = None  # OpenAI's end-user id: the session key of --capture when no X-Session-Id is sent
    request_id: str | None = None  # vLLM's: the answer's id is cmpl-/chatcmpl- and this (an X-Request-Id header wins)
    # vLLM's: tokens per streamed chunk after the first, raised to the server's --stream-interval; a whole answer's ignores it
    stream_interval: int | None = Field(None, ge=1)

    def check_bounds(self) -> None:
        """The sampling values' bounds, as vLLM's SamplingParams checks them and in its words (they
        were pydantic's, which name no value: 'Input should be greater than 0'); only temperature's
        and top_p's name their parameter and value there."""
        t, top_p, top_k, rep = self.temperature, self.top_p, self.top_k or 0, self.repetition_penalty
        for wrong, message, param, value in (
                (not -2 <= self.presence_penalty <= 2,
                 f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", None, None),
                (not -2 <= self.frequency_penalty <= 2,
                 f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", None, None),
                (not math.isfinite(rep), f"repetition_penalty must be a finite number, got {rep}.", None, None),
                (rep <= 0, f"repetition_penalty must be greater than zero, got {rep}.", None, None),
                (not math.isfinite(t), f"temperature must be a finite number, got {t}.", "temperature", t),
                (t < 0, f"temperature must be non-negative, got {t}.", "temperature", t),
                (t > 2, f"temperature must be in [0, 2], got {t}.", "temperature", t),
                (not 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p),
                (top_k < -1, f"top_k must be 0 (disable), or at least 1, got {top_k}.", None, None),
                (not 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}.", None, None),
                (self.min_tokens < 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                 None, None)):
            if wrong:
                raise invalid(message, param, value)

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do (refused rather than ignored): any
        logprobs asked for (a completion's ``logprobs: 0`` asks for the sampled token's), a
        suffix (vLLM refuses it too without a fill-in-the-middle model), a response format
        other than text, and vLLM's extensions that bias, restrict
        or truncate (an empty ``bad_words`` or ``logit_bias`` is no change, so it passes), and
        those of a chat that change its prompt beyond DeepSeek's template (vLLM's ``echo``, a
        ``chat_template``, ``documents``). A ``cache_salt`` too, even empty (vLLM
        refuses that one): served, a salted prompt hit other salts' blocks."""
        fields = ("tools", "echo", "suffix", "top_logprobs", "logprob_token_ids", "logit_bias",
                  "allowed_token_ids", "bad_words", "use_beam_search", "structured_outputs",
                  "chat_template", "documents")
        refused = [f for f in fields if getattr(self, f, None)]
        refused += [f for f in ("prompt_logprobs", "truncate_prompt_tokens", "cache_salt", "prompt_embeds")
                    if getattr(self, f, None) is not None]
        if self.repetition_detection and self.repetition_detection.get("max_pattern_size", 0) != 0:  # 0: off
            refused.append("repetition_detection")
        if self.logprobs is not None and self.logprobs is not False:
            refused.insert(0, "logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            refused.append("response_format")
        return refused

    def sampling(self, max_tokens: int, stream_interval: int = 1) -> SamplingParams:
        """``stream_interval``: the server's ``--stream-interval``, which a streamed request may raise (vLLM's clamp)."""
        if self.min_tokens > max_tokens:  # vLLM's check and words
            raise invalid(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {self.min_tokens}.")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k or 0, 0),
                              seed=None if self.seed == -1 else self.seed,  # vLLM: -1 is no seed
                              stop=stop, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_p=self.min_p,
                              stream_interval=max(self.stream_interval or 1, stream_interval) if self.stream else 1)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # vLLM's order (its schema's first error names the param) and bound: a negative id is the schema's refusal
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None  # vLLM's, refused as by a vLLM without --enable-prompt-embeds

    def unsupported(self) -> list[str]:
        """A completion's ``echo`` is served (its prompt's text before its answer's, as vLLM's); a chat's is not."""
        return [f for f in super().unsupported() if f != "echo"]


# content parts vLLM reads as text, each by its field; one whose field is null it skips
TEXT_PARTS = {"text": "text", "refusal": "refusal", "thinking": "thinking"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str  # any: vLLM takes a role its types do not name and the template decides (DeepSeek's drops it)
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's, OpenAI's shape: {id, type, function: {name, arguments}}
    tool_call_id: str | None = None  # a tool message's: the call it answers
    reasoning: Any = None  # an assistant's thinking, written back in thinking mode (V4 writes any value as text)
    tools: Any = None  # a developer message's tools, which V4 offers the model: refused (check_chat)

    def parts(self) -> list[str] | None:
        """The message's text parts as vLLM hands them to DeepSeek-V4's encoding (a string is one
        part, a part whose field is null skipped); None where the content is null."""
        if self.content is None or isinstance(self.content, str):
            return None if self.content is None else [self.content]
        parts = []
        for part in self.content:
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise APIError(400, f"message content of type {kind!r} is not supported; send text", "messages")
            if part.get(TEXT_PARTS[kind]) is not None:
                parts.append(str(part[TEXT_PARTS[kind]]))
        return parts

    def text(self) -> str:
        """The message's text as V4's encoding reads it: its parts joined by a blank line (V4's
        flatten_content_blocks), a tool message's by a newline (vLLM joins those before V4 sees them)."""
        return ("\n" if self.role == "tool" else "\n\n").join(self.parts() or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None  # a chat's only: vLLM's completions know no such field and ignore it
    return_prompt_text: bool | None = None  # vLLM's: answer with the prompt the template made
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # needs tools (see check), which are refused: served only as "none"
    # vLLM's chat extensions: add_generation_prompt and continue_final_message served (DeepSeek's template
    # and transformers' continuation), the others refused (see unsupported)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None  # read as vLLM's V4 renderer reads them: chat_format.chat_mode
    documents: list[dict] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _reasoning_content(cls, data):
        """vLLM's: an assistant's ``reasoning_content`` (the deprecated name) is its ``reasoning``
        where that is null (a chat completion's; its /tokenize reads ``reasoning`` alone)."""
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            data = {**data, "messages": [{**m, "reasoning": m["reasoning_content"]} if isinstance(m, dict) and
                                         m.get("reasoning_content") is not None and m.get("reasoning") is None else m
                                         for m in data["messages"]]}
        return data

    def check_bounds(self) -> None:
        """The sampling bounds, and ``top_logprobs``' as vLLM's check_logprobs bounds it, in its words."""
        super().check_bounds()
        if (top := self.top_logprobs) is not None and top < 0 and top != -1:
            raise invalid("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
        if top is not None and (top == -1 or top > 0) and not self.logprobs:
            raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")

    def check(self) -> None:
        """vLLM's refusals of a chat its schema takes: an empty ``tools`` list, a ``tool_choice``
        without tools, and those of ``check_chat``."""
        if self.tools == []:  # vLLM's words
            raise invalid("`tools` must not be an empty array. Either provide at least one tool or omit the "
                          "field entirely.", "tools")
        if self.tool_choice not in (None, "none") and self.tools is None:  # vLLM's check_tool_usage, its words
            raise invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
        check_chat(self)


# transformers' refusal (apply_chat_template), which vLLM answers when the request left add_generation_prompt
# at its default of true; one that sends it true meets vLLM's own check first
CONTINUE_WITH_PROMPT = ("continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                        "when you want the model to continue the final message, and add_generation_prompt when you want "
                        "to add a header that will prompt it to start a new assistant message instead.")


def check_chat(req: ChatCompletionRequest | TokenizeChatRequest) -> None:
    """vLLM's refusals of a chat to render, in its words (the real server's): continuing the last
    message while adding the generation prompt, a template in ``chat_template_kwargs`` (vLLM's
    without ``--trust-request-chat-template``), and a null content in any message but an
    assistant's or a named function's (its message types let only those be null; a message
    without content is an empty one). A developer message's ``tools`` are refused as a request's
    are (V4 offers them to the model)."""
    if (req.chat_template_kwargs or {}).get("chat_template") is not None:
        raise invalid("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                      if "add_generation_prompt" in req.model_fields_set else CONTINUE_WITH_PROMPT)
    for i, m in enumerate(req.messages):
        if m.role == "developer" and m.tools:
            raise APIError(400, f"messages.{i}.tools is not supported by this server", f"messages.{i}.tools")
        nullable = m.role == "assistant" or (m.role == "function" and m.name is not None)
        if m.content is None and "content" in m.model_fields_set and not nullable:
            raise APIError(400, f"messages.{i}.content: a {m.role} message's content cannot be null",
                           f"messages.{i}.content")


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``/tokenize`` of a prompt."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``/tokenize`` of a chat: the prompt its chat completion would have."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template adds BOS
    return_token_strs: bool | None = False
    tools: list[dict] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None  # as a chat completion's (vLLM's /tokenize has no reasoning_effort)

    def check(self) -> None:
        """A chat completion's refusals, and fields that would render another prompt than a chat
        completion's (which refuses them too)."""
        if refused := [f for f in ("tools", "chat_template") if getattr(self, f)]:
            raise APIError(400, f"{refused[0]} is not supported by this server", refused[0])
        check_chat(self)


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2 ** 63 - 1)]]


# a JSON escape of a UTF-16 surrogate (D800-DFFF): a pair decodes to one character, a lone one to a str that no
# UTF-8 encoder takes (the tokenizer's TypeError, a 500; an answer that echoes it, a stream cut mid-way)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(raw: bytes, data) -> tuple[str, int] | None:
    """The first string of a body (``raw``, parsed as ``data``; a key or a value, in document order)
    that holds a lone surrogate: its field path (``messages.0.content``; empty for a top-level key)
    and where. Walked only where ``raw`` holds a surrogate escape."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        children = []
        for key, child in items:
            field = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and (at := _surrogate_at(key)) is not None:
                return path, at
            if isinstance(child, str) and (at := _surrogate_at(child)) is not None:
                return field, at
            children.append((field, child))
        stack.extend(reversed(children))
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def new_id(prefix: str, given: str | None = None) -> str:
    """An answer's id: ``prefix-given``, as vLLM names it after the client's X-Request-Id header or
    body ``request_id`` (a client or proxy ties the answer to its request by it), else a random one."""
    return f"{prefix}-{uuid.uuid4().hex if given is None else given}"


def usage(num_prompt: int, num_output: int, cached: int | None = None, created: int | None = None) -> dict:
    """A stream's usage (its usage chunk: ``cached``, and a chat's ``created`` cache tokens, vLLM's
    ``created_cache_tokens``); ``completion_body`` writes a whole answer's, with vLLM's nulls."""
    use = {"prompt_tokens": num_prompt, "total_tokens": num_prompt + num_output, "completion_tokens": num_output}
    if cached is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached}
        if created is not None:
            use["prompt_tokens_details"]["created_cache_tokens"] = created
    return use


def _body(rid: str, created: int, model: str, obj: str, chat: bool, choices, top: dict, stream: bool) -> dict:
    """``choices``: (index, content, finish_reason, stop_reason, token_ids, prompt_ids) each; the
    ids as vLLM writes them, ``null`` where not asked for (the capture proxy restores the client's
    bytes on that form): the prompt's in each choice of a completion, at the top of a chat
    completion (``top``'s ``prompt_token_ids``). Keys in vLLM's order (its response models' field
    order): a whole completion's choice has its ids before the prompt's, a chunk's after;
    ``top``: the keys after ``choices``."""
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
    for index, content, finish, stop_reason, token_ids, prompt_ids in choices:
        choice = {"index": index, **content, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
        if stream:
            ids = {"token_ids": token_ids} if chat else {"prompt_token_ids": prompt_ids, "token_ids": token_ids}
        else:  # with vLLM's null prompt_logprobs (a completion's) and routed_experts
            ids = {"token_ids": token_ids} if chat else {"token_ids": token_ids, "prompt_logprobs": None,
                                                         "prompt_token_ids": prompt_ids}
            ids["routed_experts"] = None
        body["choices"].append({**choice, **ids})
    body.update(top)
    return body


# the null fields of vLLM's chat message after its content (OpenAI's, and vLLM's reasoning)
_MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}
# the null fields that end vLLM's whole answers (its KV and encoder-cache transfer, its per-request metrics)
_TRANSFER_NULLS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def completion_body(rid: str, model: str, answers, use: dict, chat: bool, fingerprint: str | None = None,
                    prompt_text: str | None = None) -> dict:
    """A whole (non-streamed) completion or chat completion; ``answers``: (text, finish_reason,
    stop_reason, token_ids, prompt_ids) per choice, in index order; ``fingerprint``: the
    server's ``system_fingerprint``; ``prompt_text``: a chat's rendered prompt, when asked for."""
    choices = [(i, {"message": {"role": "assistant", "content": text, **_MESSAGE_NULLS}} if chat else {"text": text},
                finish, stop, tokens, prompt) for i, (text, finish, stop, tokens, prompt) in enumerate(answers)]
    details = use.get("prompt_tokens_details")
    if details is not None:  # vLLM's whole usage: every detail, null where it has none
        details = {"cached_tokens": details["cached_tokens"],
                   "created_cache_tokens": details.get("created_cache_tokens"), "multimodal_tokens": None}
    top = {"service_tier": None, "system_fingerprint": fingerprint,
           "usage": {**use, "prompt_tokens_details": details, "completion_tokens_details": None}}
    if chat:
        top |= {"prompt_logprobs": None, "prompt_token_ids": answers[0][4] if answers else None,
                "prompt_text": prompt_text}
    top |= _TRANSFER_NULLS
    return _body(rid, int(time.time()), model, "chat.completion" if chat else "text_completion", chat, choices, top,
                 stream=False)


def chunk_body(rid: str, created: int, model: str, index: int, text: str | None, finish, stop_reason, token_ids,
               prompt_ids, chat: bool, first: bool, use: dict | None = None, fingerprint: str | None = None,
               prompt_text: str | None = None) -> dict:
    """One streamed chunk of choice ``index``; ``prompt_ids`` only in a choice's first (vLLM's
    placement); a chat's first chunk of a choice carries the assistant's role (and the rendered
    ``prompt_text`` when asked for), and every chunk its content, ``""`` included (vLLM's delta
    without a reasoning or tool parser); a chat's choice has only the keys vLLM sets (its role
    chunk no ids, a ``stop_reason`` only where it ends). ``use``: the continuous usage;
    ``fingerprint``: on a terminal chunk that no usage chunk follows."""
    if chat:
        content = {"delta": {"role": "assistant", "content": text or ""} if first else {"content": text or ""}}
    else:
        content = {"text": text or ""}
    top = {} if use is None else {"usage": {**use, "completion_tokens_details": None} if chat else use}
    if fingerprint is not None:
        top["system_fingerprint"] = fingerprint
    if chat and first:
        top |= {"prompt_token_ids": prompt_ids, "prompt_text": prompt_text}
    body = _body(rid, created, model, "chat.completion.chunk" if chat else "text_completion", chat,
                 [(index, content, finish, stop_reason, token_ids, prompt_ids)], top, stream=True)
    if chat:
        choice = body["choices"][0]
        for key in ("stop_reason", "token_ids") if first else ("stop_reason",) if finish is None else ():
            del choice[key]
    return body


def usage_chunk(rid: str, created: int, model: str, use: dict, chat: bool, fingerprint: str | None = None) -> dict:
    """The usage chunk that ends a stream asking for it, with the ``system_fingerprint``."""
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}
    if fingerprint is not None:
        body["system_fingerprint"] = fingerprint
    return body
