"""Synthesis semantics on small inputs: sessions, lengths, prefix blocks, determinism."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cachelab.trace.arrivals import arrival_frame
from cachelab.trace.corpus import Document
from cachelab.engram import load_tokenizer
from cachelab.errors import CachelabError
from cachelab.workload.prefix_cache.hashing import chained_block_hashes
from cachelab.trace.synthesis import TokenStream, make_plan, synthesize
from cachelab.trace.schema import read_trace
from traces.gamma import GammaArrivals

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
        "of foolishness, it was the epoch of belief, it was the epoch of incredulity. ")


class TinyCorpus:
    name = "tiny"

    def documents(self):
        yield Document("a", "chat", "Explain caching in one line.", turns=("Explain caching in one line.", "Now in French."))
        yield Document("b", "math", "What is 2 + 2?", answers=("2 + 2 = 4.",))
        for i in range(6):
            yield Document(f"p{i}", "prose", f"Chapter {i}. " + TEXT * (i + 1))


@pytest.fixture(scope="module")
def stream():
    return TokenStream.from_corpus(TinyCorpus())


def build(stream, arrivals, tmp_path, has_lengths=True, seed=0, name="t.parquet", **kw):
    plan = make_plan(stream, arrivals, has_lengths=has_lengths, use_lengths=True, seed=seed,
                     output_tokens=kw.pop("output_tokens", 12), turn_gap_s=kw.pop("turn_gap_s", 5.0))
    synthesize(stream, plan, tmp_path / name, source="test", chunk_tokens=kw.pop("chunk_tokens", 64))
    return read_trace(tmp_path / name)


def test_sessions_carry_earlier_turns_and_real_answers(stream, tmp_path):
    trace = build(stream, GammaArrivals(rate=1.0, num_requests=40, seed=3).arrivals(), tmp_path, has_lengths=False)
    assert trace["arrival_s"].is_sorted()
    multi = trace.filter(pl.col("domain") == "chat").sort("session_id", "turn")
    assert set(multi["turn"]) == {0, 1}
    firsts = trace.filter(pl.col("turn") == 0)
    assert firsts["session_id"].to_list() == firsts["request_id"].to_list()  # named by the first turn's id
    for (_, ), turns in multi.group_by(["session_id"], maintain_order=True):
        first, second = turns.row(0, named=True), turns.row(1, named=True)
        assert second["arrival_s"] == pytest.approx(first["arrival_s"] + 5.0)
        history = first["prompt_ids"] + first["output_ids"]
        assert second["prompt_ids"][:len(history)] == history  # the later prompt contains the earlier turn
    tok = load_tokenizer()
    math = trace.filter(pl.col("domain") == "math").row(0, named=True)
    assert tok.decode(math["output_ids"]) == "2 + 2 = 4."  # the corpus answer is the output


def test_lengths_come_from_the_arrivals_and_outputs_continue_the_text(stream, tmp_path):
    arrivals = arrival_frame([0.0, 0.5, 0.5, 2.0], [5, 40, 300, 0], [7, 0, 3, 9], domain="x", source="t")
    trace = build(stream, arrivals, tmp_path)
    assert trace["prompt_len"].to_list() == [5, 40, 300, 0]
    assert trace["prompt_ids"].list.len().to_list() == [5, 40, 300, 0]
    row = trace.row(0, named=True)
    tokens = stream.tokens.tolist()
    joined = row["prompt_ids"] + row["output_ids"]
    assert any(tokens[i:i + len(joined)] == joined for i in range(len(tokens)))  # one contiguous real passage


def test_same_seed_same_bytes_other_seed_other_documents(stream, tmp_path):
    arrivals = GammaArrivals(rate=4.0, burstiness=0.5, num_requests=30, seed=1).arrivals()
    a = build(stream, arrivals, tmp_path, has_lengths=False, seed=7, name="a.parquet")
    b = build(stream, arrivals, tmp_path, has_lengths=False, seed=7, name="b.parquet", chunk_tokens=10_000)
    c = build(stream, arrivals, tmp_path, has_lengths=False, seed=8, name="c.parquet")
    assert a.equals(b)  # chunking does not change the result
    assert not a["prompt_ids"].equals(c["prompt_ids"])


@st.composite
def prefix_trees(draw):
    """Requests that extend earlier ones, as Mooncake's chained hash ids describe them."""
    chains, next_id = [], 0
    for _ in range(draw(st.integers(1, 25))):
        parent = draw(st.sampled_from(chains)) if chains and draw(st.booleans()) else []
        full = parent[:max(0, len(parent) - 1)] if parent and parent[-1][1] < 16 else parent
        keep = draw(st.integers(0, len(full)))
        chain = list(full[:keep])
        for _ in range(draw(st.integers(1 if not chain else 0, 3))):
            chain.append((next_id, 16))
            next_id += 1
        if draw(st.booleans()):
            chain.append((next_id, draw(st.integers(1, 15))))  # a partial last block
            next_id += 1
        if chain:
            chains.append(chain)
    return chains


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chains=prefix_trees())
def test_prefix_blocks_become_shared_text_block_for_block(stream, tmp_path, chains):
    hashes = pl.Series([[b for b, _ in c] for c in chains], dtype=pl.List(pl.Int64))
    lengths = [sum(n for _, n in c) for c in chains]
    arrivals = arrival_frame(np.arange(len(chains), dtype=float), lengths, [4] * len(chains), domain="x",
                             source="t", block_hashes=hashes, block_size=16)
    trace = build(stream, arrivals, tmp_path)
    prompts = trace["prompt_ids"].to_arrow()
    content, _ = chained_block_hashes(prompts.values.to_numpy(), prompts.offsets.to_numpy(), 16)
    ids = trace["block_hashes"].explode().to_numpy()
    pairs = np.unique(np.stack([content, ids], axis=1), axis=0)
    assert len(pairs) == len(np.unique(content)) == len(np.unique(ids))


def test_too_small_a_corpus_is_a_clear_error(tmp_path):
    class One:
        name = "one"

        def documents(self):
            yield Document("x", "d", "a a a a a a a a")

    small = TokenStream.from_corpus(One())
    hashes = pl.Series([[i] for i in range(50)], dtype=pl.List(pl.Int64))
    arrivals = arrival_frame(np.zeros(50), [4] * 50, [0] * 50, domain="x", source="t", block_hashes=hashes,
                             block_size=4)
    with pytest.raises(CachelabError, match="cannot give 50 different blocks"):
        build(small, arrivals, tmp_path)


def test_no_lengths_uses_the_arrival_times_for_sessions(stream, tmp_path):
    arrivals = arrival_frame([0.0, 3.0, 7.5], [900, 900, 900], [50, 50, 50], domain="x", source="t")
    plan = make_plan(stream, arrivals, has_lengths=True, use_lengths=False, seed=0, output_tokens=8, turn_gap_s=1.0)
    synthesize(stream, plan, tmp_path / "s.parquet", source="test")
    trace = read_trace(tmp_path / "s.parquet")
    starts = trace.filter(pl.col("turn") == 0)["arrival_s"].to_list()
    assert starts == [0.0, 3.0, 7.5]  # sessions start at the trace's arrivals
    assert (trace["prompt_len"] < 900).all()  # and take their lengths from the corpus, not the trace
