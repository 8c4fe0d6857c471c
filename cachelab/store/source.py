"""Where a table's rows come from: the SplitMix64 recompute, or a real safetensors checkpoint.

A build writes rows from one source and records it in the manifest (``"source"``); ``verify``
and ``store bench`` compare every row they read with the same source, so tables built from a
checkpoint are checked against the checkpoint's tensors, not against the recompute.

Checkpoint naming (DeepSeek-V4.1, the shared ENGRAM spec §3.4 and §4.2): one combined table
per Engram layer ``L``, ``layers.{L}.engram.embed.weight`` (``model.`` in front accepted), of
``sum(primes of L)`` rows. Either FP8 E4M3 values ``[rows, row_dim]`` with UE8M0 scales
``[rows, row_dim / 32]`` beside it (``.weight_scale_inv``, ``.weight_scale`` or ``.scale``;
stored as U8 exponent bytes, F8_E8M0, or F32 powers of two), or a BF16/F16/F32 table
quantised here to the row format: per block of 32 values the scale is the smallest power of
two that brings the block's largest magnitude within E4M3's 448 (DeepSeek's UE8M0 rule), the
values rounded to nearest even.

Scaled tables (``--scale F < 1``) take the first ``ceil(F x P_j)`` rows of each head's slice.
Tensors are read through a memory map of the file (the format is an 8-byte header length, a
JSON header, then the raw tensors), so a 189 GiB checkpoint is read a chunk at a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.store.format import BLOCK, TableLayout, reference_rows

NAMES = ("layers.{L}.engram.embed.weight", "model.layers.{L}.engram.embed.weight")
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # appended to the weight's name; ".scale" replaces ".weight"
_DTYPES = {"F8_E4M3": np.uint8, "U8": np.uint8, "F8_E8M0": np.uint8, "BF16": np.uint16, "F16": np.float16,
           "F32": np.float32}
E4M3_MAX = 448.0


def checkpoint_files(path) -> list[Path]:
    """A .safetensors file, or every .safetensors file of a directory (a sharded checkpoint)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CachelabError(f"{path}: no .safetensors files in this directory")
        return files
    if not path.is_file():
        raise CachelabError(f"{path}: no such safetensors file or directory")
    return [path]


def _header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(size))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CachelabError(f"{path}: not a safetensors file ({exc})") from None
    head.pop("__metadata__", None)
    return head, 8 + size


class Checkpoint:
    """The Engram tensors of a safetensors checkpoint, memory-mapped."""

    def __init__(self, path):
        self.path = Path(path)
        self.files = checkpoint_files(path)
        self.index: dict[str, tuple[Path, dict, int]] = {}
        for f in self.files:
            head, base = _header(f)
            for name, info in head.items():
                self.index[name] = (f, info, base)

    def tensor(self, name: str, what: str) -> tuple[np.ndarray, str, Path]:
        """(memory map, safetensors dtype, file) of ``name``."""
        file, info, base = self.index[name]
        dtype = info.get("dtype")
        if dtype not in _DTYPES:
            raise CachelabError(f"{file}: tensor {name!r} ({what}) has dtype {dtype}; expected one of {sorted(_DTYPES)}")
        lo, hi = info["data_offsets"]
        shape = tuple(info["shape"])
        item = np.dtype(_DTYPES[dtype]).itemsize
        if hi - lo != int(np.prod(shape)) * item:
            raise CachelabError(f"{file}: tensor {name!r} holds {hi - lo} B, its shape {list(shape)} needs "
                                f"{int(np.prod(shape)) * item} B")
        return np.memmap(file, _DTYPES[dtype], mode="r", offset=base + lo, shape=shape), dtype, file

    def layer(self, layer_id: int, rows: int, row_dim: int) -> "LayerTensors":
        """The tensors of Engram layer ``layer_id``, their shapes checked against the layout."""
        names = [n.format(L=layer_id) for n in NAMES]
        weight = next((n for n in names if n in self.index), None)
        if weight is None:
            engram = sorted(n for n in self.index if ".engram." in n)[:6]
            raise CachelabError(f"{self.path}: no tensor {names[0]!r} (nor {names[1]!r}) for Engram layer {layer_id}; "
                                f"Engram tensors found: {engram or 'none'}")
        values, dtype, file = self.tensor(weight, f"layer {layer_id}'s table")
        if values.shape != (rows, row_dim):
            raise CachelabError(f"{file}: tensor {weight!r} has shape {list(values.shape)}, the layout needs "
                                f"[{rows}, {row_dim}] (layer {layer_id}: the sum of its heads' primes x row_dim)")
        if dtype != "F8_E4M3":
            if dtype in ("U8", "F8_E8M0"):
                raise CachelabError(f"{file}: tensor {weight!r} has dtype {dtype}; a table is F8_E4M3 (with scales) "
                                    "or BF16/F16/F32")
            return LayerTensors(weight, file, values, dtype, None)
        candidates = [weight + s for s in SCALE_SUFFIXES] + [weight[: -len("weight")] + "scale"]
        scale_name = next((n for n in candidates if n in self.index), None)
        if scale_name is None:
            raise CachelabError(f"{file}: FP8 tensor {weight!r} has no UE8M0 scale tensor beside it "
                                f"(looked for {candidates})")
        scales, sdtype, sfile = self.tensor(scale_name, f"layer {layer_id}'s scales")
        if scales.shape != (rows, row_dim // BLOCK):
            raise CachelabError(f"{sfile}: tensor {scale_name!r} has shape {list(scales.shape)}, expected "
                                f"[{rows}, {row_dim // BLOCK}] (one UE8M0 scale per {BLOCK} values)")
        if sdtype not in ("U8", "F8_E8M0", "F32"):
            raise CachelabError(f"{sfile}: scale tensor {scale_name!r} has dtype {sdtype}; expected U8, F8_E8M0 or F32")
        return LayerTensors(weight, file, values, dtype, (scale_name, scales, sdtype))


class LayerTensors:
    """One layer's table in a checkpoint: ``rows(source_rows)`` gives them in the row format."""

    def __init__(self, name: str, file: Path, values: np.memmap, dtype: str, scales):
        self.name, self.file, self.values, self.dtype, self.scales = name, file, values, dtype, scales

    def describe(self) -> dict:
        out = {"tensor": self.name, "file": self.file.name, "dtype": self.dtype}
        if self.scales is not None:
            out["scale_tensor"], out["scale_dtype"] = self.scales[0], self.scales[2]
        return out

    def rows(self, source_rows: np.ndarray) -> np.ndarray:
        """uint8 [n, row_dim + row_dim / 32]: the rows in the store's format."""
        dim = self.values.shape[1]
        out = np.empty((source_rows.size, dim + dim // BLOCK), np.uint8)
        if self.scales is None:
            out[:, :dim], out[:, dim:] = quantize_rows(self.values[source_rows], self.dtype,
                                                       f"{self.file}: tensor {self.name!r}", source_rows)
            return out
        name, scales, sdtype = self.scales
        out[:, :dim] = self.values[source_rows]
        s = scales[source_rows]
        if sdtype == "F32":
            s = _ue8m0_of_f32(s, f"{self.file}: scale tensor {name!r}", source_rows)
        out[:, dim:] = s
        return out


def _ue8m0_of_f32(scales: np.ndarray, what: str, source_rows: np.ndarray) -> np.ndarray:
    """F32 scales -> UE8M0 bytes: ``2^(e - 127)`` is byte ``e``, 2^-126..2^127 float32's normal
    powers of two (their exponent field) and 2^-127 its one subnormal power in range (byte 0).
    Anything else is refused, naming it: 0.0 and +inf passed as bytes 0 (2^-127) and 255
    (UE8M0's NaN), and 2^-127 itself was refused."""
    bits = np.ascontiguousarray(scales).view(np.uint32)
    exp = bits >> 23  # the sign bit included: a negative value's field is past 255
    tiny = bits == 0x00400000
    ok = ((bits & 0x7FFFFF) == 0) & (exp >= 1) & (exp <= 254) | tiny
    if not ok.all():
        r, c = (int(i) for i in np.argwhere(~ok)[0])
        raise CachelabError(f"{what} holds {float(scales[r, c])!r} (row {int(source_rows[r])}, block {c}): a UE8M0 "
                            "scale is a power of two from 2^-127 to 2^127")
    return np.where(tiny, 0, exp).astype(np.uint8)


def quantize_rows(values: np.ndarray, dtype: str, what: str = "the table",
                  source_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """BF16/F16/F32 rows -> (FP8 E4M3 bytes, UE8M0 scale bytes), per block of 32 values. A NaN or
    infinity is refused, naming ``what`` (the file and tensor) and the row (``source_rows[i]``
    for row ``i`` where given) and column."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(values))
    x = x.view(torch.bfloat16) if dtype == "BF16" else x
    x = x.to(torch.float32)
    n, dim = x.shape
    blocks = x.reshape(n, dim // BLOCK, BLOCK)
    finite = torch.isfinite(x)
    if not finite.all():
        r, c = (int(i) for i in torch.nonzero(~finite)[0])
        row = r if source_rows is None else int(source_rows[r])
        raise CachelabError(f"{what} holds {float(x[r, c])} at row {row}, column {c}: the FP8 row format "
                            "cannot carry NaN or infinite values")
    amax = blocks.abs().amax(dim=2)
    mant, exp = torch.frexp(amax / E4M3_MAX)  # amax / 448 = mant x 2^exp, mant in [0.5, 1)
    up = torch.where(mant > 0.5, exp, exp - 1)  # ceil(log2(amax / 448))
    scale = torch.where(amax > 0, up + 127, torch.full_like(up, 127)).clamp(0, 254)
    fp8 = (blocks * torch.exp2(127.0 - scale.to(torch.float32))[:, :, None]).to(torch.float8_e4m3fn)
    return fp8.reshape(n, dim).view(torch.uint8).numpy(), scale.to(torch.uint8).numpy()


def source_rows(layout: TableLayout, layer: int, table_rows: np.ndarray) -> np.ndarray:
    """Rows of the full layout's table behind rows of the scaled table (the first ``ceil(F x
    P_j)`` of each head's slice)."""
    start = layout.head_offsets[layer]
    head = np.searchsorted(start, table_rows, side="right") - 1
    return layout.config.offsets[layer][head] + (table_rows - start[head])


class RowSource:
    """The reference contents of a table's rows: the SplitMix64 recompute for ``seed``, or the
    tensors of a safetensors checkpoint (``checkpoint``)."""

    def __init__(self, layout: TableLayout, seed: int = 0, checkpoint=None):
        self.layout, self.seed = layout, int(seed)
        self.kind = "splitmix64" if checkpoint is None else "safetensors"
        self.layers: list[LayerTensors] = []
        if checkpoint is not None:
            self.checkpoint = Checkpoint(checkpoint)
            cfg = layout.config
            self.layers = [self.checkpoint.layer(int(lid), int(cfg.table_rows[li]), cfg.row_dim)
                           for li, lid in enumerate(cfg.layers)]

    @classmethod
    def of_manifest(cls, layout: TableLayout, manifest: dict) -> "RowSource":
        src = manifest.get("source", {"kind": "splitmix64"})
        if src.get("kind") not in ("splitmix64", "safetensors"):
            raise CachelabError(f"manifest source kind {src.get('kind')!r} unknown (splitmix64 or safetensors)")
        return cls(layout, manifest.get("seed", 0), src["path"] if src["kind"] == "safetensors" else None)

    def describe(self) -> dict:
        """The manifest's ``"source"``."""
        if self.kind == "splitmix64":
            return {"kind": "splitmix64", "seed": self.seed}
        return {"kind": "safetensors", "path": str(self.checkpoint.path.resolve()),
                "layers": [t.describe() for t in self.layers]}

    def rows(self, layer: int, table_rows: np.ndarray) -> np.ndarray:
        """uint8 [n, row_bytes]: rows ``table_rows`` of layer index ``layer`` as they must read."""
        table_rows = np.asarray(table_rows, np.int64)
        if self.kind == "splitmix64":
            out = np.empty((table_rows.size, self.layout.row_bytes), np.uint8)
            reference_rows(self.seed, layer, table_rows, self.layout.row_dim, out)
            return out
        return self.layers[layer].rows(source_rows(self.layout, layer, table_rows))
