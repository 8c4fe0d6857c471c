"""How many Engram row reads an OS page cache of a given size serves, measured on real text.

Rows are hash-addressed, so a 4 KiB page of a table holds ~15 unrelated rows and a page's
popularity is the sum of theirs: not the rows' own Zipf law. This module measures it: a corpus
goes through the layout's tokenizer and addresser, and every (layer, column) counts its rows.
Rows seen once carry the novel mass (Good-Turing: the chance that the next n-gram is one not
seen before is about the share of singletons) and, being hashed, land evenly on the column's
pages; rows seen more often keep their rate on their own page. The hit ratio of an LRU page
cache holding a fraction of the pages is Che's approximation over those page rates (Che,
Tung and Wang, IEEE JSAC 2002): the characteristic time T with sum(1 - exp(-r T)) = capacity,
hit = sum(r (1 - exp(-r T))) / sum(r).

The curve is measured once per layout and corpus and kept in the model spec
(``[engram] page_cache_curve``), so a study is deterministic and needs no corpus at run time;
``cachelab engram page-cache`` measures it again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cachelab.engram import Addresser, encode
from cachelab.engram.config import EngramConfig
from cachelab.errors import CachelabError

PAGE_BYTES = 4096
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.98, 0.99,
             0.995, 0.999)


@dataclass(frozen=True)
class PageRates:
    """Lookups per token on each page of a layout's tables: ``rates`` (distinct values) held by
    ``pages`` pages each (an integer count); they sum to the lookups per token (layers x columns)."""

    rates: np.ndarray
    pages: np.ndarray
    tokens: int
    singleton_share: float  # lookups on rows seen once: spread evenly over their column's pages

    @property
    def total_pages(self) -> int:
        return int(self.pages.sum())

    def hit(self, fraction: float) -> float:
        """Share of lookups an LRU page cache holding ``fraction`` of the pages serves (Che)."""
        if fraction <= 0:
            return 0.0
        if fraction >= 1:
            return 1.0
        target = fraction * self.total_pages
        r, n = self.rates, self.pages

        def held(t: float) -> float:
            return float((n * -np.expm1(-r * t)).sum())

        lo, hi = 0.0, 1.0 / float(r.max())
        while held(hi) < target:
            lo, hi = hi, hi * 2
        for _ in range(60):  # bisection on the characteristic time (tokens)
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if held(mid) < target else (lo, mid)
        return float((n * r * -np.expm1(-r * hi)).sum() / (n * r).sum())


def measure(token_ids: Iterable[np.ndarray], layout: EngramConfig) -> PageRates:
    """Page rates from documents' token ids (each array one document, addressed on its own)."""
    docs = [np.asarray(d, np.int64) for d in token_ids if len(d)]
    if not docs:
        raise CachelabError("no tokens to measure page popularity on")
    addresser = Addresser(layout)
    offsets = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    rows = addresser.rows(np.concatenate(docs), offsets)
    tokens = rows.shape[0]
    rb, primes, starts = layout.row_bytes, layout.primes, layout.offsets
    rates, counts, singles = [], [], 0
    for li in range(rows.shape[1]):
        for c in range(rows.shape[2]):
            ids, seen = np.unique(rows[:, li, c].astype(np.int64), return_counts=True)
            first, last = starts[li, c] * rb // PAGE_BYTES, (starts[li, c] + primes[li, c]) * rb // PAGE_BYTES
            column_pages = int(last - first + 1)
            once = seen == 1
            singles += int(once.sum())
            base = once.sum() / tokens / column_pages  # the novel mass, spread over the column
            page, where = np.unique(ids[~once] * rb // PAGE_BYTES, return_inverse=True)
            spikes = np.bincount(where, weights=seen[~once] / tokens) + base
            rates += [spikes, [base]]
            counts += [np.ones(spikes.size, np.int64), [column_pages - page.size]]
    r, n = np.concatenate(rates), np.concatenate(counts)
    distinct, inverse = np.unique(r, return_inverse=True)  # pages with equal rates, counted once
    pages = np.bincount(inverse, weights=n).astype(np.int64)  # sums of whole page counts: exact in float64
    return PageRates(distinct, pages, tokens, singles / (tokens * rows.shape[1] * rows.shape[2]))


def corpus_tokens(corpus, tokenizer: str, max_tokens: int, batch: int = 256) -> list[np.ndarray]:
    """Token ids of a corpus' documents (``documents()``, in order), ``max_tokens`` in all where
    the corpus has that many: documents are tokenized a batch at a time, and the one that
    crosses the limit is cut there. Each starts with the tokenizer's BOS, as a served request
    does (its chat template) and as ``LookupStream.from_texts`` addresses a text: without it, a
    document's first positions read the rows of an n-gram padded where serving reads BOS's."""
    out, texts, total = [], [], 0
    for doc in corpus.documents():
        texts.append(doc.text)
        if len(texts) == batch:
            out += encode(texts, tokenizer, bos=True)
            total += sum(d.size for d in out[-batch:])
            texts = []
            if total >= max_tokens:
                break
    if texts and total < max_tokens:
        out += encode(texts, tokenizer, bos=True)
    kept, total = [], 0
    for ids in out:
        if total >= max_tokens:
            break
        kept.append(ids[:max_tokens - total])
        total += kept[-1].size
    return kept


def curve(rates: PageRates, fractions=FRACTIONS) -> list[tuple[float, float]]:
    """(fraction of pages cached, hit ratio) at each fraction."""
    return [(float(f), rates.hit(f)) for f in fractions]


def interpolate(points, fraction: float) -> float:
    """Hit ratio at ``fraction`` from a measured curve: linear in the log of the miss ratio
    between points (exact at 0 and 1)."""
    if fraction <= 0:
        return 0.0
    if fraction >= 1:
        return 1.0
    f = np.array([0.0] + [p[0] for p in points])
    miss = np.array([1.0] + [1.0 - p[1] for p in points])
    i = int(np.searchsorted(f, fraction))
    if i >= f.size:  # past the last point: toward no misses at 1
        return float(1.0 - miss[-1] * (1.0 - fraction) / (1.0 - f[-1]))
    w = (fraction - f[i - 1]) / (f[i] - f[i - 1])
    return float(1.0 - np.exp((1 - w) * np.log(miss[i - 1]) + w * np.log(max(miss[i], 1e-12))))
