"""The text-corpus contract that workload producers implement (``cachelab.workloads``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Document:
    """One unit of real text: a prompt, a source file, a chapter. ``turns`` for multi-turn."""

    doc_id: str
    domain: str
    text: str


class Corpus(Protocol):
    """Anything that yields documents deterministically."""

    name: str

    def documents(self) -> Iterator[Document]: ...
