"""The request table: one versioned Arrow schema for every trace, whatever its source.

A row is one request: who sent it (session, turn), when (``arrival_s``), what kind of work
(``domain``), and its tokens (``prompt_ids``, ``output_ids``, raw ids of the trace's
tokenizer). ``prompt_len`` / ``output_len`` always hold the token counts. An imported arrival
trace that carries lengths but no text (Mooncake, Azure, BurstGPT, ServeGen) stores **empty**
id lists with the counts kept, so it can be inspected (``trace info``) and later given real
content by synthesis. ``block_hashes`` are the source's prefix-block ids where it has them
(Mooncake), with their ``block_size``. ``cached_tokens`` is the prompt tokens the serving
engine reported as served from its prefix cache (``usage.prompt_tokens_details``; captured
traces), null where unknown. It is an *optional* column: a file written before it existed,
or by a producer without it, reads back with it null, and readers that predate it ignore it,
so the schema version did not change. The schema version is stored in the Parquet metadata
and checked on every read; row values are validated on read and on write, and any violation
is reported with the file, the row and the field. A trace whose ids a cachelab tokenizer made
(synthesis) records which one (``cachelab.trace.tokenizer``: its name and the SHA-256 of its
tokenizer.json), and addressing them with a layout of another tokenizer is refused
(``check_tokenizer``): the same ids are other text there, so every row would be another's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from cachelab.engram.vocab import is_tokenizer_record, tokenizer_record
from cachelab.errors import CachelabError
from cachelab.paths import name_the_file, scratch_beside

SCHEMA_VERSION = "1"
VERSION_KEY = b"cachelab.trace.schema_version"
TOKENIZER_KEY = b"cachelab.trace.tokenizer"

SCHEMA = pa.schema([
    pa.field("request_id", pa.int64(), nullable=False),
    pa.field("session_id", pa.int64(), nullable=False),
    pa.field("turn", pa.int32(), nullable=False),
    pa.field("arrival_s", pa.float64(), nullable=False),
    pa.field("domain", pa.string(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("output_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("prompt_len", pa.int32(), nullable=False),
    pa.field("output_len", pa.int32(), nullable=False),
    pa.field("block_hashes", pa.list_(pa.int64()), nullable=True),
    pa.field("block_size", pa.int32(), nullable=True),
    pa.field("source", pa.string(), nullable=False),
    pa.field("cached_tokens", pa.int32(), nullable=True),
], metadata={VERSION_KEY: SCHEMA_VERSION.encode()})

COLUMNS = tuple(SCHEMA.names)
POLARS_SCHEMA = pl.Schema({
    "request_id": pl.Int64, "session_id": pl.Int64, "turn": pl.Int32, "arrival_s": pl.Float64,
    "domain": pl.String, "prompt_ids": pl.List(pl.Int32), "output_ids": pl.List(pl.Int32),
    "prompt_len": pl.Int32, "output_len": pl.Int32, "block_hashes": pl.List(pl.Int64),
    "block_size": pl.Int32, "source": pl.String, "cached_tokens": pl.Int32,
})
NON_NULL = tuple(f.name for f in SCHEMA if not f.nullable)
OPTIONAL = ("cached_tokens",)  # may be absent from a file or a producer's frame: read as null
REQUIRED = tuple(c for c in COLUMNS if c not in OPTIONAL)


def _unique_ids() -> tuple[str, pl.Expr, str]:
    return "request_id", pl.col("request_id").is_first_distinct(), "is a duplicate"


def _in_order() -> tuple[str, pl.Expr, str]:
    return "arrival_s", pl.col("arrival_s").diff().fill_null(0) >= 0, "goes back in time (rows must be in arrival order)"


def _checks() -> list[tuple[str, pl.Expr, str]]:
    """(field, condition that must hold on every row, what it means), vectorised."""
    col = pl.col
    has_blocks = col("block_hashes").is_not_null()
    return [
        ("request_id", col("request_id") >= 0, "must be >= 0"),
        _unique_ids(),
        ("session_id", col("session_id") >= 0, "must be >= 0"),
        ("turn", col("turn") >= 0, "must be >= 0"),
        ("arrival_s", col("arrival_s").is_finite() & (col("arrival_s") >= 0), "must be finite and >= 0"),
        _in_order(),
        ("prompt_len", col("prompt_len") >= 0, "must be >= 0"),
        ("output_len", col("output_len") >= 0, "must be >= 0"),
        ("prompt_ids", (col("prompt_ids").list.len() == 0) | (col("prompt_ids").list.len() == col("prompt_len")),
         "length differs from prompt_len (and is not 0, the marker of a content-less request)"),
        ("output_ids", (col("output_ids").list.len() == 0) | (col("output_ids").list.len() == col("output_len")),
         "length differs from output_len (and is not 0, the marker of a content-less request)"),
        ("prompt_ids", col("prompt_ids").list.min().fill_null(0) >= 0, "holds a negative token id"),
        ("output_ids", col("output_ids").list.min().fill_null(0) >= 0, "holds a negative token id"),
        ("block_size", ~has_blocks | (col("block_size").fill_null(0) > 0),
         "must be > 0 where block_hashes are given"),
        ("block_hashes", ~has_blocks | (col("block_hashes").list.len().cast(pl.Int64)
                                        == (col("prompt_len").cast(pl.Int64) + col("block_size") - 1)
                                        // col("block_size")),
         "must hold ceil(prompt_len / block_size) ids"),
        ("cached_tokens", col("cached_tokens").is_null() | col("cached_tokens").is_between(0, col("prompt_len")),
         "must be between 0 and prompt_len"),
    ]


def with_optional(frame):
    """``frame`` (eager or lazy) with every optional column it lacks added as nulls."""
    names = frame.collect_schema().names() if isinstance(frame, pl.LazyFrame) else frame.columns
    absent = [pl.lit(None, POLARS_SCHEMA[c]).alias(c) for c in OPTIONAL if c not in names]
    return frame.with_columns(absent) if absent else frame


def validate(df: pl.DataFrame, where: str, *, first_row: int = 0) -> pl.DataFrame:
    """Check columns, types and row values; raise naming ``where``, the row and the field.

    ``first_row`` is the file row of ``df``'s first row, when ``df`` is one chunk of a file.
    Optional columns it lacks are added as nulls.
    """
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise CachelabError(f"{where}: missing field(s) {missing}; a trace has {list(REQUIRED)}")
    df = with_optional(df)
    for name, dtype in POLARS_SCHEMA.items():
        if df.schema[name] != dtype:
            raise CachelabError(f"{where}: field {name!r} has type {df.schema[name]}, expected {dtype}")
    nulls = df.select(pl.col(c).null_count() for c in NON_NULL).row(0)
    for name, count in zip(NON_NULL, nulls):
        if count:
            row = df.select(pl.col(name).is_null().arg_true().first()).item()
            raise CachelabError(f"{where}: row {first_row + row}, field {name!r}: null (the field is required)")
    _first_violation(df, _checks(), where, first_row)
    return df


def _first_violation(df: pl.DataFrame, checks, where: str, first_row: int = 0) -> None:
    """Raise for the first of ``checks`` some row of ``df`` fails, naming ``where``, the row,
    the field and its value."""
    ok = df.select(cond.all().alias(str(i)) for i, (_, cond, _) in enumerate(checks)).row(0)
    for passed, (name, cond, meaning) in zip(ok, checks):
        if not passed:
            row = df.select((~cond).arg_true().first()).item()
            value = df[name][row]
            shown = value.to_list()[:8] if isinstance(value, pl.Series) else value
            raise CachelabError(f"{where}: row {first_row + row}, field {name!r} = {shown!r}: {meaning}")


def check_across_rows(lazy: pl.LazyFrame, path: str | os.PathLike) -> None:
    """``validate``'s checks that span rows (request ids unique, arrivals in order) over the
    whole of ``lazy``, a trace file, read on those two scalar columns alone: a reader that
    validates it batch by batch (``iter_batches``) sees neither a repeat nor a step back
    between two batches."""
    _first_violation(collect(lazy.select("request_id", "arrival_s"), Path(path)), [_unique_ids(), _in_order()],
                     str(path))


def _check_file_schema(path: Path) -> None:
    if not path.is_file():
        raise CachelabError(f"trace not found: {path}")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise CachelabError(f"{path}: not a Parquet file ({exc})") from None
    version = (schema.metadata or {}).get(VERSION_KEY)
    if version is None:
        raise CachelabError(f"{path}: not a cachelab trace (no {VERSION_KEY.decode()} in the Parquet metadata); "
                            "import foreign traces with `cachelab trace build`")
    if version.decode() != SCHEMA_VERSION:
        raise CachelabError(f"{path}: trace schema version {version.decode()}, this cachelab reads {SCHEMA_VERSION}")


def recorded_tokenizer(path: str | os.PathLike) -> dict | None:
    """The tokenizer trace ``path`` records (``tokenizer_record``), None where it records none: an
    import without ids, a capture whose ids' tokenizer it does not name, or a trace written before
    tokenizers were recorded."""
    path = Path(path)
    _check_file_schema(path)
    raw = (pq.read_schema(path).metadata or {}).get(TOKENIZER_KEY)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not is_tokenizer_record(record):
        raise CachelabError(f"{path}: Parquet metadata {TOKENIZER_KEY.decode()} = {raw[:80]!r} is not "
                            '{"tokenizer": NAME, "sha256": HEX}')
    return record


def check_tokenizer(path: str | os.PathLike, layout) -> None:
    """Refuse to address trace ``path``'s token ids with ``layout`` (an ``EngramConfig``) where
    the trace records another tokenizer than the layout's (a different tokenizer.json)."""
    record = recorded_tokenizer(path)
    if record is not None:
        refuse_other_tokenizer(record, layout, f"{path}: its token ids are")


def refuse_other_tokenizer(record: dict, layout, ids: str) -> None:
    """Raise where ``record`` (``tokenizer_record``) is another tokenizer than ``layout``'s;
    ``ids`` names the token ids at fault."""
    wanted = tokenizer_record(layout.tokenizer)
    if record["sha256"] != wanted["sha256"]:
        raise CachelabError(
            f"{ids} of tokenizer {record['tokenizer']!r} (tokenizer.json SHA-256 {record['sha256'][:16]}...), but "
            f"layout {layout.name!r} addresses ids of {layout.tokenizer!r} (SHA-256 {wanted['sha256'][:16]}...): the "
            "same ids are other text there, so every row would be another's. Build the trace with the layout's "
            "tokenizer (corpus.tokenizer in a spec; a capture's ids are its server's tokenizer's), or give a "
            "layout of the trace's tokenizer (--preset FILE with its tokenizer, or workload.preset in an experiment)")


def read_trace(path: str | os.PathLike) -> pl.DataFrame:
    """The whole table, validated (eager)."""
    path = Path(path)
    _check_file_schema(path)
    return validate(collect(pl.scan_parquet(path), path), str(path))


def has_requests(df: pl.DataFrame, where: str | None = None) -> pl.DataFrame:
    """``df``, refused (naming ``where``, the file) when it holds no requests: a replay of none
    has no figures. An empty trace is valid to hold and to ``trace info``, not to replay."""
    if df.height == 0:
        raise CachelabError(f"{where + ': ' if where else ''}the trace holds no requests: nothing to replay")
    return df


def outputs_unknown(df: pl.DataFrame) -> pl.Series:
    """Per row: prompt token ids given but no output ids though ``output_len`` > 0. Such a
    row is valid to hold (each id list is checked on its own), but its decode tokens are
    unknown, so addressing it as prompt then output would silently drop its output lookups."""
    return (df["prompt_ids"].list.len() > 0) & (df["output_ids"].list.len() == 0) & (df["output_len"] > 0)


def require_outputs(df: pl.DataFrame, where: str, *, first_row: int = 0) -> pl.DataFrame:
    """``df``, refused naming ``where``, the row and the field where ``outputs_unknown``."""
    unknown = outputs_unknown(df)
    if unknown.any():
        row = int(unknown.arg_true()[0])
        raise CachelabError(
            f"{where}: row {first_row + row}, field 'output_ids' = []: empty while output_len = "
            f"{df['output_len'][row]} and prompt_ids are given ({int(unknown.sum()):,} of {df.height:,} rows): the output's "
            "tokens are unknown, so its Engram lookups cannot be addressed; give every such request its output "
            "ids, or set its output_len to 0 to replay the prompt alone")
    return df


def scan_trace(path: str | os.PathLike) -> pl.LazyFrame:
    """A lazy view; the version and column types are checked now, row values by ``read_trace``."""
    path = Path(path)
    _check_file_schema(path)
    lazy = with_optional(pl.scan_parquet(path))
    schema = lazy.collect_schema()
    for name, dtype in POLARS_SCHEMA.items():
        if name not in schema:
            raise CachelabError(f"{path}: missing field {name!r}")
        if schema[name] != dtype:
            raise CachelabError(f"{path}: field {name!r} has type {schema[name]}, expected {dtype}")
    return lazy


def damaged(path: Path, exc: BaseException, rows_read: int | None = None) -> CachelabError:
    """The error for a trace whose footer reads but whose data does not (a corrupt page)."""
    where = f" after row {rows_read:,}" if rows_read is not None else ""
    return CachelabError(f"{path}: damaged Parquet data{where} ({type(exc).__name__}: {str(exc)[:200]}); the "
                         "footer reads but a data page does not: rebuild the trace (`cachelab trace build`) "
                         "or restore the file")


def collect(lazy: pl.LazyFrame, path: Path) -> pl.DataFrame:
    """``lazy.collect()`` over a trace file, a damaged page named as ``damaged`` says."""
    try:
        return lazy.collect()
    except Exception as exc:  # polars raises several error types for damaged files
        raise damaged(Path(path), exc) from None


def iter_batches(path: str | os.PathLike, batch_size: int) -> Iterator[pa.RecordBatch]:
    """The trace's record batches in order (schema checked first); a damaged data page is a
    CachelabError naming the file and the rows read before it, not a library traceback."""
    path = Path(path)
    _check_file_schema(path)
    seen = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
            yield batch
            seen += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise damaged(path, exc, seen) from None


def conform(df: pl.DataFrame) -> pl.DataFrame:
    """Cast a producer's frame to the schema's column order and types (no value checks);
    optional columns it lacks become nulls."""
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise CachelabError(f"cannot build a trace: missing field(s) {missing}")
    df = with_optional(df)
    try:
        return df.select(pl.col(name).cast(dtype, strict=True) for name, dtype in POLARS_SCHEMA.items())
    except pl.exceptions.PolarsError as exc:
        raise CachelabError(f"cannot build a trace: {exc}") from None


def _to_arrow(df: pl.DataFrame) -> pa.Table:
    return df.to_arrow().cast(SCHEMA)


class TraceWriter:
    """Writes a trace in chunks (bounded memory), atomically: the file appears on ``close``.

    Each chunk is validated; arrival order and request-id uniqueness are checked across
    chunks too (ids must increase from chunk to chunk). ``tokenizer``: the tokenizer that made
    the token ids, recorded: its source (``tokenizer_record`` of it), or a record already made (a
    capture's, whose tokenizer.json may be on another machine); None for a trace without ids of a
    known one.
    """

    def __init__(self, path: str | os.PathLike, tokenizer: str | dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = tokenizer_record(tokenizer) if isinstance(tokenizer, str) else tokenizer
        schema = SCHEMA if record is None else SCHEMA.with_metadata(
            {**SCHEMA.metadata, TOKENIZER_KEY: json.dumps(record).encode()})
        self._tmp = scratch_beside(self.path)
        try:
            self._writer = pq.ParquetWriter(self._tmp, schema, compression="zstd")
        except BaseException:  # Ctrl-C as the file opened: no __exit__ would remove it
            self._tmp.unlink(missing_ok=True)
            raise
        self._last_arrival = 0.0
        self._last_id = -1
        self.rows = 0

    def write(self, chunk: pl.DataFrame) -> None:
        chunk = validate(conform(chunk), str(self.path), first_row=self.rows)
        if chunk.height == 0:
            return
        first_arrival, first_id = chunk["arrival_s"][0], chunk["request_id"].min()
        if first_arrival < self._last_arrival:
            raise CachelabError(f"{self.path}: row {self.rows}, field 'arrival_s' = {first_arrival}: "
                                "goes back in time across chunks")
        if first_id <= self._last_id:
            raise CachelabError(f"{self.path}: row {self.rows}, field 'request_id' = {first_id}: "
                                "ids must increase from chunk to chunk")
        self._writer.write_table(_to_arrow(chunk), row_group_size=max(chunk.height, 1))
        self._last_arrival, self._last_id = chunk["arrival_s"][-1], chunk["request_id"].max()
        self.rows += chunk.height

    def close(self) -> None:
        self._writer.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:  # a second Ctrl-C as the footer is written
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
            if isinstance(exc, OSError):
                name_the_file(exc, self.path)


def write_trace(df: pl.DataFrame, path: str | os.PathLike, tokenizer: str | dict | None = None) -> None:
    """Validate and write one table (atomically: an existing file is replaced only on success)."""
    write_chunks([df], path, tokenizer)


def write_chunks(chunks: Iterable[pl.DataFrame], path: str | os.PathLike, tokenizer: str | dict | None = None) -> int:
    """Write chunks in order (``tokenizer`` as ``TraceWriter``'s); returns the number of rows."""
    with TraceWriter(path, tokenizer) as writer:
        for chunk in chunks:
            writer.write(chunk)
    return writer.rows


def empty_lists(name: str, n: int) -> pl.Series:
    """``n`` empty token lists: the content-less marker of an imported arrival trace."""
    return list_series(name, np.zeros(n + 1, dtype=np.int32), np.empty(0, dtype=np.int32))


def list_series(name: str, offsets: np.ndarray, values: np.ndarray) -> pl.Series:
    """A list column from flat values and offsets (row i = values[offsets[i]:offsets[i+1]]), no copy per row."""
    return pl.Series(name, pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values)))
