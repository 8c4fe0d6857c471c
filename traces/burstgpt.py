"""BurstGPT traces (HPMLL/BurstGPT: Azure OpenAI GPT usage at a regional provider, CC-BY-4.0).

CSV with the published columns ``Timestamp`` (seconds from the trace start), ``Model``
(ChatGPT or GPT-4), ``Request tokens``, ``Response tokens``, ``Total tokens`` and ``Log Type``
(``Conversation log`` or ``API log``). The log type becomes the domain (``conversation`` /
``api``); ``models`` keeps only some models. There is no text and no prefix information. A failed
request (``Response tokens`` 0, as the BurstGPT README marks them) is kept, with no output;
the published ``BurstGPT_without_fails_*.csv`` files leave them out. ``Total tokens`` is, as the
BurstGPT README defines it, request plus response tokens; a row where it is not is damaged (which
count is wrong cannot be told), so it is a bad row.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError
from cachelab.trace.ingest import Ingest, count_field, seconds_field

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


def _label(col: str) -> tuple[pl.Expr, str]:
    value = pl.col(col)
    return pl.when(value.str.len_chars() > 0).then(value), "a non-empty label"


def _total() -> tuple[pl.Expr, str]:
    """``Total tokens``: a count equal to ``Request tokens`` + ``Response tokens``."""
    value, expected = count_field("Total tokens")
    parts = [pl.col(c).cast(pl.Int64, strict=False) for c in ("Request tokens", "Response tokens")]
    return (pl.when(value == parts[0] + parts[1]).then(value),
            f"{expected} equal to 'Request tokens' + 'Response tokens'")


class BurstGPTTrace:
    """A BurstGPT CSV as a content-less request table.

    Args:
        path: the CSV (optionally gzipped).
        skip_bad: skip and count unusable rows instead of failing on the first.
        models: keep only these ``Model`` values (all when None; one name may be given bare);
            a name no row has is an error.
    """

    name = "burstgpt"
    has_lengths = True

    def __init__(self, path: str, skip_bad: bool = False, models: list[str] | str | None = None):
        self.path = Path(path)
        self.skip_bad = skip_bad
        self.models = models
        self.skipped = 0
        self.first_skipped: str | None = None
        self.skipped_lines: list[int] = []

    def arrivals(self) -> pl.DataFrame:
        ingest = Ingest(self.path, self.skip_bad)
        raw, lines = ingest.csv(COLUMNS)
        conversions = {"Timestamp": seconds_field("Timestamp"), "Model": _label("Model"),
                       "Log Type": _label("Log Type")}
        conversions |= {c: count_field(c, least=1 if c == "Request tokens" else 0) for c in
                        ("Request tokens", "Response tokens")} | {"Total tokens": _total()}
        typed = ingest.convert(raw, lines, conversions)
        self.skipped, self.first_skipped, self.skipped_lines = ingest.skipped, ingest.first_skipped, ingest.skipped_lines
        if self.models is not None:
            typed = typed.filter(pl.col("Model").is_in(self._models(typed["Model"])))
        if typed.height == 0:
            raise CachelabError(f"{self.path}: no usable requests ({ingest.skipped} bad rows skipped"
                                + (f", models {self.models})" if self.models else ")"))
        domain = typed["Log Type"].str.to_lowercase().str.replace(r"\s*log$", "")
        return arrival_frame(typed["Timestamp"].to_numpy(), typed["Request tokens"].to_numpy(),
                             typed["Response tokens"].to_numpy(), domain=domain, source=self.name)

    def _models(self, present: pl.Series) -> list[str]:
        """``models`` as a list (one name may be given bare: ``models=GPT-4``); a name the file
        never uses is an error listing those it does, not a silently smaller trace."""
        models = [self.models] if isinstance(self.models, str) else self.models
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise CachelabError(f"burstgpt option models = {self.models!r}: expected a list of model names "
                                "(models=['ChatGPT', 'GPT-4'])")
        known = sorted(present.unique().to_list())
        unknown = [m for m in models if m not in known]
        if unknown:
            raise CachelabError(f"{self.path}: field 'Model': no row has {', '.join(map(repr, unknown))}; "
                                f"the file's models are {known}")
        return models
