"""Sampling and incremental detokenization, as vLLM does them for the OpenAI endpoints.

Greedy rows (temperature 0) take the argmax together; the others are scaled by their
temperature, cut to their top-k logits and then to their top-p nucleus (vLLM's order and
rule: a set of tokens whose mass is exactly ``top_p`` is the nucleus, no token more) and
drawn from their own generator (seeded when the request gives a ``seed``). A positive temperature under ``MIN_TEMPERATURE`` is raised to it,
as vLLM does: float32 logits over a temperature near 0 overflow to inf, the softmax gives
NaN, and the draw would fail the step of every request in the batch. Until a request has
``min_tokens`` output tokens its stop token ids and EOS are masked out of its logits and its
text is not searched for stop strings (vLLM's MinTokensLogitsProcessor and detokenizer). The
penalties come next, before the temperature (so a greedy row's too), as vLLM's
``apply_penalties`` makes them; ``min_p`` cuts after the temperature, before top-k. Text
is decoded a window at a time (vLLM's prefix/read offsets), never emitting a half UTF-8
character (not even at the end: bytes of a character the answer never completed are dropped,
as vLLM's ``DecodeStream`` drops them, where a flush made them a U+FFFD), and held back by the
longest stop string minus one character so a stop string is never streamed before it is
recognised (no hold when the stop string stays in the output). Special tokens make no text
unless ``skip_special_tokens`` is off (vLLM's DecodeStream then writes them out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

UNFINISHED_CHAR = "\ufffd"
MIN_TEMPERATURE = 1e-2  # vllm/sampling_params.py _MAX_TEMP: a positive temperature below it is raised to it


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token (vLLM's "disabled")
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stream_interval: int = 1  # output tokens per output handed out, after the first (vLLM's; the last comes at once)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def hold_stops(logits: torch.Tensor, rows: Sequence[tuple[int, Sequence[int]]]) -> None:
    """Mask the token ids of each ``(row, ids)`` out of ``logits`` in place: the stops of a
    request still short of its ``min_tokens``."""
    for row, ids in rows:
        logits[row, list(ids)] = float("-inf")


def penalize(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, np.ndarray, np.ndarray]]) -> None:
    """vLLM's penalties, in place, of each ``(row, params, prompt ids, output ids)``: the repetition
    penalty scales the logit of every token seen, in the prompt or the output (a positive one times
    1/penalty, else times penalty); frequency and presence take penalty x count and penalty from
    each output token's logit (OpenAI's definition; the prompt does not count)."""
    for row, p, prompt, output in rows:
        x = logits[row]
        if p.repetition_penalty != 1.0:
            seen = torch.as_tensor(np.unique(np.concatenate([prompt, output])), device=x.device)
            penalty = torch.tensor(p.repetition_penalty, dtype=x.dtype, device=x.device)
            x[seen] *= torch.where(x[seen] > 0, 1.0 / penalty, penalty)
        if output.size and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.as_tensor(output, device=x.device), minlength=x.numel())
            x -= p.frequency_penalty * counts
            x -= p.presence_penalty * (counts > 0)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence) -> torch.Tensor:
    """One token id per row of ``logits`` [S, vocab] (float32)."""
    out = logits.argmax(-1)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature <= 0:
            continue
        scaled = logits[i] / max(p.temperature, MIN_TEMPERATURE)
        if p.min_p:  # vLLM's MinPLogitsProcessor: tokens less likely than min_p x the likeliest go
            probs = scaled.softmax(-1)
            scaled = scaled.masked_fill(probs < probs.max() * p.min_p, float("-inf"))
        if 0 < p.top_k < scaled.numel():
            scaled = scaled.masked_fill(scaled < scaled.topk(p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:  # vLLM's rule: the least likely tokens whose mass is at most 1 - top_p go, the likeliest stays
            ordered, order = scaled.sort()
            cut = ordered.softmax(-1).cumsum(0) <= 1 - torch.tensor(p.top_p, dtype=ordered.dtype)
            cut[-1] = False
            scaled = scaled.index_fill(0, order[cut], float("-inf"))
        out[i] = torch.multinomial(torch.softmax(scaled, -1).cpu(), 1, generator=gen)[0]
    return out.cpu()


class Detokenizer:
    """One request's output text, built token by token (see module doc)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0, keep_stop: bool = False,
                 skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.stop = tuple(s for s in stop if s)
        self.hold = 0 if keep_stop else max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens, self.keep_stop = min_tokens, keep_stop
        self.ids: list[int] = []
        # the text from character ``_base`` on: what is not handed out yet and the stop-string window
        # before it (the answer's whole text, copied at every token, cost a long answer time squared)
        self._text, self._base = "", 0
        self._window = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0  # characters of text already handed out
        self._prefix = self._read = 0
        self._stopped = False

    def add(self, token: int) -> str | None:
        """Append ``token``; returns the stop string it completed, if any."""
        self.ids.append(token)
        if self._stopped:
            return None
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip_special)
        after = decode(self.ids[self._prefix:], skip_special_tokens=self.skip_special)
        if len(after) > len(before) and not after.endswith(UNFINISHED_CHAR):
            new_from = len(self._text)
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            if len(self.ids) <= self.min_tokens:
                return None
            # the stop string ending earliest in the new text, ties to the first listed (vLLM's check_stop_strings)
            hits = [(at + len(s), i, at, s) for i, s in enumerate(self.stop)
                    if (at := self._text.find(s, max(new_from - len(s) + 1, 0))) >= 0]
            if hits:
                end, _, at, s = min(hits)
                self._text = self._text[:end if self.keep_stop else at]
                self._stopped = True
                return s
        return None

    def take(self, final: bool = False) -> str:
        """The text not handed out yet, less the held-back tail unless ``final``."""
        length = self._base + len(self._text)
        end = length if final or self._stopped else max(length - self.hold, self.sent)
        out, self.sent = self._text[self.sent - self._base:end - self._base], end
        if (drop := end - self._window - self._base) > 0:  # a stop string starts at end - _window at the earliest
            self._text, self._base = self._text[drop:], self._base + drop
        return out
