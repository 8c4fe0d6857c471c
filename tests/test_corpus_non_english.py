"""The non-English held-out corpus of the learned study: Arena-Hard prompts in non-Latin scripts."""

from __future__ import annotations

import pytest

from cachelab import registry
from traces.prompts import non_latin_share

pytestmark = pytest.mark.data


def test_non_latin_share():
    assert non_latin_share("plain English, 42!") == 0.0
    assert non_latin_share("床前明月光") == 1.0
    assert non_latin_share("Привет, world") == 6 / 11
    assert non_latin_share("1234") == 0.0


def test_arena_hard_non_english_is_registered_and_disjoint_from_the_training_prompts(data_dir):
    corpus = registry.get(registry.WORKLOADS, "arena-hard-non-english")(root=str(data_dir))
    docs = list(corpus.documents())
    assert len(docs) == 131 and all(non_latin_share(d.text) > 0.5 for d in docs)
    ordered = [d.doc_id for d in registry.get(registry.WORKLOADS, "arena-hard")(root=str(data_dir)).documents()]
    ids = {d.doc_id for d in docs}
    assert ids <= set(ordered) and not ids & set(ordered[:150])  # the study's training reads the first 150
