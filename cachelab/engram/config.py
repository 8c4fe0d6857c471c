"""Engram layouts: presets, hash multipliers, primes and table offsets.

A layout is fully described by a few hyper-parameters; everything else (multipliers,
primes, offsets, table sizes) is derived here once. The presets' multipliers are hard-coded
because NumPy does not promise a stable Generator stream across versions; a test re-derives
them.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.paths import named_in
from cachelab.engram.vocab import DEEPSEEK_V4, DEEPSEEK_V4_COMPRESSED_SIZE, compressed_map

PRIME_1 = 10007
MAX_BASE_SIZE, MAX_HEADS = 2**40, 2**16
# Bytes per row by storage format: V4.1 stores 256 FP8 E4M3 values + one UE8M0 scale per 32.
ROW_DTYPES = {"fp8_e4m3_ue8m0": lambda dim: dim + dim // 32, "bf16": lambda dim: 2 * dim,
              "fp16": lambda dim: 2 * dim, "fp32": lambda dim: 4 * dim}


@dataclass(frozen=True)
class EngramConfig:
    """Hyper-parameters of one model's Engram layers.

    Args:
        name: preset or user label.
        layers: decoder indices of the Engram layers, in table-building order.
        max_ngram: N; orders 2..N are hashed.
        heads: hash heads per order.
        base_sizes: base table size per order (primes are the next unused primes above it).
        compressed_vocab: V, the compressed vocabulary size (drives the multipliers).
        pad_id: raw id of the pad token used for look-back before a sequence start.
        row_dim: values per row; row_dtype: storage format (sets bytes per row).
        tokenizer: ``deepseek-v4`` or a path to a HF tokenizer.json.
        multipliers: hard-coded per-layer multipliers, or None to derive them.
        note: a caveat shown by ``engram info``.
    """

    name: str
    layers: tuple[int, ...]
    max_ngram: int
    heads: int
    base_sizes: tuple[int, ...]
    compressed_vocab: int
    pad_id: int = 2
    row_dim: int = 256
    row_dtype: str = "fp8_e4m3_ue8m0"
    tokenizer: str = DEEPSEEK_V4
    multipliers: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("name", "row_dtype", "tokenizer", "note"):  # row_dtype = ["x"] was "unhashable type: 'list'"
            if not isinstance(getattr(self, name), str):
                raise CachelabError(f"{name}: {getattr(self, name)!r} is not a string")
        for name, low in (("max_ngram", 2), ("compressed_vocab", 1), ("pad_id", 0), ("row_dim", 1)):
            _check_ints(name, [getattr(self, name)], low)
        # upper bounds far past any model's, under what int64 primes and table sums hold: a base size
        # of 2^63 - 1 was an OverflowError in derive_primes, 2^70 heads a NumPy ValueError
        _check_ints("heads", [self.heads], 1, MAX_HEADS)
        _check_ints("layers", self.layers, 0)
        _check_ints("base_sizes", self.base_sizes, 1, MAX_BASE_SIZE)
        if len(self.base_sizes) != self.max_ngram - 1:
            raise CachelabError(
                f"base_sizes needs one size per order 2..{self.max_ngram}, got {list(self.base_sizes)}"
            )
        if self.row_dtype not in ROW_DTYPES:
            raise CachelabError(f"row_dtype {self.row_dtype!r} unknown; use one of {sorted(ROW_DTYPES)}")
        if self.row_dtype == "fp8_e4m3_ue8m0" and self.row_dim % 32:
            raise CachelabError(f"row_dim {self.row_dim} is not a multiple of 32, as fp8_e4m3_ue8m0 rows "
                                "(one scale per 32 values) need")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise CachelabError(f"layers must be distinct and non-empty, got {list(self.layers)}")
        if self.multipliers is not None:
            if len(self.multipliers) != len(self.layers) or any(len(m) != self.max_ngram for m in self.multipliers):
                raise CachelabError(f"multipliers needs one list of max_ngram = {self.max_ngram} per layer of "
                                    f"{list(self.layers)}, got {[list(m) for m in self.multipliers]}")
            # token * multiplier stays below 2^63 for every compressed id (ENGRAM.md §3.1)
            for m in self.multipliers:
                _check_ints("multipliers", m, 1, (2**63 - 1) // self.compressed_vocab)

    @property
    def columns(self) -> int:
        """Rows read per token per layer: (N-1) * H."""
        return (self.max_ngram - 1) * self.heads

    @property
    def row_bytes(self) -> int:
        return ROW_DTYPES[self.row_dtype](self.row_dim)

    @cached_property
    def multiplier_array(self) -> np.ndarray:
        """int64 [layers, N]: hard-coded if given, else drawn as DeepSeek does."""
        if self.multipliers is not None:
            return np.asarray(self.multipliers, dtype=np.int64)
        return derive_multipliers(self.layers, self.max_ngram, self.compressed_vocab)

    @cached_property
    def primes(self) -> np.ndarray:
        """int64 [layers, columns]: per-head table sizes, never reused across the model."""
        return derive_primes(self.layers, self.base_sizes, self.heads)

    @cached_property
    def offsets(self) -> np.ndarray:
        """int64 [layers, columns]: start row of each head's slice in its layer's table."""
        return np.cumsum(self.primes, axis=1) - self.primes

    @cached_property
    def table_rows(self) -> np.ndarray:
        return self.primes.sum(axis=1)

    def with_(self, **changes) -> "EngramConfig":
        """A custom variant; derived values (primes, multipliers) are recomputed."""
        if "multipliers" not in changes and ({"layers", "max_ngram", "compressed_vocab"} & set(changes)):
            changes["multipliers"] = None
        return replace(self, **changes)


def _check_ints(name: str, values, low: int, high: int | None = None) -> None:
    """Refuse a field that is not integers in [low, high], naming the field and the value."""
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low or (high is not None and v > high):
            within = f"between {low} and {high}" if high is not None else f">= {low}"
            raise CachelabError(f"{name}: {v!r} is not an integer {within}")


def derive_multipliers(layers, max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd int64 multipliers from PCG64 seeded with 10007*L (ENGRAM.md §3.1)."""
    bound = max(1, ((2**63 - 1) // compressed_vocab) // 2)
    rows = []
    for layer in layers:
        rng = np.random.default_rng(PRIME_1 * layer)
        rows.append(rng.integers(low=0, high=bound, size=max_ngram, dtype=np.int64) * 2 + 1)
    return np.asarray(rows, dtype=np.int64)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for every n < 3.3e24 (more than any table needs)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def derive_primes(layers, base_sizes, heads: int) -> np.ndarray:
    """Each (layer, order, head) takes the next unused prime above its order's base (§3.3)."""
    used: set[int] = set()
    out = np.empty((len(layers), len(base_sizes) * heads), dtype=np.int64)
    for li in range(len(layers)):
        for oi, base in enumerate(base_sizes):
            candidate = base - 1
            for h in range(heads):
                candidate += 1
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                out[li, oi * heads + h] = candidate
    return out


PRESETS: dict[str, EngramConfig] = {
    "deepseek-v4.1-flash": EngramConfig(
        name="deepseek-v4.1-flash",
        layers=(1, 14),
        max_ngram=4,
        heads=8,
        base_sizes=(16_000_000,) * 3,
        compressed_vocab=DEEPSEEK_V4_COMPRESSED_SIZE,
        row_dim=256,
        row_dtype="fp8_e4m3_ue8m0",
        multipliers=(
            (76632096046245, 4839876093313, 35959672319349, 73987337458391),
            (67716810739261, 51510806800915, 30921347202721, 82619226485591),
        ),
    ),
    "engram-27b-demo": EngramConfig(
        name="engram-27b-demo",
        layers=(1, 15),
        max_ngram=3,
        heads=8,
        base_sizes=(646_400, 646_400),
        compressed_vocab=DEEPSEEK_V4_COMPRESSED_SIZE,
        row_dim=64,
        row_dtype="bf16",
        multipliers=(
            (76632096046245, 4839876093313, 35959672319349),
            (28919099099511, 56020370062535, 53929037264533),
        ),
        note=(
            "DeepSeek's demo uses the DeepSeek-V3 tokenizer, whose compressed vocabulary is not "
            "published; this preset uses the V4 compressed map (V = 99,092) instead, so its "
            "multipliers and rows are the demo's layout, not the demo's exact ids."
        ),
    ),
}


CONFIG_KEYS = {"name", "layers", "max_ngram", "heads", "base_sizes", "compressed_vocab", "pad_id",
               "row_dim", "row_dtype", "tokenizer", "multipliers", "note"}


def load_config(path: Path) -> EngramConfig:
    """A custom layout from a TOML or JSON file with EngramConfig's fields.

    ``compressed_vocab`` may be left out: it is then measured from the tokenizer's map. A relative
    ``tokenizer`` path is read from the layout file's folder, wherever the command runs.
    """
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise CachelabError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise CachelabError(f"{path}: expected a table of layout fields, got {type(data).__name__}")
    unknown = set(data) - CONFIG_KEYS
    if unknown:
        raise CachelabError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(CONFIG_KEYS)}")
    data.setdefault("name", path.stem)
    try:
        for key in ("layers", "base_sizes"):
            if key in data:
                data[key] = tuple(_listed(key, data[key]))
        if data.get("multipliers") is not None:
            rows = _listed("multipliers", data["multipliers"])
            data["multipliers"] = tuple(tuple(_listed("multipliers", m)) for m in rows)
        if not isinstance(data.get("tokenizer", DEEPSEEK_V4), str):
            raise CachelabError(f"tokenizer must be {DEEPSEEK_V4!r} or a path, got {data['tokenizer']!r}")
        if data.get("tokenizer", DEEPSEEK_V4) != DEEPSEEK_V4:  # as a file names it: from its folder, not the cwd
            data["tokenizer"] = named_in(path, data["tokenizer"])
        if "compressed_vocab" not in data:
            data["compressed_vocab"] = int(compressed_map(data.get("tokenizer", DEEPSEEK_V4)).max()) + 1
        return EngramConfig(**data)
    except (TypeError, CachelabError) as exc:
        raise CachelabError(f"{path}: {exc}") from None


def _listed(key: str, value) -> list:
    if not isinstance(value, list):
        raise CachelabError(f"{key} must be a list, got {value!r}")
    return value


def get_preset(name: str) -> EngramConfig:
    """A preset by name, or a custom layout from a .toml/.json file path."""
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise CachelabError(f"layout file not found: {path} (a preset is one of {sorted(PRESETS)})")
        return load_config(path)
    raise CachelabError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} or a layout .toml/.json file")


def preset_flag(name: str) -> str:
    """How advice names layout ``name`` on the command line: ``--preset NAME`` for a preset; a
    custom layout goes by the file it was loaded from, which its name alone does not give."""
    return f"--preset {name}" if name in PRESETS else f"--preset FILE (the .toml/.json file of layout {name!r})"
