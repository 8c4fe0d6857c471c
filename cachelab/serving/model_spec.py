"""The model a serving step runs: parameters, KV-cache size and Engram layout, from a TOML file.

``models/deepseek-v4.1-flash.toml`` holds DeepSeek-V4.1-Flash as far as public facts go,
each assumption marked there. Its Engram tables are named by layout
(``cachelab.engram.config``), which derives their layers, rows and row bytes, so the
latency model and the addresser read one source. Derived quantities (parameters touched per
step, KV bytes per token, table bytes) are methods here, so the latency model reads them in
one place.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from cachelab.engram.config import EngramConfig, get_preset
from cachelab.errors import CachelabError

MODEL_DIR = Path(__file__).parent / "models"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    hc_mult: int
    dense_params: float
    moe_layers: int
    experts: int
    experts_per_token: int
    expert_params: float
    weight_bytes_per_param: float
    heads: int
    kv_lora_rank: int
    rope_dim: int
    kv_bytes_per_token_layer: float
    kv_replicated_across_tp: bool
    layout: EngramConfig
    wkv_params: float
    table_sharded_across_tp: bool

    @property
    def engram_layers(self) -> tuple[int, ...]:
        return tuple(self.layout.layers)

    @property
    def rows_per_token_layer(self) -> int:
        return self.layout.columns

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def table_rows(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.layout.table_rows)

    @property
    def weight_params(self) -> float:
        """Non-Engram parameters plus the Engram projections (tables excluded)."""
        return (self.dense_params + self.moe_layers * self.experts * self.expert_params
                + len(self.engram_layers) * self.wkv_params)

    @property
    def active_params(self) -> float:
        """Parameters one token multiplies through (top-k experts only)."""
        return (self.dense_params + self.moe_layers * self.experts_per_token * self.expert_params
                + len(self.engram_layers) * self.wkv_params)

    @property
    def weight_bytes(self) -> float:
        return self.weight_params * self.weight_bytes_per_param

    @property
    def table_bytes(self) -> float:
        return float(sum(self.table_rows)) * self.row_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_bytes_per_token_layer

    @property
    def attn_flops_per_ctx_token(self) -> float:
        """FLOPs one query token spends per context token per layer (MLA, absorbed: QK on the
        latent + RoPE width, then V on the latent)."""
        return 2.0 * self.heads * (2 * self.kv_lora_rank + self.rope_dim)

    def touched_weight_bytes(self, tokens: float) -> float:
        """Weight bytes a step of ``tokens`` tokens reads: dense weights plus the experts that
        at least one token routes to (expected count under uniform routing)."""
        p_untouched = (1.0 - self.experts_per_token / self.experts) ** tokens
        experts = self.experts * (1.0 - p_untouched)
        params = (self.dense_params + self.moe_layers * experts * self.expert_params
                  + len(self.engram_layers) * self.wkv_params)
        return params * self.weight_bytes_per_param


_FIELDS = {
    "backbone": ("layers", "hidden", "hc_mult", "dense_params", "moe_layers", "experts", "experts_per_token",
                 "expert_params", "weight_bytes_per_param"),
    "attention": ("heads", "kv_lora_rank", "rope_dim", "kv_bytes_per_token_layer", "kv_replicated_across_tp"),
    "engram": ("wkv_params", "table_sharded_across_tp"),
}
# [engram] keys an older spec restated; the layout derives them, so they may stay only if they agree.
_DERIVED = ("layers", "rows_per_token_layer", "row_bytes", "table_rows")


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODEL_DIR.glob("*.toml"))


def load_model(name: str | Path = "deepseek-v4.1-flash", layout: str | EngramConfig | None = None) -> ModelSpec:
    """A model spec by built-in name or TOML path; errors name the file and the key.

    Args:
        layout: the Engram layout (preset name, layout file or config) in place of the one
            the spec's ``[engram] layout`` names.
    """
    path = MODEL_DIR / f"{name}.toml"
    if not path.is_file():
        path = Path(name)
        if not path.is_file():
            raise CachelabError(f"unknown model {str(name)!r}: not a file, and not one of {builtin_models()}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CachelabError(f"cannot read model spec {path}: {exc}") from None
    values = {"name": data.get("name", path.stem)}
    for section, keys in _FIELDS.items():
        block = data.get(section)
        if not isinstance(block, dict):
            raise CachelabError(f"{path}: missing section [{section}]")
        extra = ("layout", *_DERIVED) if section == "engram" else ()
        unknown = sorted(set(block) - set(keys) - set(extra))
        if unknown:
            raise CachelabError(f"{path}: unknown key(s) {unknown} in [{section}]; allowed: {list(keys + extra[:1])}")
        for key in keys:
            if key not in block:
                raise CachelabError(f"{path}: [{section}] is missing {key!r}")
            value = block[key]
            if not isinstance(value, bool) and (not isinstance(value, (int, float)) or value <= 0):
                raise CachelabError(f"{path}: [{section}] {key} must be a positive number, got {value!r}")
            values[key] = value
    values["layout"] = _layout(path, data["engram"], layout)
    return ModelSpec(**values)


def _layout(path: Path, block: dict, layout: str | EngramConfig | None) -> EngramConfig:
    """The spec's Engram layout; restated table facts must agree with it."""
    if layout is None:
        if not isinstance(block.get("layout"), str):
            raise CachelabError(f"{path}: [engram] needs layout = a preset name or layout file (cachelab engram info)")
        layout = block["layout"]
    config = get_preset(layout) if isinstance(layout, str) else layout
    derived = {"layers": list(config.layers), "rows_per_token_layer": config.columns, "row_bytes": config.row_bytes,
               "table_rows": [int(n) for n in config.table_rows]}
    for key in _DERIVED:
        if key in block and block[key] != derived[key]:
            raise CachelabError(f"{path}: [engram] {key} = {block[key]!r} disagrees with layout {config.name!r}, "
                                f"which gives {derived[key]!r}; leave it out (the layout derives it)")
    return config
