"""A server's own account of a benchmark: its Prometheus ``/metrics``, scraped before and after.

Counters and histograms only grow, so the difference of two scrapes is what the benchmark
caused (when nothing else used the server meanwhile). vLLM's names
(vllm/v1/metrics/loggers.py): ``vllm:request_success_total``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` (tokens), and the histograms
``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_time_per_output_token_seconds``. A histogram answers a percentile only to the
resolution of its buckets, so ``quantile_bucket`` gives the bucket a percentile falls in
(Prometheus' ``histogram_quantile`` interpolates inside it).
"""

from __future__ import annotations

import http.client
import math
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from cachelab.errors import CachelabError

COUNTERS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
}
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
}


@dataclass
class Scrape:
    """Every sample of one scrape, summed over labels (``le`` kept for histogram buckets)."""

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Scrape":
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = defaultdict(float)
        buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name.endswith("_bucket") and "le" in s.labels:
                        buckets[s.name[: -len("_bucket")]][float(s.labels["le"])] += s.value
                    else:
                        values[s.name] += s.value
        except ValueError as exc:
            raise CachelabError(f"/metrics is not Prometheus text: {exc}") from None
        return cls(dict(values), {k: dict(v) for k, v in buckets.items()})

    def minus(self, before: "Scrape") -> "Scrape":
        """What happened between ``before`` and this scrape."""
        values = {k: v - before.values.get(k, 0.0) for k, v in self.values.items()}
        buckets = {name: {le: c - before.buckets.get(name, {}).get(le, 0.0) for le, c in b.items()}
                   for name, b in self.buckets.items()}
        return Scrape(values, buckets)

    def quantile_bucket(self, histogram: str, q: float) -> tuple[float, float] | None:
        """(lower, upper) bound of the bucket holding quantile ``q`` (0..1); None if empty."""
        b = self.buckets.get(histogram)
        if not b:
            return None
        les = sorted(b)
        total = b[les[-1]]
        if total <= 0:
            return None
        rank, lower = q * total, 0.0
        for le in les:
            if b[le] >= rank:
                return lower, le
            lower = le
        return lower, math.inf

    def summary(self) -> dict:
        """The counters and the TTFT/E2EL/TPOT percentile buckets under short names."""
        out: dict = {k: self.values[name] for k, name in COUNTERS.items() if name in self.values}
        for key, name in HISTOGRAMS.items():
            count = self.values.get(f"{name}_count")
            if count is None:
                continue
            out[f"{key}_count"] = count
            out[f"{key}_sum_s"] = self.values.get(f"{name}_sum", 0.0)
            for p in (50, 90, 99):
                bucket = self.quantile_bucket(name, p / 100)
                if bucket is not None:
                    out[f"p{p}_{key}_bucket_ms"] = [bucket[0] * 1e3, bucket[1] * 1e3]
        return out


def scrape(base_url: str, timeout_s: float = 10.0) -> Scrape | None:
    """The server's ``/metrics`` now; None when it has none (404) or answers no Prometheus text."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError:
        return None
    except (OSError, http.client.HTTPException) as exc:  # the latter: a body cut short (IncompleteRead), not HTTP
        raise CachelabError(f"cannot reach {base_url}/metrics: {exc}") from None
    try:
        return Scrape.parse(text)
    except CachelabError:
        return None
