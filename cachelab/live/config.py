"""The live model's shape: presets from a CPU-sized ``tiny`` to GPU-sized ones.

Every preset reads the DeepSeek-V4.1-Flash Engram layout (2 table layers x 24 rows of 256
values per token), so its rows are the ones the live store serves and the simulator counts;
``engram_layers`` says which decoder layers consume table layers 0 and 1 (V4.1: 1 and 14 of
40). Moving the first one later widens the prefetch window (the layers that compute while
the rows are fetched).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cachelab.engram import get_preset
from cachelab.errors import CachelabError
from cachelab.paths import named_in

DEEPSEEK_V4_VOCAB = 129_280  # the V4 tokenizer's ids, added tokens included
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer with hyper-connection streams and Engram modules.

    Args:
        hidden, layers, heads, kv_heads, head_dim, intermediate: the transformer (GQA, RoPE,
            SwiGLU, RMSNorm).
        hc_mult: residual streams (V4.1: 4); Engram gates each one separately.
        engram_layers: decoder index of each table layer of ``layout``, ascending.
        max_model_len: context length (prompt + output) a request may reach.
        dtype: compute dtype; every preset runs bfloat16, the CPU-sized ``tiny`` too (its comment
            says why); float32, the default of a config file that names none, is batch-invariant
            to float tolerance.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    engram_layers: tuple[int, ...]
    hc_mult: int = 4
    layout: str = "deepseek-v4.1-flash"
    vocab_size: int = DEEPSEEK_V4_VOCAB
    max_model_len: int = 4096
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        layout = get_preset(self.layout)
        n = len(layout.layers)
        e = tuple(self.engram_layers)
        if len(e) != n or sorted(set(e)) != list(e) or e[0] < 0 or e[-1] >= self.layers:
            raise CachelabError(f"engram_layers must be {n} ascending distinct decoder layers in [0, {self.layers}) "
                                f"(one per table layer of {self.layout!r}), got {list(e)}")
        if self.heads % self.kv_heads:
            raise CachelabError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise CachelabError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "engram_layers", e)

    @property
    def engram_in(self) -> int:
        """Width of one token's concatenated rows: 24 x 256 = 6144 for V4.1."""
        layout = get_preset(self.layout)
        return layout.columns * layout.row_dim

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # 2 CPU cores: tens of ms per decode step at batch 8. bfloat16, because a decode step is
    # bound by reading the weights (the 129,280-token head most of all) and these CPUs have
    # AVX512-BF16; float32 (``with_(dtype="float32")``) is batch-invariant to float tolerance.
    "tiny": ModelConfig("tiny", hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384,
                        engram_layers=(1, 3), max_model_len=2048, dtype="bfloat16"),
    # One GPU: V4.1's placement ratio (layers 1 and 14 of 40) at smaller widths.
    "small": ModelConfig("small", hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                         engram_layers=(1, 6), max_model_len=8192, dtype="bfloat16"),
    "medium": ModelConfig("medium", hidden=2048, layers=40, heads=16, kv_heads=4, head_dim=128,
                          intermediate=5632, engram_layers=(1, 14), max_model_len=16384, dtype="bfloat16",
                          tie_embeddings=False),
}


def model_config(preset: str | Path) -> ModelConfig:
    """A preset by name, or a JSON file of ModelConfig fields (unknown keys named)."""
    if str(preset) in PRESETS:
        return PRESETS[str(preset)]
    path = Path(preset)
    if not path.is_file():
        raise CachelabError(f"unknown model preset {str(preset)!r}; choose one of {sorted(PRESETS)} or a JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CachelabError(f"{path}: not JSON: {exc}") from None
    fields = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(data) - fields)
    if unknown:
        raise CachelabError(f"{path}: unknown model field(s) {unknown}; known: {sorted(fields)}")
    layout = data.get("layout")
    if isinstance(layout, str) and layout.endswith((".toml", ".json")):  # a layout file, as get_preset tells one
        data["layout"] = named_in(path, layout)  # from this file's folder: it was read from the working directory
    try:
        return ModelConfig(**{**data, "engram_layers": tuple(data.get("engram_layers", ()))})
    except TypeError as exc:
        raise CachelabError(f"{path}: {exc}") from None
