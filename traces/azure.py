"""Azure LLM inference traces (Azure/AzurePublicDataset, CC-BY-4.0).

CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens``: the 2023 release (Splitwise, about one
hour each of a code and a conversation service; ``2023-11-16 18:17:03.9799600``) and the
2024 week-long release (same columns, timestamps with a UTC offset). Arrival times become
seconds since the first request; there is no text and no prefix information.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError
from cachelab.trace.ingest import Ingest, count_field

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _timestamp(col: str) -> tuple[pl.Expr, str]:
    text = pl.col(col).str.replace(r"([+-]\d\d:?\d\d|Z)$", "").str.replace("T", " ", literal=True)
    return (text.str.to_datetime("%Y-%m-%d %H:%M:%S%.f", strict=False, time_unit="ns"),
            "a timestamp like 2023-11-16 18:17:03.9799600")


def _domain_of(path: Path) -> str:
    """``AzureLLMInferenceTrace_code.csv`` -> ``code``; ``..._conv_1week.csv`` -> ``conversation``."""
    stem = path.name.split(".")[0].lower()
    for key, label in (("code", "code"), ("conv", "conversation")):
        if key in stem:
            return label
    return stem


class AzureTrace:
    """An Azure LLM inference CSV as a content-less request table.

    Args:
        path: the CSV (optionally gzipped).
        skip_bad: skip and count unusable rows instead of failing on the first.
        domain: label for every request; default from the file name (code / conversation).
    """

    name = "azure"
    has_lengths = True

    def __init__(self, path: str, skip_bad: bool = False, domain: str | None = None):
        self.path = Path(path)
        self.skip_bad = skip_bad
        self.domain = domain or _domain_of(self.path)
        self.skipped = 0
        self.first_skipped: str | None = None

    def arrivals(self) -> pl.DataFrame:
        ingest = Ingest(self.path, self.skip_bad)
        raw, lines = ingest.csv(COLUMNS)
        typed = ingest.convert(raw, lines, {"TIMESTAMP": _timestamp("TIMESTAMP"),
                                            "ContextTokens": count_field("ContextTokens"),
                                            "GeneratedTokens": count_field("GeneratedTokens")})
        self.skipped, self.first_skipped = ingest.skipped, ingest.first_skipped
        if typed.height == 0:
            raise CachelabError(f"{self.path}: no usable requests ({ingest.skipped} bad rows skipped)")
        stamps = typed["TIMESTAMP"]
        arrival = (stamps - stamps.min()).dt.total_nanoseconds().to_numpy() / 1e9
        return arrival_frame(arrival, typed["ContextTokens"].to_numpy(), typed["GeneratedTokens"].to_numpy(),
                             domain=self.domain, source=self.name)
