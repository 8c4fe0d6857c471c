"""``cachelab store build`` and ``verify``: table files written whole or not at all, and checked.

A build writes its manifest under a scratch name, then every layer to ``.layer<id>.tbl.tmp``
(all fsynced) while the directory's previous build stays as it was; only when all are written
does it remove the old manifest, rename the layers into place and rename ``manifest.json`` in
last: the swap writes nothing, so a disk that fills up during a build never costs the previous
build. Every reader (``verify``,
``TieredStore.open``, ``bench``) refuses a directory without a manifest, so nothing
half-written is ever served, and a build killed, interrupted or out of disk while writing
leaves the previous build (or none) readable as it was.

One build at a time holds a directory (``.build.lock``): a second is refused, told which
process builds there. Readers take no lock: each manifest carries its own ``build_id``, and a
reader that finds the same manifest before and after opening the files has opened one build's
(a build removes the manifest before its first rename and writes its own after its last).
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from cachelab.engram.config import EngramConfig, get_preset
from cachelab.errors import CachelabError
from cachelab.paths import held, output_folder
from cachelab.progress import progress_bar
from cachelab.store.format import (MANIFEST, MANIFEST_FORMAT, PAGE, VERSION, TableLayout, check_header, fill_pages,
                                   pack_header, place_manifest, read_manifest, stage_manifest)
from cachelab.store.source import RowSource

CHUNK_PAGES = 4096  # 16 MiB per write
LOCK = ".build.lock"
MANIFEST_ROOM = 64 << 10  # the manifest (about 1 KiB) and its scratch copy, in whole blocks, with room to spare


def table_path(directory: Path, layout: TableLayout, layer: int) -> Path:
    return Path(directory) / f"layer{layout.config.layers[layer]}.tbl"


def _config_dict(config: EngramConfig) -> dict:
    data = asdict(config)
    data["layers"] = list(config.layers)
    data["base_sizes"] = list(config.base_sizes)
    data["multipliers"] = config.multiplier_array.tolist()
    return data


def load_layout(directory: Path) -> tuple[TableLayout, dict]:
    """The layout a directory's tables were built for, from its manifest, and the manifest."""
    manifest = read_manifest(directory)
    if manifest.get("version") != VERSION:  # a later format's manifest was read as this one's
        raise CachelabError(f"{Path(directory) / MANIFEST}: table build version {manifest.get('version')!r}, this "
                            f"cachelab reads version {VERSION} (rebuild with this cachelab's `cachelab store build`)")
    try:
        cfg = dict(manifest["config"])
        for key in ("layers", "base_sizes"):
            cfg[key] = tuple(cfg[key])
        cfg["multipliers"] = tuple(tuple(m) for m in cfg["multipliers"])
        layout = TableLayout(EngramConfig(**cfg), float(manifest["scale"]))
        if type(manifest.get("seed", 0)) is not int:
            raise TypeError(f"seed {manifest['seed']!r} is not an integer")
        source = manifest.get("source", {})
        if not isinstance(source, dict) or (source.get("kind") == "safetensors" and "path" not in source):
            raise TypeError(f"source {source!r}: expected {{'kind': 'splitmix64', ...}} or "
                            "{'kind': 'safetensors', 'path': ...}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CachelabError(f"{Path(directory) / MANIFEST}: malformed manifest ({exc})") from None
    if layout.hash().hex() != manifest.get("layout_hash"):
        raise CachelabError(f"{Path(directory) / MANIFEST}: layout hash does not match its own layout")
    return layout, manifest


def build_tables(layout: str | EngramConfig, scale: float, directory, seed: int = 0, progress: bool = True,
                 from_safetensors=None) -> dict:
    """Write the tables of ``layout`` at ``scale`` into ``directory``; returns the manifest.

    Rows are the SplitMix64 contents for ``seed``, or, with ``from_safetensors`` (a file or a
    directory of shards), the checkpoint's Engram tensors in the row format (cachelab/store/source.py)."""
    if not 0 <= seed < 1 << 64:  # the header's 8 bytes
        raise CachelabError(f"--seed must be in [0, 2^64), got {seed}")
    config = get_preset(layout) if isinstance(layout, str) else layout
    table = TableLayout(config, float(scale))
    source = RowSource(table, seed, from_safetensors)  # a checkpoint is checked before anything is removed
    directory = Path(directory)
    output_folder(directory, "--dir")
    if os.path.lexists(directory / MANIFEST):  # only a previous build is replaced
        try:
            read_manifest(directory)
        except CachelabError as exc:
            raise CachelabError(f"{exc}: a build replaces only a previous table build; it wrote nothing "
                                "(give another --dir)") from None
    directory.mkdir(parents=True, exist_ok=True)
    with held(directory / LOCK, "cachelab store build", "two builds at once would write the same .tmp files and "
              "mix their layers"):
        return _build(table, source, seed, directory, progress)


def _build(table: TableLayout, source: RowSource, seed: int, directory: Path, progress: bool) -> dict:
    """The files of ``table`` written under temporary names, then swapped in (module doc)."""
    config = table.config
    total = sum(table.file_bytes(li) for li in range(len(config.layers)))
    # a build killed while writing (SIGKILL, a crash) left its .tmp files, which the free space
    # below counted as used: a full-size rebuild after one was refused for the space they hold.
    # Only a build holds the lock, so these are a dead build's
    for stale in directory.glob(".layer*.tbl.tmp"):
        stale.unlink(missing_ok=True)
    # the manifest too (written first, beside them)
    free = os.statvfs(directory)
    if free.f_bavail * free.f_frsize < total + MANIFEST_ROOM:
        raise CachelabError(f"{directory}: {total + MANIFEST_ROOM:,} B needed, {free.f_bavail * free.f_frsize:,} B free")
    finals = [table_path(directory, table, li) for li in range(len(config.layers))]
    tmps = [final.with_name(f".{final.name}.tmp") for final in finals]
    manifest = {"format": MANIFEST_FORMAT, "version": VERSION, "layout": config.name, "scale": table.scale,
                "seed": int(seed), "build_id": secrets.token_hex(8), "row_bytes": table.row_bytes,
                "rows_per_page": table.rows_per_page, "page_bytes": PAGE, "table_rows": table.table_rows.tolist(),
                "files": [f.name for f in finals], "layout_hash": table.hash().hex(),
                "config": _config_dict(config),
                "fold": "per-head modulo: off'_j + (row - off_j) mod ceil(scale * P_j)",
                "source": source.describe()}
    try:  # the manifest first: once the layers are written, the swap writes nothing a full disk refuses
        staged = stage_manifest(directory, manifest)
    except OSError as exc:
        raise CachelabError(f"{directory / MANIFEST}: {exc.strerror or exc}: the build stopped and keeps nothing; "
                            "the directory's previous build, if any, is untouched") from None
    try:
        _write_layers(table, source, seed, tmps, total, progress)
    except BaseException:  # interrupted or out of disk: the previous build stays whole
        for tmp in (*tmps, staged):
            tmp.unlink(missing_ok=True)
        raise
    with _uninterrupted():  # the old build is gone until the new manifest is in place
        (directory / MANIFEST).unlink(missing_ok=True)
        for tmp, final in zip(tmps, finals):
            tmp.replace(final)
        try:
            place_manifest(directory, staged)
        except OSError as exc:  # a directory sync failing (an I/O error): the layers unreadable without it
            for path in (directory / MANIFEST, staged, *finals):  # the manifest too, if only the last sync failed
                path.unlink(missing_ok=True)
            raise CachelabError(f"{directory / MANIFEST}: {exc.strerror or exc}: the tables were written but not "
                                f"their manifest, so nothing could read them; they are removed and {directory} "
                                "holds no build now (the previous one, if any, was replaced)") from None
    return manifest


@contextmanager
def _uninterrupted():
    """Ctrl-C and SIGTERM held back until the block ends, then delivered: swapping the old build
    for the new leaves no build in between (a ctrl-C there lost the old build and kept no new
    one). Python runs signal handlers on the main thread only: a build on another is not
    interrupted by them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {sig: signal.signal(sig, lambda sig, frame: caught.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in caught[:1]:
            signal.raise_signal(sig)


def _write_layers(table: TableLayout, source: RowSource, seed: int, tmps: list[Path], total: int,
                  progress: bool) -> None:
    """Every layer's file (header page, data pages) to its path in ``tmps``, fsynced."""
    config = table.config
    buf = np.empty(CHUNK_PAGES * PAGE, np.uint8)
    columns = [TextColumn("[bold]store build"), TextColumn("{task.description}"), BarColumn(),
               TransferSpeedColumn(), TimeRemainingColumn()]
    with progress_bar(*columns, enabled=progress) as bar:
        task = bar.add_task(config.name, total=total)
        for li, tmp in enumerate(tmps):
            rows = int(table.table_rows[li])
            pages = table.file_pages(li)
            try:
                with open(tmp, "wb") as f:
                    f.write(pack_header(table, li, seed))
                    for first in range(0, pages, CHUNK_PAGES):
                        n = min(CHUNK_PAGES, pages - first)
                        if source.kind == "splitmix64":
                            fill_pages(seed, li, first, n, rows, config.row_dim, buf)
                        else:
                            _fill_from(source, li, first, n, rows, buf)
                        f.write(memoryview(buf)[: n * PAGE])
                        bar.advance(task, n * PAGE)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:  # a full disk, a read-only mount, a file size limit
                raise CachelabError(f"{tmp}: {exc.strerror or exc}: the build stopped and keeps nothing; the "
                                    "directory's previous build, if any, is untouched") from None


def _fill_from(source: RowSource, layer: int, first: int, pages: int, rows: int, buf: np.ndarray) -> None:
    """Data pages ``first .. first + pages`` of layer index ``layer`` from ``source`` into ``buf``."""
    rb, rpp = source.layout.row_bytes, source.layout.rows_per_page
    lo = first * rpp
    count = min(pages * rpp, rows - lo)
    packed = np.zeros((pages * rpp, rb), np.uint8)
    packed[:count] = source.rows(layer, np.arange(lo, lo + count))
    view = buf[: pages * PAGE].reshape(pages, PAGE)
    view[:, rpp * rb:] = 0
    view[:, : rpp * rb] = packed.reshape(pages, rpp * rb)


def open_tables(directory) -> tuple[TableLayout, dict, list[Path]]:
    """A built directory's layout, manifest and table files, every header checked. A reader
    that opens the files after this calls ``same_build`` once they are open."""
    layout, manifest = load_layout(directory)
    paths = [table_path(directory, layout, li) for li in range(len(layout.config.layers))]
    try:
        for li, path in enumerate(paths):
            check_header(path, layout, li, int(manifest.get("seed", 0)))
    except CachelabError:  # a file of a build that replaced this one is not a damaged file
        same_build(directory, manifest)
        raise
    return layout, manifest, paths


def same_build(directory, manifest: dict, opened=None) -> None:
    """Refuse files opened while another build replaced ``manifest``'s: the manifest there now
    must still be ``manifest`` (module doc). ``opened``, what the reader opened (anything with
    ``close``), is closed before the refusal."""
    try:
        now = read_manifest(directory)
    except CachelabError:
        now = None
    if now != manifest:
        if opened is not None:
            opened.close()
        raise CachelabError(f"{directory}: another `cachelab store build` replaced the tables while they were "
                            "being opened; open them again")


def _map_pages(path: Path, size: int) -> np.ndarray:
    """``path``'s data pages, mapped read-only; a file not ``size`` B (changed since its header
    check) is named, never indexed past its end."""
    try:
        data = np.memmap(path, np.uint8, mode="r", offset=PAGE)
    except (OSError, ValueError, OverflowError) as exc:  # OverflowError: nothing past the header
        raise CachelabError(f"{path}: cannot be mapped ({exc}), {size:,} B expected: the file changed since its "
                            "header was checked") from None
    if PAGE + data.size != size:
        raise CachelabError(f"{path}: {PAGE + data.size:,} B mapped, {size:,} B expected: the file changed since "
                            "its header was checked")
    return data.reshape(-1, PAGE)


def verify_tables(directory, sample: int | None = None, seed: int = 0) -> dict:
    """Re-read rows (all, or ``sample`` per layer at random) and compare them with their
    source (the recompute, or the checkpoint they were built from, as the manifest says):
    ``{"rows_checked": n, "mismatches": m}``, and where m > 0 ``"first_mismatch"``: the file,
    layer id, row and file offset of the first byte that differs (in file order)."""
    if sample is not None and sample < 1:
        raise CachelabError(f"--sample must be at least 1 row per layer, got {sample}")
    layout, manifest, paths = open_tables(directory)
    maps = [_map_pages(path, layout.file_bytes(li)) for li, path in enumerate(paths)]
    same_build(directory, manifest)
    source = RowSource.of_manifest(layout, manifest)
    rb, rpp = layout.row_bytes, layout.rows_per_page
    checked = mismatches = 0
    first = None
    rng = np.random.default_rng(seed)
    for li, path in enumerate(paths):
        n = int(layout.table_rows[li])
        data, maps[li] = maps[li], None
        slots = data[:, :rpp * rb].reshape(-1, rpp, rb)  # [page, slot, byte]: a view, the padding left out
        step = 1 << 18
        # every row a slice at a time: an index of a whole layer is 3 GB of int64 on V4.1's tables
        todo = None if sample is None else np.sort(rng.choice(n, min(sample, n), replace=False))
        for lo in range(0, n if todo is None else todo.size, step):
            rows = np.arange(lo, min(lo + step, n), dtype=np.int64) if todo is None else todo[lo:lo + step]
            got = slots[rows // rpp, rows % rpp]  # each row's bytes, not its page's 4 KiB (15x the copy)
            differ = got != source.rows(li, rows)
            bad = np.flatnonzero(differ.any(axis=1))
            if bad.size and first is None:
                r, col = int(rows[bad[0]]), int(np.flatnonzero(differ[bad[0]])[0])
                first = {"file": path.name, "layer": int(layout.config.layers[li]), "row": r,
                         "offset": PAGE * (1 + r // rpp) + (r % rpp) * rb + col}
            mismatches += int(bad.size)
            checked += rows.size
        del data
    out = {"rows_checked": checked, "mismatches": mismatches}
    if first is not None:
        out["first_mismatch"] = first
    return out
