"""Azure LLM inference traces (Azure/AzurePublicDataset, CC-BY-4.0).

CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens``: the 2023 release (Splitwise, about one
hour each of a code and a conversation service; ``2023-11-16 18:17:03.9799600``) and the
2024 week-long release (same columns, timestamps with a UTC offset). A timestamp's UTC
offset is applied (rows of different offsets land on one UTC clock). Most rows of a file (or
half) say whether its timestamps carry offsets; a row that differs is a bad row, never a guess
at local time, and one damaged row does not turn the file's others into bad rows.
Arrival times become seconds since the first request; there is no text and no prefix
information. A timestamp more than ``MAX_SECONDS / 2`` from the file's median one is a bad
row (a trace spans at most ``MAX_SECONDS``), so a damaged year never stretches the clock, nor
overflows its nanoseconds.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError
from cachelab.trace.ingest import MAX_SECONDS, Ingest, count_field

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


OFFSET = r"([+-])(\d\d):?(\d\d)$|Z$"
FORMAT = "%Y-%m-%d %H:%M:%S%.f"
HALF_SPAN_US = int(MAX_SECONDS / 2 * 1e6)


def _timestamp(col: str, with_offset: bool) -> tuple[pl.Expr, str]:
    """The UTC time of each row; a row with a UTC offset where the file's timestamps carry none
    (``with_offset``), or without one where they do, is null, so it is a bad row; so is one far
    from the median (module doc)."""
    raw = pl.col(col)
    text = raw.str.replace(OFFSET, "").str.replace("T", " ", literal=True)
    # checked in microseconds: a nanosecond parse wraps silently past 2262 (9999 became 1815)
    wide = text.str.to_datetime(FORMAT, strict=False, time_unit="us")
    plausible = wide.is_between(datetime(1678, 1, 1), datetime(2262, 1, 1))  # what nanoseconds hold
    plausible &= (wide - wide.filter(plausible).median()).abs() <= pl.duration(microseconds=HALF_SPAN_US)
    naive = pl.when(plausible).then(text.str.to_datetime(FORMAT, strict=False, time_unit="ns"))
    near = f"within {MAX_SECONDS / 2:g} s of the file's median timestamp"
    if not with_offset:
        return (pl.when(~raw.str.contains(OFFSET)).then(naive),
                f"a timestamp like 2023-11-16 18:17:03.9799600 without a UTC offset (as the file's other rows), {near}")
    sign = pl.when(raw.str.extract(OFFSET, 1) == "-").then(-1).otherwise(1)
    minutes = raw.str.extract(OFFSET, 2).cast(pl.Int64) * 60 + raw.str.extract(OFFSET, 3).cast(pl.Int64)
    offset = pl.when(raw.str.ends_with("Z")).then(0).otherwise(sign * minutes)
    utc = naive - pl.duration(minutes=offset)
    return (pl.when(raw.str.contains(OFFSET)).then(utc),
            f"a timestamp with a UTC offset like 2024-05-10 00:00:00.01+00:00 (as the file's other rows), {near}")


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
        self.skipped_lines: list[int] = []

    def arrivals(self) -> pl.DataFrame:
        ingest = Ingest(self.path, self.skip_bad)
        raw, lines = ingest.csv(COLUMNS)
        with_offset = 2 * int(raw["TIMESTAMP"].str.contains(OFFSET).sum()) >= raw.height  # as most (or half)
        typed = ingest.convert(raw, lines, {"TIMESTAMP": _timestamp("TIMESTAMP", with_offset),
                                            "ContextTokens": count_field("ContextTokens", least=1),
                                            "GeneratedTokens": count_field("GeneratedTokens")})
        self.skipped, self.first_skipped, self.skipped_lines = ingest.skipped, ingest.first_skipped, ingest.skipped_lines
        if typed.height == 0:
            raise CachelabError(f"{self.path}: no usable requests ({ingest.skipped} bad rows skipped)")
        stamps = typed["TIMESTAMP"]
        arrival = (stamps - stamps.min()).dt.total_nanoseconds().to_numpy() / 1e9
        return arrival_frame(arrival, typed["ContextTokens"].to_numpy(), typed["GeneratedTokens"].to_numpy(),
                             domain=self.domain, source=self.name)
