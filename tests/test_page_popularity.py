"""The page-cache curve: Che's approximation over page rates measured on real text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.serving.model_spec import MODEL_DIR, load_model
from cachelab.serving.page_popularity import PageRates, interpolate, measure
from cachelab.serving.steady import page_cache_hit

runner = CliRunner()


def test_che_is_exact_for_equal_pages_and_serves_hot_pages_first():
    flat = PageRates(np.array([2.0]), np.array([1000.0]), 1, 0.0)
    assert [flat.hit(f) for f in (0.0, 0.3, 1.0)] == [0.0, pytest.approx(0.3, rel=1e-6), 1.0]
    # 10 pages carrying 98.9% of the reads: a cache of 1% of the pages holds them (and a few cold ones)
    skewed = PageRates(np.array([0.001, 90.0]), np.array([9990.0, 10.0]), 1, 0.0)
    hot = 900 / (900 + 9.99)
    assert hot < skewed.hit(0.01) < hot + 0.01 * (1 - hot) and skewed.hit(0.5) > skewed.hit(0.01)


def test_interpolation_passes_through_the_points_and_rises():
    points = [(0.1, 0.5), (0.5, 0.9), (0.9, 0.99)]
    assert [interpolate(points, f) for f in (0.0, 0.1, 0.5, 0.9, 1.0)] == pytest.approx([0.0, 0.5, 0.9, 0.99, 1.0])
    grid = [interpolate(points, f) for f in np.linspace(0, 1, 101)]
    assert all(b >= a for a, b in zip(grid, grid[1:]))


def test_the_v41_spec_keeps_a_measured_curve_and_bad_curves_are_refused(tmp_path):
    m = load_model("deepseek-v4.1-flash")
    assert len(m.page_cache_curve) > 10
    assert page_cache_hit(0, m) == 0.0 and page_cache_hit(1e15, m) == 1.0
    assert 0.9 < page_cache_hit(m.table_bytes / 2, m) < 0.95  # hashed pages are flat: half the table misses ~6%
    spec = (MODEL_DIR / "deepseek-v4.1-flash.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.replace("[0.02, 0.355601]", "[0.02, 0.1]"))
    with pytest.raises(CachelabError, match=r"page_cache_curve point \[0.02, 0.1\] does not rise"):
        load_model(str(bad))


@pytest.mark.data
def test_measured_rates_cover_every_page_and_every_lookup(data_dir):
    from cachelab.engram import encode, get_preset

    cfg = get_preset("deepseek-v4.1-flash")
    texts = ["def f(x):\n    return x + 1\n" * 20, "The cat sat on the mat. " * 30]
    rates = measure(encode(texts, cfg.tokenizer), cfg)
    assert rates.rates.sum() > 0 and float((rates.rates * rates.pages).sum()) == pytest.approx(len(cfg.layers) * cfg.columns)
    table_pages = sum(int((cfg.offsets[i, -1] + cfg.primes[i, -1]) * cfg.row_bytes // 4096) for i in range(len(cfg.layers)))
    assert rates.total_pages == pytest.approx(table_pages, rel=1e-3)  # column edges may share a page
    assert 0 < rates.singleton_share < 0.5  # repeated text: most rows recur
    res = runner.invoke(app, ["engram", "page-cache", "--corpus", "mt-bench", "--max-tokens", "2000", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    hits = [h for _, h in out["curve"]]
    assert out["tokens"] == 2000 and all(b >= a for a, b in zip(hits, hits[1:])) and 0 < hits[0] < hits[-1] < 1
    bad = runner.invoke(app, ["engram", "page-cache", "--max-tokens", "0"])
    assert bad.exit_code == 2 and "--max-tokens" in bad.output


def test_corpus_tokens_start_each_document_with_bos_as_serving_does():
    """`engram page-cache` addressed a document without BOS, where a served request (its chat
    template) and `LookupStream.from_texts` (`trace lookups gsm8k`) start with it."""
    from cachelab.engram.vocab import bos_ids
    from cachelab.serving.page_popularity import corpus_tokens
    from cachelab.trace.corpus import Document

    class Two:
        name = "two"

        def documents(self):
            yield Document("a", "prose", "The cat sat on the mat.")
            yield Document("b", "code", "def f(x):\n    return x + 1\n")

    docs = corpus_tokens(Two(), "deepseek-v4", 10_000)
    assert bos_ids("deepseek-v4") == (0,) and [int(d[0]) for d in docs] == [0, 0]
    assert sum(d.size for d in corpus_tokens(Two(), "deepseek-v4", 5)) == 5  # BOS counts as a token read
