"""``cachelab quickstart``: what an Engram row cache faces on real text, with no data to download."""

from __future__ import annotations

import json
import time

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cachelab import registry
from cachelab.engram import Addresser, encode, get_preset
from cachelab.engram.stats import row_skew


def quickstart(
    preset: str = typer.Option("deepseek-v4.1-flash", help="Layout preset."),
    max_chars: int = typer.Option(4_000_000, help="Characters of standard-library text to read."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Tokenize the standard library's sources and docstrings, address them, and report skew."""
    started = time.perf_counter()
    corpus = registry.get(registry.WORKLOADS, "stdlib")(max_chars=max_chars)
    addresser = Addresser(get_preset(preset))
    docs = list(corpus.documents())
    chunks, batch = [], 256
    with Progress(transient=True, disable=as_json) as progress:
        task = progress.add_task("tokenize + address", total=len(docs))
        for i in range(0, len(docs), batch):
            ids = encode([d.text for d in docs[i:i + batch]], addresser.config.tokenizer, bos=True)
            offsets = np.concatenate([[0], np.cumsum([x.size for x in ids])])
            chunks.append(addresser.rows(np.concatenate(ids), offsets))
            progress.advance(task, min(batch, len(docs) - i))
    rows = np.concatenate(chunks)
    cfg = addresser.config
    skew = row_skew(rows, cfg)
    per_token = len(cfg.layers) * cfg.columns
    result = {
        "preset": preset,
        "documents": len(docs),
        "tokens": int(rows.shape[0]),
        "lookups": int(rows.size),
        "rows_per_token": per_token,
        "bytes_per_token": per_token * cfg.row_bytes,
        "table_rows": int(cfg.table_rows.sum()),
        "skew": [s.to_dict() for s in skew],
        "seconds": round(time.perf_counter() - started, 2),
    }
    if as_json:
        typer.echo(json.dumps(result))
        return
    console = Console()
    console.print(f"[bold]Engram rows of the Python standard library[/] ({len(docs)} documents, "
                  f"{result['tokens']:,} tokens, {preset})")
    console.print(f"{result['lookups']:,} lookups; {per_token} rows x {cfg.row_bytes} B = "
                  f"{result['bytes_per_token']:,} B per token")
    table = Table()
    for col in ("layer", "order", "lookups", "unique rows", "unique / lookups", "top 1% rows take"):
        table.add_column(col, justify="right")
    for s in skew:
        table.add_row(str(s.layer), str(s.order or "all"), f"{s.lookups:,}", f"{s.unique_rows:,}",
                      f"{s.unique_rows / max(s.lookups, 1):.3f}", f"{s.top1pct_share:.1%}")
    console.print(table)
    console.print(f"done in {result['seconds']} s")
