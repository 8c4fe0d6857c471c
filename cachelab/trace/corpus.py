"""The text-corpus contract that workload producers implement (``cachelab.workloads``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Document:
    """One unit of real text: a prompt, a source file, a passage of a book.

    ``text`` is the (first) prompt. A multi-turn conversation lists every user turn in
    ``turns`` (``turns[0] == text``); ``answers`` holds the source's reference answer per
    turn where it has one (GSM8K solutions, HumanEval canonical code), so synthesized outputs
    can be real answers.
    """

    doc_id: str
    domain: str
    text: str
    turns: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()

    @property
    def user_turns(self) -> tuple[str, ...]:
        return self.turns or (self.text,)


class Corpus(Protocol):
    """Anything that yields documents deterministically."""

    name: str

    def documents(self) -> Iterator[Document]: ...
