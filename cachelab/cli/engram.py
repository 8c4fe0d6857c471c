"""``cachelab engram``: inspect the addressing of a layout."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from cachelab import strict_json
from cachelab.cli.stdout import stdout_console
from cachelab.defaults import PRESET
from cachelab.engram import Addresser, encode, get_preset, load_tokenizer
from cachelab.errors import CachelabError
from cachelab.progress import progress_bar

app = typer.Typer(no_args_is_help=True, help="Engram addressing: row ids of a text, and a layout's tables.")

PRESET_HELP = "Layout: a preset (deepseek-v4.1-flash, engram-27b-demo) or a layout .toml/.json file."


def _read_text(text: str | None, text_file: Path | None) -> str:
    if (text is None) == (text_file is None):
        raise CachelabError("give exactly one of --text or --text-file")
    if text is not None:
        try:  # an argument's undecodable bytes arrive as lone surrogates, which the tokenizer refused with a TypeError
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raw = text[exc.start].encode("utf-8", "surrogateescape")
            raise CachelabError(f"--text is not UTF-8 (character {exc.start}: {raw!r})") from None
        return text
    if not text_file.is_file():
        raise CachelabError(f"text file not found: {text_file}")
    raw = text_file.read_bytes()  # as stored: no newline translation
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CachelabError(f"{text_file} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None


@app.command()
def rows(
    preset: str = typer.Option(PRESET, help=PRESET_HELP),
    text: str | None = typer.Option(None, help="Text to tokenize."),
    text_file: Path | None = typer.Option(None, help="UTF-8 file, tokenized exactly as stored."),
    bos: bool = typer.Option(False, "--bos", help="Prepend the tokenizer's BOS token (its tokenizer_config.json's bos_token: id 0 for DeepSeek's)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    r"""Row ids of every position of a text, indexed \[position]\[layer]\[column]."""
    addresser = Addresser(get_preset(preset))
    ids = encode([_read_text(text, text_file)], addresser.config.tokenizer, bos=bos)[0]
    result = addresser.rows(ids)
    compressed = addresser.compress(ids)
    if as_json:
        typer.echo(strict_json.dumps({"preset": preset, "token_ids": ids.tolist(),
                               "compressed_ids": compressed.tolist(), "rows": result.tolist()}))
        return
    tok = load_tokenizer(addresser.config.tokenizer)
    table = Table(title=f"{preset}: rows per position (columns order-major, then head)")
    for col in ("pos", "token id", "token", "compressed", "layer", "rows"):
        table.add_column(col)
    for t, raw in enumerate(ids.tolist()):
        for li, layer in enumerate(addresser.config.layers):
            head = (str(t), str(raw), repr(tok.id_to_token(raw)), str(compressed[t])) if li == 0 else ("",) * 4
            table.add_row(*head, str(layer), " ".join(map(str, result[t, li].tolist())))
    stdout_console().print(table)


@app.command()
def info(
    preset: str = typer.Option(PRESET, help=PRESET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Orders, heads, primes and table sizes of a layout."""
    cfg = get_preset(preset)
    per_token = len(cfg.layers) * cfg.columns
    data = {
        "preset": cfg.name,
        "layers": list(cfg.layers),
        "orders": list(range(2, cfg.max_ngram + 1)),
        "heads": cfg.heads,
        "compressed_vocab": cfg.compressed_vocab,
        "primes": {str(layer): cfg.primes[i].tolist() for i, layer in enumerate(cfg.layers)},
        "table_rows": {str(layer): int(cfg.table_rows[i]) for i, layer in enumerate(cfg.layers)},
        "row_bytes": cfg.row_bytes,
        "rows_per_token": per_token,
        "bytes_per_token": per_token * cfg.row_bytes,
        "total_table_bytes": int(cfg.table_rows.sum()) * cfg.row_bytes,
        "note": cfg.note,
    }
    if as_json:
        typer.echo(strict_json.dumps(data))
        return
    console = stdout_console()
    console.print(f"[bold]{cfg.name}[/]: layers {data['layers']}, orders {data['orders']}, "
                  f"{cfg.heads} heads, V = {cfg.compressed_vocab:,}")
    for layer, rows_ in data["table_rows"].items():
        console.print(f"  layer {layer}: {rows_:,} rows, primes {data['primes'][layer]}")
    console.print(f"  {per_token} rows x {cfg.row_bytes} B = {data['bytes_per_token']:,} B per token; "
                  f"tables {data['total_table_bytes'] / 2**30:.1f} GiB")
    if cfg.note:
        console.print(f"  note: {cfg.note}")


@app.command("page-cache")
def page_cache(
    preset: str = typer.Option(PRESET, help=PRESET_HELP),
    corpus: str = typer.Option("stdlib", help="Registered text corpus (cachelab plugins list); stdlib: Python "
                               "sources, the closest to a coding agent's traffic on every machine."),
    max_tokens: int = typer.Option(4_000_000, help="Tokens of the corpus to address (documents in order)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    r"""The page-cache curve of a layout on real text.

    The share of row reads an LRU page cache
    holding a fraction of the tables' 4 KiB pages serves (Che's approximation over the measured
    page popularity). Prints the `\[engram] page_cache_curve` line a model spec keeps.
    Example: `cachelab engram page-cache --corpus stdlib`."""
    from rich.progress import SpinnerColumn, TextColumn

    from cachelab import registry
    from cachelab.serving.page_popularity import corpus_tokens, curve, measure
    from cachelab.trace.kinds import corpus_names

    if max_tokens < 1:
        raise CachelabError(f"--max-tokens must be at least 1, got {max_tokens}")
    cfg = get_preset(preset)
    cls = registry.get(registry.WORKLOADS, corpus)
    if not hasattr(cls, "documents"):  # asked before it is built: an arrival trace needs a path (a TypeError)
        raise CachelabError(f"--corpus {corpus!r} is not a text corpus (it has no documents); "
                            f"the text corpora: {', '.join(corpus_names())}")
    source = cls()
    with progress_bar(SpinnerColumn(), TextColumn("{task.description}")) as bar:
        bar.add_task(f"tokenizing and addressing up to {max_tokens:,} tokens of {corpus}")
        rates = measure(corpus_tokens(source, cfg.tokenizer, max_tokens), cfg)
        points = curve(rates)
    result = {"preset": cfg.name, "corpus": corpus, "tokens": rates.tokens, "pages": rates.total_pages,
              "singleton_share": rates.singleton_share, "curve": [[f, h] for f, h in points]}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    console = stdout_console()
    console.print(f"{cfg.name} on {rates.tokens:,} tokens of {corpus}: {rates.total_pages:,} pages; "
                  f"{rates.singleton_share:.1%} of lookups on rows seen once (spread evenly)")
    table = Table(title="LRU page cache (Che's approximation)")
    for col in ("pages cached", "reads served", "missed"):
        table.add_column(col, justify="right")
    for f, h in points:
        table.add_row(f"{f:.1%}", f"{h:.4%}", f"{1 - h:.4%}")
    console.print(table)
    console.print("page_cache_curve = [" + ", ".join(f"[{f:g}, {h:.6f}]" for f, h in points) + "]")
