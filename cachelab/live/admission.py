"""Whether a request can run at all, and its output budget: vLLM 0.32's checks of the prompt and
``max_tokens`` against the vocabulary and the context, in its words, before the engine takes it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachelab.errors import CachelabError


class RequestError(CachelabError):
    """A request that cannot run; ``param`` names the request field at fault and ``value`` its value,
    where vLLM's refusal names them (None where it does not)."""

    def __init__(self, message: str, param: str | None = None, value: int | None = None):
        super().__init__(message)
        self.param, self.value = param, value


def check_prompt(prompt_ids: Sequence[int], max_tokens: int | None, max_model_len: int, vocab_size: int,
                 field: str = "max_tokens", text: bool = False, echo_only: bool = False) -> int:
    """Refuse a request that cannot run, in vLLM 0.32's words and naming its fields (the real
    server's); else its output budget: ``max_tokens`` (None: no limit; ``field``: the request's
    name for it, a chat's ``max_completion_tokens``) cut to what the context leaves after the
    prompt, as vLLM's ``get_max_tokens`` cuts it (the answer then ends with finish_reason
    ``length``). ``text``: the ids are a text's, which vLLM tokenizes only up to one token past
    the context, so a prompt too long counts "at least" that many. ``echo_only``: a completion's
    echo with ``max_tokens`` 0, which vLLM runs for 1 token (so its engine's own check refuses a
    prompt that fills the context, in its own words)."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("The decoder prompt cannot be empty")
    ids = np.asarray(prompt_ids)
    if ids.min() < 0 or ids.max() >= vocab_size:  # vLLM names the lowest id if negative, else the highest
        raise RequestError(f"Token id {int(ids.min()) if ids.min() < 0 else int(ids.max())} is out of vocabulary")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if max_tokens is not None and max_tokens > max_model_len:
        raise RequestError(f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                           "Please request fewer output tokens.", field, max_tokens)
    if n > max_model_len:
        count = min(n, max_model_len + 1) if text else n
        qualifier = "at least " if count == max_model_len + 1 else ""  # vLLM's, token ids too
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                           f"contains {qualifier}{count} input tokens, which exceeds this limit even without any "
                           "output tokens. Please reduce the length of the input prompt.", "input_tokens", count)
    if n == max_model_len and echo_only:
        raise RequestError(f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
                           f"is longer than the maximum model length of {max_model_len}. Make sure that "
                           "`max_model_len` is no smaller than the number of text tokens (prompt + requested output "
                           "tokens).")
    if n == max_model_len:  # vLLM cuts the budget to the 0 tokens left, then refuses that
        raise RequestError("max_tokens must be at least 1, got 0.", "max_tokens", 0)
    return max_model_len - n if max_tokens is None else min(max_tokens, max_model_len - n)
