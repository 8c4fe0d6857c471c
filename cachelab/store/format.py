"""Table files on disk: the header, the page layout, the fold into scaled tables, row contents.

One file per Engram layer, ``layer<id>.tbl``, beside a ``manifest.json`` written last:

```
 offset 0      header page (4096 B): magic, version, layout hash, row count, row bytes, ...
 offset 4096   data page 0: rows 0..14 (15 x 264 B = 3960 B) + 136 B of zeros
 offset 8192   data page 1: rows 15..29 ...
```

Rows never straddle a 4 KiB page, so one row is one aligned 4 KiB read (O_DIRECT needs
aligned reads), and ``row // rows_per_page`` is the page the simulator's SSD model charges
(``cachelab.engine.tiers.SSDStore``): the live store and the simulator count the same pages.
The padding costs 3.3 % of the file.

A row is the V4.1 format whatever the layout: ``row_dim`` FP8 E4M3 values, then one UE8M0
scale byte per 32 values (264 B for 256 values). Built rows are a deterministic function of
(seed, layer index, row id), a SplitMix64 stream, so any row read back can be recomputed and
compared; the FP8 NaN pattern (0x7F/0xFF) is never written and scales stay in 2^-7..2^8.

Scaled tables (``--scale F``, 0 < F <= 1) keep each hash head's slice: head j of a layer,
``P_j`` rows at offset ``off_j`` in the full layout, gets ``p_j = ceil(F * P_j)`` rows at
offset ``off'_j`` in the scaled table, and a full-layout row ``off_j + r`` folds to
``off'_j + (r mod p_j)``. Each head's residue is already uniform modulo its prime, so the fold
keeps each head's share of the table and raises collisions by 1/F, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np

from cachelab.engram.config import EngramConfig
from cachelab.errors import CachelabError
from cachelab.paths import scratch_beside
from cachelab.workload.lookups import global_key

MAGIC = b"CLENGRAM"
VERSION = 1
PAGE = 4096
HEADER = struct.Struct("<8sII32sQIIIIQd")  # magic, version, header bytes, layout hash, rows, row bytes,
#                                            rows per page, layer index, layer id, seed, scale
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "cachelab-engram-tables"  # the manifest's "format": what tells a table build's apart
BLOCK = 32  # values per UE8M0 scale byte


def fp8_row_bytes(row_dim: int) -> int:
    """Bytes of one V4.1-format row of ``row_dim`` values."""
    if row_dim % BLOCK:
        raise CachelabError(f"row_dim {row_dim} is not a multiple of {BLOCK} (one UE8M0 scale per {BLOCK} values)")
    return row_dim + row_dim // BLOCK


def integer_ids(rows) -> np.ndarray:
    """Row ids as int64, refused unless they are integers (float ids were truncated: a row id +
    0.5 served that row, with no error)."""
    rows = np.asarray(rows)
    if rows.dtype.kind not in "iu" and rows.size:
        raise CachelabError(f"row ids must be integers, got dtype {rows.dtype} (e.g. {rows.reshape(-1)[0].item()!r})")
    if rows.dtype == np.uint64 and rows.size and (top := int(rows.max())) >= 2 ** 63:  # int64 would make it negative
        raise CachelabError(f"row id {top} is out of range: row ids are below 2^63")
    return rows.astype(np.int64, copy=False)


@dataclass(frozen=True)
class TableLayout:
    """A layout's tables at a scale: rows per head slice, per layer, and the fold into them."""

    config: EngramConfig
    scale: float

    def __post_init__(self) -> None:
        if not (0 < self.scale <= 1) or math.isnan(self.scale):
            raise CachelabError(f"--scale must be in (0, 1], got {self.scale}")

    @property
    def row_dim(self) -> int:
        return self.config.row_dim

    @property
    def row_bytes(self) -> int:
        return fp8_row_bytes(self.config.row_dim)

    @property
    def rows_per_page(self) -> int:
        return PAGE // self.row_bytes

    @property
    def head_rows(self) -> np.ndarray:
        """int64 [layers, columns]: rows of each head's slice in the scaled table."""
        return np.maximum(1, np.ceil(self.config.primes * self.scale)).astype(np.int64)

    @property
    def head_offsets(self) -> np.ndarray:
        rows = self.head_rows
        return np.cumsum(rows, axis=1) - rows

    @property
    def table_rows(self) -> np.ndarray:
        """int64 [layers]: rows of each layer's scaled table."""
        return self.head_rows.sum(axis=1)

    @property
    def layer_base(self) -> np.ndarray:
        """int64 [layers]: first key of each layer in the store's one key space."""
        rows = self.table_rows
        return np.cumsum(rows) - rows

    def global_keys(self, keys: np.ndarray) -> np.ndarray:
        """Store keys (``layer_base + row``) as the engine names rows: ``global_key(layer, row)``."""
        layer = np.searchsorted(self.layer_base, keys, "right") - 1
        return global_key(layer, keys - self.layer_base[layer])

    @property
    def num_keys(self) -> int:
        return int(self.table_rows.sum())

    def file_pages(self, layer: int) -> int:
        return -(-int(self.table_rows[layer]) // self.rows_per_page)

    def file_bytes(self, layer: int) -> int:
        return PAGE * (1 + self.file_pages(layer))

    def hash(self) -> bytes:
        """SHA-256 of what decides every row's place: layers, primes, row format, scale, fold."""
        c = self.config
        desc = {"layers": list(c.layers), "primes": c.primes.tolist(), "row_dim": c.row_dim,
                "row_format": "fp8_e4m3_ue8m0", "scale": self.scale, "fold": "per-head-modulo",
                "page": PAGE, "format_version": VERSION}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()

    def fold(self, rows: np.ndarray, layer_index: np.ndarray | None = None,
             base: np.ndarray | None = None) -> np.ndarray:
        """Full-layout row ids -> keys of the store's key space (``base + scaled row``, ``base``
        per layer, ``layer_base`` by default: a caller may number each layer's rows elsewhere).

        ``rows`` is ``[..., layers, columns]`` as the Addresser returns (folded in one compiled
        pass), or, with ``layer_index`` (same shape), any array of rows of those layers.
        """
        rows = integer_ids(rows)
        cfg = self.config
        off, primes = cfg.offsets, cfg.primes
        base = self.layer_base if base is None else np.asarray(base, np.int64)
        if layer_index is None:
            n_layers, n_cols = off.shape
            self.check_shape(rows)
            rows = np.ascontiguousarray(rows)
            out = np.empty(rows.shape, np.int64)
            bad = _fold_rows(rows.reshape(-1, n_layers, n_cols), off.astype(np.int64), primes.astype(np.int64),
                             self.head_offsets + base[:, None], self.head_rows.astype(np.int64),
                             out.reshape(-1, n_layers, n_cols))
            if bad >= 0:
                self.out_of_range(rows, bad)
            return out
        else:
            layer_index = np.asarray(layer_index, dtype=np.int64)
            if layer_index.size and (layer_index.min() < 0 or layer_index.max() >= off.shape[0]):
                raise CachelabError(f"layer index {int(layer_index.max())} is outside the layout's "
                                    f"{off.shape[0]} layers")
            col = np.empty(rows.shape, np.int64)
            for li in range(off.shape[0]):
                sel = layer_index == li
                col[sel] = np.searchsorted(off[li], rows[sel], side="right") - 1
            col = np.maximum(col, 0)
            col_off, col_p = off[layer_index, col], primes[layer_index, col]
            new_off = (self.head_offsets + base[:, None])[layer_index, col]
            new_p = self.head_rows[layer_index, col]
        residue = rows - col_off
        bad = (residue < 0) | (residue >= col_p)
        if bad.any():
            self.out_of_range(rows, int(np.flatnonzero(bad.ravel())[0]))
        return new_off + residue % new_p

    def check_shape(self, rows: np.ndarray) -> None:
        """Row ids must be ``[..., layers, columns]`` of the layout (as the Addresser returns)."""
        n_layers, n_cols = self.config.offsets.shape
        if rows.ndim < 2 or rows.shape[-2:] != (n_layers, n_cols):
            raise CachelabError(f"row ids must be [tokens, {n_layers}, {n_cols}] for layout {self.config.name!r}, "
                                f"got shape {list(rows.shape)}")

    def fold_heads(self, base: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """The fold of ``fold`` per head, flat in ``[layers, columns]`` order (int64, contiguous):
        each head's first full-layout row and prime, its first key (``base`` per layer,
        ``layer_base`` by default) and rows in the scaled table, and ``1 / rows`` (float64). Row
        id ``r`` of head ``h`` folds to ``key[h] + (r - first[h]) mod rows[h]``; a compiled
        kernel takes these once."""
        base = self.layer_base if base is None else np.asarray(base, np.int64)
        flat = lambda a: np.ascontiguousarray(a, np.int64).reshape(-1)  # noqa: E731
        rows = flat(self.head_rows)
        return (flat(self.config.offsets), flat(self.config.primes), flat(self.head_offsets + base[:, None]), rows,
                1.0 / rows)

    def out_of_range(self, rows: np.ndarray, i: int):
        """Raise the error for the flat index ``i`` of ``rows`` (the fold's kernels return it)."""
        *token, layer, column = (int(j) for j in np.unravel_index(i, rows.shape))
        first, prime = int(self.config.offsets[layer, column]), int(self.config.primes[layer, column])
        where = f"token {token[0] if len(token) == 1 else tuple(token)}, " if token else ""
        raise CachelabError(f"row id {int(rows.ravel()[i])} is out of range for its head of layout "
                            f"{self.config.name!r} ({where}table layer {layer} (layer id {self.config.layers[layer]}), "
                            f"column {column}: rows {first} to {first + prime - 1})")


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _fold_rows(rows, offsets, primes, new_offsets, new_primes, out):
    """``out[t, l, c] = new_offsets[l, c] + (rows[t, l, c] - offsets[l, c]) mod new_primes[l, c]``
    (``rows`` int64 ``[tokens, layers, columns]``). Returns the flat index of the first row id
    outside its head's slice, or -1."""
    layers, columns = offsets.shape
    for t in range(rows.shape[0]):
        for li in range(layers):
            for c in range(columns):
                r = rows[t, li, c] - offsets[li, c]
                if r < 0 or r >= primes[li, c]:
                    return (t * layers + li) * columns + c
                p = new_primes[li, c]
                out[t, li, c] = new_offsets[li, c] + (r if r < p else r % p)
    return -1


def pack_header(layout: TableLayout, layer: int, seed: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, PAGE, layout.hash(), int(layout.table_rows[layer]), layout.row_bytes,
                       layout.rows_per_page, layer, int(layout.config.layers[layer]), int(seed), float(layout.scale))
    return head + bytes(PAGE - len(head))


def check_header(path: Path, layout: TableLayout, layer: int, seed: int) -> dict:
    """Read ``path``'s header page; a clear error names the file and the field that does not fit
    the manifest's build (``layout``, ``seed``): a file copied in from another build, even one of
    the same layout, is refused before any of its rows is served."""
    try:
        st = path.stat()
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # opening a FIFO waits for a writer forever
            raise CachelabError(f"{path}: not a regular file (a FIFO, socket or device), not a table file")
        size = st.st_size
        with open(path, "rb") as f:
            raw = f.read(PAGE)
    except FileNotFoundError:
        raise CachelabError(f"{path}: table file missing (rebuild with `cachelab store build`)") from None
    except OSError as exc:  # a directory, a symlink loop, EIO: named, not a traceback
        raise CachelabError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) < HEADER.size:
        raise CachelabError(f"{path}: truncated: {size} B, shorter than the {HEADER.size}-B header")
    magic, version, header_bytes, lhash, rows, row_bytes, rpp, li, lid, file_seed, scale = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CachelabError(f"{path}: not a cachelab table (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CachelabError(f"{path}: table format version {version}, this cachelab reads {VERSION}")
    if row_bytes != layout.row_bytes:
        raise CachelabError(f"{path}: row size {row_bytes} B, the layout needs {layout.row_bytes} B")
    if lhash != layout.hash():
        raise CachelabError(f"{path}: layout hash {lhash.hex()[:16]}... does not match the manifest's layout "
                            f"({layout.hash().hex()[:16]}...): the file belongs to another layout or scale")
    if rows != int(layout.table_rows[layer]) or li != layer:
        raise CachelabError(f"{path}: holds {rows} rows of layer index {li}, expected "
                            f"{int(layout.table_rows[layer])} rows of layer index {layer}")
    if header_bytes != PAGE or rpp != layout.rows_per_page:
        raise CachelabError(f"{path}: page geometry {header_bytes}/{rpp} differs from {PAGE}/{layout.rows_per_page}")
    if lid != int(layout.config.layers[layer]):
        raise CachelabError(f"{path}: layer id {lid}, the manifest's layer index {layer} is layer "
                            f"{int(layout.config.layers[layer])}")
    if file_seed != seed:
        raise CachelabError(f"{path}: rows of seed {file_seed}, the manifest's build has seed {seed}: "
                            "the file belongs to another build")
    if size != layout.file_bytes(layer):
        raise CachelabError(f"{path}: truncated or padded: {size} B, expected {layout.file_bytes(layer)} B")
    want = pack_header(layout, layer, seed)
    if raw != want:
        at = next(i for i in range(PAGE) if raw[i] != want[i])
        raise CachelabError(f"{path}: header byte {at} is {raw[at]:#04x}, a build writes {want[at]:#04x}: "
                            "the header page is damaged")
    return {"rows": rows, "seed": file_seed, "layer_id": lid}


@nb.njit(cache=True, inline="always")
def _mix(x):
    """SplitMix64's finaliser."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _fill_row(seed, layer, row, dim, out, at):
    """Write row ``row``'s bytes at ``out[at:at + dim + dim // 32]``."""
    base = _mix(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) ^ (np.uint64(layer) << np.uint64(48))
                ^ np.uint64(row))
    for w in range(dim // 8):
        h = _mix(base + np.uint64(w + 1) * np.uint64(0x9E3779B97F4A7C15))
        for b in range(8):
            v = np.uint8((h >> np.uint64(8 * b)) & np.uint64(0xFF))
            if v & 0x7F == 0x7F:  # E4M3 NaN: write the largest finite value instead
                v ^= np.uint8(1)
            out[at + 8 * w + b] = v
    h = _mix(base ^ np.uint64(0xD1B54A32D192ED03))
    for b in range(dim // 32):
        out[at + dim + b] = np.uint8(120 + ((h >> np.uint64(8 * b)) & np.uint64(15)))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def fill_pages(seed, layer, first_page, pages, rows, dim, out):
    """Data pages ``first_page .. first_page + pages`` of a layer table of ``rows`` rows into ``out``."""
    rb = dim + dim // 32
    rpp = 4096 // rb
    out[: pages * 4096] = 0
    for p in range(pages):
        for i in range(rpp):
            row = (first_page + p) * rpp + i
            if row >= rows:
                return
            _fill_row(seed, layer, row, dim, out, p * 4096 + i * rb)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def reference_rows(seed, layer, rows, dim, out):
    """The built bytes of ``rows`` (one layer) into ``out[len(rows), row_bytes]``."""
    flat = out.reshape(-1)
    rb = dim + dim // 32
    for i in range(rows.size):
        _fill_row(seed, layer, rows[i], dim, flat, i * rb)


def stage_manifest(directory: Path, data: dict) -> Path:
    """``data`` written whole and fsynced under a scratch name beside ``manifest.json``, which
    ``place_manifest`` gives it: a build writes it before its layers, so the swap of the old
    build for the new writes nothing a full disk can refuse (a manifest refused after the swap
    lost the previous build)."""
    tmp = scratch_beside(Path(directory) / MANIFEST)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def place_manifest(directory: Path, staged: Path) -> None:
    """``staged`` renamed to ``manifest.json`` after the directory is synced: after a crash it is
    whole or absent, never present before the table files' renames."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the layers' renames first
        os.replace(staged, Path(directory) / MANIFEST)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> dict:
    """A table build's manifest. Any other ``manifest.json`` (a ``cachelab train`` model seals
    its files with one) is refused by name: nothing reads it as tables, nor replaces it."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        what = "not a directory" if os.path.lexists(directory) else "no such table directory"
        raise CachelabError(f"{directory}: {what} (build one with `cachelab store build`)")
    if not os.path.lexists(path):
        raise CachelabError(f"{path}: missing: {directory} holds no complete table build "
                            "(a build writes its manifest last)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CachelabError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CachelabError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        if isinstance(data, dict) and data.get("format") == 1 and isinstance(data.get("files"), dict):
            what = "a `cachelab train` model's manifest"
        else:
            what = f"format {data.get('format')!r}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise CachelabError(f"{path}: not the manifest of a table build ({what}, expected format "
                            f"{MANIFEST_FORMAT!r})")
    return data
