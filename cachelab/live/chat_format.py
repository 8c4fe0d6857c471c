"""DeepSeek-V4's chat format, in its chat and thinking modes, as vLLM renders it for a V4 model.

vLLM serves a V4 model with V4's own encoding (its ``deepseek_v4`` tokenizer mode, chosen by the
architecture; a Jinja template of the tokenizer is not read), in thinking mode unless the request
says otherwise. A client that sends the same chat to vLLM and to ``cachelab serve`` gets the same
prompt token ids, so the Engram rows a chat reads are those it reads served by vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cachelab.live.protocol import APIError, ChatMessage, invalid

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"  # DeepSeek-V4's tool-call markup token
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the text to continue
# the text V4's thinking mode opens the prompt with, per effort (its REASONING_EFFORT_PROMPTS)
EFFORT_TEXT = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
        "scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
        "resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
        "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"),
}
# the roles V4's thinking mode keeps before the last user turn, besides an assistant's (its reasoning dropped)
_KEPT = ("user", "system", "tool", "latest_reminder", "direct_search_results")


@dataclass(frozen=True)
class ChatMode:
    """How V4 renders a chat: ``thinking`` (else chat mode), the ``effort`` text that opens a
    thinking prompt, and ``drop_thinking`` (earlier turns' reasoning and developer messages left
    out before the last user turn)."""

    thinking: bool = True
    effort: str = "high"
    drop_thinking: bool = True


def chat_mode(kwargs: dict | None, reasoning_effort: str | None = None) -> ChatMode:
    """The mode vLLM renders a V4 chat in: its request's ``reasoning_effort`` set over the
    ``chat_template_kwargs`` one and, unless the kwargs name ``enable_thinking``, setting it (not
    ``none``); thinking unless ``thinking`` or ``enable_thinking`` is named and neither is truthy;
    an effort ``none`` is chat mode, ``max`` max, ``low``/``minimal``/``medium`` low and any other
    string high; a thinking chat without one high. Other kwargs are ignored, as V4's renderer
    ignores them (vLLM's DeepseekV4Tokenizer.apply_chat_template)."""
    kwargs = dict(kwargs or {})
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
        kwargs.setdefault("enable_thinking", reasoning_effort != "none")
    thinking = (bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))
                if "thinking" in kwargs or "enable_thinking" in kwargs else True)
    effort = kwargs.get("reasoning_effort")
    if not isinstance(effort, str):
        effort = "high"
    elif effort == "none":
        thinking, effort = False, "low"
    elif effort in ("low", "minimal", "medium"):
        effort = "low"
    elif effort != "max":
        effort = "high"
    return ChatMode(thinking, effort, bool(kwargs.get("drop_thinking", True)))


def _arguments(function: dict) -> dict:
    """A call's arguments as vLLM hands them to the template: a JSON object string parsed, and
    anything else (empty, not JSON, JSON but not an object) an empty object, as vLLM coerces it."""
    args = function.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    return args if isinstance(args, dict) else {}


def _tool_calls(index: int, calls: list[dict]) -> str:
    """An assistant's tool calls in DeepSeek-V4's DSML block (its encoding_dsv4's, vLLM's
    ``deepseek_v4_encoding``): each argument a parameter, a string as is, any other value as JSON."""
    invokes = []
    for j, call in enumerate(calls):
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):  # vLLM's words
            raise invalid("chat completions only support assistant tool_calls of type 'function'.", "tool_calls")
        if not isinstance(name := function.get("name"), str):
            raise APIError(400, f"messages.{index}.tool_calls.{j}.function.name: a tool call needs its function's "
                                "name as a string", f"messages.{index}.tool_calls.{j}.function.name")
        params = "\n".join(f'<{DSML}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
                           f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}parameter>'
                           for k, v in _arguments(function).items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


@dataclass
class _Turn:
    """One message as V4 renders it: user and tool messages in a row merged into one user turn
    (``blocks``: a tool result's call id, or None for a text; the text), ``at`` the index of the
    last message it holds, ``order`` the call ids of the last assistant's tool calls before it."""

    role: str
    at: int
    text: str = ""
    message: ChatMessage | None = None
    blocks: list[tuple[str | None, str]] | None = None
    order: dict[str, int] | None = None


def _turns(messages: list[ChatMessage], texts: list[str]) -> list[_Turn]:
    """V4's merge_tool_messages and the tool-call order its sort_tool_results_by_call_order uses."""
    turns: list[_Turn] = []
    order: dict[str, int] = {}
    for i, (m, text) in enumerate(zip(messages, texts)):
        if m.role in ("user", "tool"):
            block = (m.tool_call_id or "", text) if m.role == "tool" else (None, text)
            if turns and turns[-1].role == "user":
                turns[-1].blocks.append(block)
                turns[-1].at = i
            else:
                turns.append(_Turn("user", i, blocks=[block], order=order))
            continue
        turns.append(_Turn(m.role, i, text, m))
        if m.role == "assistant" and m.tool_calls:
            order = {cid: j for j, c in enumerate(m.tool_calls)
                     if (cid := c.get("id") or (c.get("function") or {}).get("id"))}
    return turns


def _last_user(turns: list[_Turn]) -> int:
    return max((k for k, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _dropped(turns: list[_Turn]) -> list[_Turn]:
    """V4's _drop_thinking_messages: before the last user turn, developer messages and roles it does
    not keep left out (an assistant's reasoning there is never written: ``_render``)."""
    last = _last_user(turns)
    return [t for k, t in enumerate(turns) if t.role in _KEPT or t.role == "assistant" or k >= last]


def _render(turn: _Turn, mode: ChatMode, after_last_user: bool) -> str:
    """One turn's text, V4's render_message less what follows it (``_opening``)."""
    if turn.role == "system":
        return turn.text
    if turn.role == "developer":
        if not turn.text:  # V4's refusal (a ValueError vLLM answers with a 400)
            raise invalid(f"Invalid message for role `developer`: messages.{turn.at}.content is empty")
        return USER + turn.text
    if turn.role == "user":
        results = iter(sorted((b for b in turn.blocks if b[0] is not None), key=lambda b: turn.order.get(b[0], 0)))
        return USER + "\n\n".join(f"<tool_result>{next(results)[1]}</tool_result>" if key is not None else text
                                    for key, text in turn.blocks)
    if turn.role == "latest_reminder":
        return REMINDER + turn.text
    if turn.role == "assistant":
        m = turn.message
        thought = ""
        if mode.thinking and (not mode.drop_thinking or after_last_user):
            thought = (str(m.reasoning) if m.reasoning else "") + END_THINK
        return thought + turn.text + (_tool_calls(turn.at, m.tool_calls) if m.tool_calls else "") + EOS
    raise invalid(f"Invalid role: {turn.role}")  # V4's words (its ValueError, a 400 in vLLM)


def _opening(turn: _Turn, after: _Turn | None, mode: ChatMode, from_last_user: bool) -> str:
    """What V4 writes after a turn: the assistant tag where an assistant turn (or a reminder)
    follows a user or developer turn, or a system message, and where the chat ends there; then
    ``<think>`` in thinking mode from the last user turn on (everywhere with ``drop_thinking`` off),
    else ``</think>``."""
    if after is not None and after.role not in ("assistant", "latest_reminder"):
        return ""
    if turn.role in ("user", "developer") or (turn.role == "system" and (after is None or after.role == "assistant")):
        thinks = mode.thinking and (not mode.drop_thinking or from_last_user)
        return ASSISTANT + (THINK if thinks else END_THINK)
    return ""


def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, mode: ChatMode = ChatMode()) -> str:
    """DeepSeek-V4's prompt of a chat as its encoding writes it (vLLM's ``deepseek_v4_encoding``'s
    encode_messages) in ``mode``: BOS, in thinking mode its effort text, then each message in its
    place (``_render``) and the assistant tag where a turn opens (``_opening``). Where the chat
    ends, that tag is left out when ``add_generation_prompt`` is off. ``continue_final_message``:
    the prompt ends where the last message's text does, so the model continues it (transformers'
    way, as vLLM serves a Jinja template: render with a marker after that text, cut there)."""
    texts = [m.text() for m in messages]
    if continue_final_message:
        if not messages[-1].parts():  # transformers' words: the marker goes after the last text part
            raise invalid("continue_final_message is set but we could not find any text to continue in the final "
                          "message!")
        texts[-1] += _CONTINUE_TAG
    turns = _turns(messages, texts)
    if mode.thinking and mode.drop_thinking:
        turns = _dropped(turns)
    last = _last_user(turns)
    out = [BOS, EFFORT_TEXT[mode.effort] if mode.thinking else ""]
    for k, turn in enumerate(turns):
        out.append(_render(turn, mode, k > last))
        after = turns[k + 1] if k + 1 < len(turns) else None
        if after is not None or add_generation_prompt:
            out.append(_opening(turn, after, mode, k >= last))
    prompt = "".join(out)
    if continue_final_message:
        if _CONTINUE_TAG not in prompt:
            raise APIError(400, f"continue_final_message is set but the final message (a {messages[-1].role} "
                                "message) does not appear in the chat after applying the chat template", "messages")
        prompt = prompt[:prompt.rindex(_CONTINUE_TAG)]
    return prompt
