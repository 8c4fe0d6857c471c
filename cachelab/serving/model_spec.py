"""The model a serving step runs: parameters by precision, attention shape, KV bytes, MTP and
Engram layout, from a TOML file.

``models/deepseek-v4.1-flash.toml`` is DeepSeek-V4.1-Flash from its released config (the
transformers ``DeepseekV41TextConfig``); ``models/deepseek-r1.toml`` is DeepSeek-R1 (the V3
architecture), which most published serving measurements use. Every number there carries its
source. Attention is described generically enough for both: dense latent attention (R1's MLA:
every query reads the whole context) or V4.1's compressed sparse attention (a sliding window
plus the top-k compressed positions an indexer picks). Derived quantities (parameters touched
per step, attended positions, KV bytes) are methods here, so the latency model reads them in
one place. A model without ``[engram]`` has no Engram layers (R1).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from cachelab.engram.config import EngramConfig, get_preset
from cachelab.errors import CachelabError

MODEL_DIR = Path(__file__).parent / "models"


def sum_min(lo, hi, cap):
    """Sum of ``min(c, cap)`` over integer contexts ``c`` in ``(lo, hi]`` (vectorised); cap <= 0
    means no cap."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)

    def s(n):
        if cap <= 0:
            return n * (n + 1) / 2
        k = float(cap)
        return np.where(n <= k, n * (n + 1) / 2, k * (k + 1) / 2 + (n - k) * k)

    return s(hi) - s(lo)


def touched_experts(experts: int, per_token: int, tokens):
    """Expected experts of ``experts`` that at least one of ``tokens`` tokens routes to, each token
    picking ``per_token`` of them (uniform routing; vectorised over ``tokens``)."""
    return experts * (1.0 - (1.0 - per_token / experts) ** np.asarray(tokens, np.float64))


@lru_cache(maxsize=64)
def _ratio_counts(ratios: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(ratio, how many layers have it) over the compressing layers among ``ratios`` (a spec's few
    layouts, asked for at every step the latency model times: kept)."""
    compressing = [r for r in ratios if r > 0]
    return tuple((r, compressing.count(r)) for r in sorted(set(compressing)))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    vocab: int
    dense_params: float  # non-expert, non-embedding weights a token multiplies through (attention, shared experts, routers)
    moe_layers: int
    experts: int
    experts_per_token: int
    expert_params: float
    expert_bytes_per_param: float
    expert_precision: str  # "fp4" or "fp8": which tensor-core rate the expert GEMMs run at
    dense_bytes_per_param: float
    heads: int
    qk_dim: int  # per head, the width QK^T contracts over (absorbed latent + RoPE)
    v_dim: int  # per head, the width of the value the probabilities multiply
    prefill_qk_dim: int  # the same for prefill chunks, which MLA runs unabsorbed (0: as decode)
    prefill_v_dim: int
    kv_bytes_per_token: float  # every layer's cache entry for one token, per replica
    kv_replicated_across_tp: bool
    sliding_window: int  # 0: none
    window_bytes_per_position: float  # one layer's sliding-window KV entry
    sparse_topk: int  # 0: dense attention over the whole context
    compress_ratios: tuple[int, ...]  # per layer: 0 window only, r >= 1 compressed positions = context / r
    latent_bytes_per_position: float  # a compressed position's KV entry (what sparse attention gathers)
    index_sources: tuple[tuple[int, int], ...]  # (ratio, candidate cap or 0) per index-source layer
    index_heads: int
    index_head_dim: int
    index_key_bytes: float
    draft_layers: int
    draft_params: float  # MTP / DSpark draft layers: weights resident
    draft_active_params: float  # and multiplied through per drafted token
    draft_passes_per_step: int  # sequential draft forwards per step (MTP: k, block drafting: 1)
    speculative_tokens: int  # tokens drafted per step (0: no speculative decoding)
    acceptance_length: float  # mean tokens emitted per verify step (1.0 without speculation)
    layout: EngramConfig | None
    wkv_params: float
    table_sharded_across_tp: bool
    # (fraction of the table's pages cached, share of row reads served) measured on real text
    # (``cachelab.serving.page_popularity``); empty: none measured
    page_cache_curve: tuple[tuple[float, float], ...] = ()
    # 0: a causal kernel, each query attends to the positions up to its own (FlashAttention skips
    # the masked half). B: a masked kernel that computes every query against the whole gathered
    # context, in whole blocks of B positions (the live CPU engine's paged attention: scaled
    # dot-product attention with an explicit mask; benchmarks/live_operator_probe.py)
    masked_attention_block: int = 0
    # [memory]: a rank's resident weights as the published fit states them (sharded / TP + replicated;
    # 0: the spec's own count, weight_bytes / TP), and the indexer's logits buffer per batched token
    rank_weights_sharded_bytes: float = 0.0
    rank_weights_replicated_bytes: float = 0.0
    indexer_buffer_bytes_per_batched_token: float = 0.0
    # the sparse indexer runs whole on every TP rank (its projections replicated, every index head's
    # logits over every compressed position computed per rank) rather than split by heads
    index_replicated_across_tp: bool = False
    # the part of ``dense_params`` every TP rank holds and multiplies through whole (replicated
    # layers: it is not divided by TP); the rest is split over the ranks
    dense_replicated_params: float = 0.0
    # The first layer a prefill may run on each request's last ``sliding_window`` rows only (0: none):
    # the layers from here on own nothing but sliding-window KV, so only each prefill's trailing window
    # of them is ever read (decoder SWA bounded replay; the engine switch is ``Efficiency.decoder_replay``)
    decoder_replay_start: int = 0
    # the layer of each ``index_sources`` entry (tells the replayed index sources from the rest)
    index_source_layers: tuple[int, ...] = ()
    # routed experts in each draft layer and how many a drafted token picks (0: the draft has none,
    # or its experts are read whole); each is a backbone-sized expert (``expert_params`` at
    # ``expert_bytes_per_param``), and its bytes are part of ``draft_params``
    draft_experts: int = 0
    draft_experts_per_token: int = 0
    # the Engram wkv projection whole on every TP rank (it takes every head's rows, which the ranks
    # all-gather after their lookups) rather than split over the ranks
    wkv_replicated_across_tp: bool = False
    # The residual path's HBM traffic per token per layer (activations every TP rank holds whole: no
    # sequence parallelism in the arms modelled), and the weights it reads per layer per step
    residual_bytes_per_token_layer: float = 0.0
    residual_weight_bytes_per_layer: float = 0.0
    # what writing an Engram lookup into the residual streams moves per token per Engram layer
    injection_bytes_per_token_layer: float = 0.0
    # The record a prefill chunk's attention first gathers each KV position it may attend to into (0:
    # prefill reads the cache in place): vLLM's V4.1 prefill dequantizes into a BF16 workspace
    prefill_gather_bytes_per_position: float = 0.0

    def replay_lo(self, lo, hi):
        """Where each row's queries start in the replayed layers: its last ``sliding_window``
        rows (a decode or verify row, shorter than the window, keeps all of them)."""
        return np.maximum(np.asarray(lo, np.float64), np.asarray(hi, np.float64) - self.sliding_window)

    @property
    def replayed_layers(self) -> int:
        """Layers a bounded replay runs on the trailing window only (0 without one)."""
        return self.layers - self.decoder_replay_start if self.decoder_replay_start else 0

    @property
    def replayed_moe_layers(self) -> int:
        """The MoE layers among them (a DeepSeek model's dense layers come first)."""
        return min(self.moe_layers, self.replayed_layers)

    def check_tp(self, tp: int) -> None:
        """Refuse a TP degree vLLM refuses: the attention heads must split evenly over the ranks
        (``ModelConfig.verify_with_parallel_config``: "Total number of attention heads must be
        divisible by tensor parallel size")."""
        if tp < 1 or self.heads % tp:
            fits = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise CachelabError(f"--tp {tp}: {self.name}'s {self.heads} attention heads do not split evenly over "
                                f"{tp} ranks (vLLM refuses it); use one of {fits}")

    def rank_dense_params(self, tp: int) -> float:
        """Dense parameters (Engram wkv included) one of ``tp`` ranks holds and multiplies each
        token through: the replicated part whole, the rest split."""
        return (self.dense_params - self.dense_replicated_params) / tp + self.dense_replicated_params + self.rank_engram_params(tp)

    def rank_engram_params(self, tp: int) -> float:
        """Engram ``wkv`` parameters one of ``tp`` ranks holds and multiplies each token through."""
        return self.engram_params if self.wkv_replicated_across_tp else self.engram_params / tp

    @property
    def gathered_row_bytes(self) -> int:
        """Bytes of one row as the lookup hands it on: dequantized to BF16 (``row_dim`` values), the
        tensor the TP ranks all-gather (0 without Engram)."""
        return 2 * self.layout.row_dim if self.layout is not None else 0

    def rank_weight_bytes(self, tp: int) -> float:
        """Weights one of ``tp`` ranks holds in HBM (tables excluded): the spec's ``[memory]``
        fit where it has one (the non-expert weights replicated on every rank), else an even
        split of ``weight_bytes`` with the replicated dense layers whole."""
        if self.rank_weights_sharded_bytes:
            return self.rank_weights_sharded_bytes / tp + self.rank_weights_replicated_bytes
        replicated = self.dense_replicated_params + (self.engram_params if self.wkv_replicated_across_tp else 0.0)
        return self.weight_bytes / tp + replicated * self.dense_bytes_per_param * (1 - 1 / tp)

    def indexer_buffer_bytes(self, batched_tokens: int) -> float:
        """HBM per rank the sparse indexer reserves for a step of ``batched_tokens`` tokens."""
        return self.indexer_buffer_bytes_per_batched_token * batched_tokens

    def layers_launched(self, drafting: bool) -> int:
        """Layers a step runs: the backbone's, and the draft model's passes when it drafts."""
        return self.layers + (self.draft_passes_per_step * self.draft_layers
                              if drafting and self.speculative_tokens else 0)

    @property
    def engram_layers(self) -> tuple[int, ...]:
        return tuple(self.layout.layers) if self.layout is not None else ()

    @property
    def rows_per_token_layer(self) -> int:
        return self.layout.columns if self.layout is not None else 0

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes if self.layout is not None else 0

    @property
    def table_rows(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.layout.table_rows) if self.layout is not None else ()

    @property
    def lm_head_params(self) -> float:
        return float(self.vocab * self.hidden)

    @property
    def engram_params(self) -> float:
        return len(self.engram_layers) * self.wkv_params

    @property
    def weight_bytes(self) -> float:
        """Resident weights (tables excluded): experts at their precision, the rest at the dense
        one, embeddings and LM head included, draft layers included."""
        experts = self.moe_layers * self.experts * self.expert_params * self.expert_bytes_per_param
        dense = self.dense_params + 2 * self.lm_head_params + self.engram_params + self.draft_params
        return experts + dense * self.dense_bytes_per_param

    @property
    def active_expert_params(self) -> float:
        return self.moe_layers * self.experts_per_token * self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one decoded token multiplies through (top-k experts, LM head)."""
        return self.dense_params + self.active_expert_params + self.engram_params + self.lm_head_params

    @property
    def table_bytes(self) -> float:
        return float(sum(self.table_rows)) * self.row_bytes

    @property
    def attn_flops_per_position(self) -> float:
        """FLOPs one decoding query spends per attended position per layer (QK^T and PV, all heads)."""
        return 2.0 * self.heads * (self.qk_dim + self.v_dim)

    @property
    def prefill_attn_flops_per_position(self) -> float:
        """The same for a prefill query: MLA prefill expands the latent into per-head keys and
        values (vLLM and SGLang run it as plain multi-head attention), a narrower contraction."""
        if not self.prefill_qk_dim:
            return self.attn_flops_per_position
        return 2.0 * self.heads * (self.prefill_qk_dim + self.prefill_v_dim)

    def touched_expert_bytes(self, tokens, layers: int | None = None):
        """Expert weight bytes a step of ``tokens`` tokens reads: the experts at least one token
        routes to (expected count under uniform routing), in ``layers`` MoE layers (default: every
        one)."""
        touched = touched_experts(self.experts, self.experts_per_token, tokens)
        n = self.moe_layers if layers is None else layers
        return n * touched * self.expert_params * self.expert_bytes_per_param

    @property
    def draft_expert_bytes(self) -> float:
        """Bytes of the draft layers' routed experts (part of ``draft_params``)."""
        return self.draft_layers * self.draft_experts * self.expert_params * self.expert_bytes_per_param

    def draft_read_bytes(self, tokens):
        """Draft weight bytes one draft pass of ``tokens`` tokens reads: its dense weights whole, and
        of its routed experts only those the tokens route to, as a backbone MoE layer reads them
        (a grouped GEMM loads no expert without tokens)."""
        if not self.draft_experts:
            return self.draft_params
        touched = touched_experts(self.draft_experts, self.draft_experts_per_token, tokens)
        return self.draft_params - self.draft_expert_bytes + (
            self.draft_layers * touched * self.expert_params * self.expert_bytes_per_param)

    def attended_positions(self, lo, hi, late_lo=None):
        """Sum over the queries at contexts ``(lo, hi]`` of the positions each attends to, over
        all layers (vectorised over sequences); with ``late_lo``, the layers from
        ``decoder_replay_start`` on run only the queries at ``(late_lo, hi]`` (a bounded replay)."""
        if not self.compress_ratios:  # dense attention in every layer
            if self.masked_attention_block:
                b = self.masked_attention_block
                hi = np.asarray(hi, np.float64)
                return self.layers * (hi - np.asarray(lo, np.float64)) * np.ceil(hi / b) * b
            return self.layers * sum_min(lo, hi, 0)
        if late_lo is None or not self.decoder_replay_start:
            return self._attended(self.compress_ratios, lo, hi)
        r = self.decoder_replay_start
        return self._attended(self.compress_ratios[:r], lo, hi) + self._attended(self.compress_ratios[r:], late_lo, hi)

    def _attended(self, ratios, lo, hi):
        """``attended_positions`` over the layers with compress ``ratios``."""
        total = len(ratios) * sum_min(lo, hi, self.sliding_window)
        for ratio, count in _ratio_counts(ratios):
            total = total + count * sum_min(lo, hi, ratio * self.sparse_topk) / ratio
        return total

    def indexer_positions(self, lo, hi, late_lo=None):
        """Sum over the queries at contexts ``(lo, hi]`` of the compressed keys the indexer scores
        (every index-source layer; a capped source scores only the candidate pool); with
        ``late_lo``, the replayed sources score the queries at ``(late_lo, hi]`` only."""
        total = 0.0
        replayed = self._replayed_index_sources if late_lo is not None else ()
        terms = {}  # sources of one ratio, cap and query range score alike (V4.1: 8 sources, 3 terms)
        for i, (ratio, cap) in enumerate(self.index_sources):
            key = (i in replayed, ratio, cap)
            if key not in terms:
                terms[key] = sum_min(late_lo if key[0] else lo, hi, ratio * cap) / ratio
            total = total + terms[key]
        return total

    @property
    def _replayed_index_sources(self) -> tuple[int, ...]:
        r = self.decoder_replay_start
        return tuple(i for i, layer in enumerate(self.index_source_layers) if r and layer >= r)

    def kv_read_bytes(self, queries, context, late_queries=None, gathered=False):
        """KV bytes one sequence's step reads: the whole latent cache (dense), or the window,
        the sparse top-k gathers (at most the whole compressed cache) and the indexer keys; with
        ``late_queries``, the replayed layers gather for that many queries only. ``gathered``: a
        prefill chunk's attention reads its window region and top-k positions from the workspace
        ``prefill_gather_bytes`` filled, at ``prefill_gather_bytes_per_position`` each."""
        queries, context = np.asarray(queries, np.float64), np.asarray(context, np.float64)
        if not self.compress_ratios:
            return context * self.kv_bytes_per_token
        latent, window = self.latent_bytes_per_position, np.minimum(context, self.sliding_window) * self.window_bytes_per_position
        if gathered:
            latent = self.prefill_gather_bytes_per_position
            window = np.minimum(context, queries + self.sliding_window - 1) * latent
        window = len(self.compress_ratios) * window
        groups = [(self.compress_ratios, queries)]
        if late_queries is not None and self.decoder_replay_start:
            r = self.decoder_replay_start
            groups = [(self.compress_ratios[:r], queries), (self.compress_ratios[r:], np.asarray(late_queries, np.float64))]
        sparse = 0.0
        for ratios, q in groups:
            for ratio, count in _ratio_counts(ratios):
                sparse = sparse + count * np.minimum(q * self.sparse_topk, context / ratio) * latent
        keys = {s: np.minimum(context / s[0], s[1] if s[1] else np.inf) for s in set(self.index_sources)}
        index = sum(keys[s] for s in self.index_sources) * self.index_key_bytes  # a source's keys, in source order
        return window + sparse + index

    def prefill_gather_bytes(self, queries, context):
        """HBM bytes a prefill chunk of ``queries`` queries at ``context`` moves, per sequence, before its
        attention runs (0 where the spec has no workspace): for every layer its window region (the chunk
        and the ``sliding_window - 1`` positions before it) and for every compressing layer its whole
        compressed region, each position read from the cache and written to the workspace."""
        q, c = np.asarray(queries, np.float64), np.asarray(context, np.float64)
        if not self.prefill_gather_bytes_per_position or not self.compress_ratios:
            return np.zeros_like(c)
        positions = len(self.compress_ratios) * np.minimum(c, q + self.sliding_window - 1) * (
            self.window_bytes_per_position + self.prefill_gather_bytes_per_position)
        for ratio, count in _ratio_counts(self.compress_ratios):
            positions = positions + count * c / ratio * (self.latent_bytes_per_position + self.prefill_gather_bytes_per_position)
        return positions


_NUMBERS = {
    "backbone": ("layers", "hidden", "vocab", "dense_params", "moe_layers", "experts", "experts_per_token",
                 "expert_params", "expert_bytes_per_param", "dense_bytes_per_param"),
    "attention": ("heads", "qk_dim", "v_dim", "kv_bytes_per_token"),
}
_OPTIONAL = {  # zero (or empty) when a spec leaves them out
    "backbone": ("dense_replicated_params", "residual_bytes_per_token_layer", "residual_weight_bytes_per_layer"),
    "attention": ("prefill_qk_dim", "prefill_v_dim", "sliding_window", "window_bytes_per_position", "sparse_topk", "latent_bytes_per_position",
                  "index_heads", "index_head_dim", "index_key_bytes", "prefill_gather_bytes_per_position"),
    "mtp": ("draft_layers", "draft_params", "draft_active_params", "draft_passes_per_step", "speculative_tokens"),
    "engram": ("wkv_params", "injection_bytes_per_token_layer"),
    "memory": ("rank_weights_sharded_bytes", "rank_weights_replicated_bytes", "indexer_buffer_bytes_per_batched_token"),
}
_OTHER = {"backbone": ("expert_precision",), "attention": ("kv_replicated_across_tp", "compress_ratios", "index_sources",
                                                           "index_replicated_across_tp", "index_source_layers",
                                                           "decoder_replay_start"),
          "mtp": ("acceptance_length", "draft_experts", "draft_experts_per_token"), "engram": ("layout", "table_sharded_across_tp", "wkv_replicated_across_tp",
                                                            "page_cache_curve"),
          "memory": ()}
# [engram] keys an older spec restated; the layout derives them, so they may stay only if they agree.
_DERIVED = ("layers", "rows_per_token_layer", "row_bytes", "table_rows")


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODEL_DIR.glob("*.toml"))


def _number(path, section, key, value, allow_zero=False):
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf")
            or (value == 0 and not allow_zero)):  # TOML spells nan and inf
        raise CachelabError(f"{path}: [{section}] {key} must be a {'non-negative' if allow_zero else 'positive'} "
                            f"number, got {value!r}")
    return value


def _flag(path, section, block, key, default: bool) -> bool:
    value = block.get(key, default)
    if not isinstance(value, bool):  # bool("false") is True
        raise CachelabError(f"{path}: [{section}] {key} must be true or false, got {value!r}")
    return value


def _whole_numbers(path, section, key, value, pairs: bool = False) -> tuple:
    """``[section] key``: a list of whole numbers >= 0, or of [a, b] pairs of them."""
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(value, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(map(whole, x)) if pairs else whole(x) for x in value):
        shape = "[a, b] pairs of whole numbers >= 0" if pairs else "whole numbers >= 0"
        raise CachelabError(f"{path}: [{section}] {key} must be a list of {shape}, got {value!r}")
    return tuple(tuple(x) for x in value) if pairs else tuple(value)


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
    values: dict = {"name": data.get("name", path.stem)}
    for section in ("backbone", "attention", "mtp", "engram", "memory"):
        block = data.get(section, {})
        if section in _NUMBERS and not isinstance(data.get(section), dict):
            raise CachelabError(f"{path}: missing section [{section}]")
        allowed = _NUMBERS.get(section, ()) + _OPTIONAL.get(section, ()) + _OTHER[section]
        extra = _DERIVED if section == "engram" else ()
        unknown = sorted(set(block) - set(allowed) - set(extra))
        if unknown:
            raise CachelabError(f"{path}: unknown key(s) {unknown} in [{section}]; allowed: {list(allowed)}")
        for key in _NUMBERS.get(section, ()):
            if key not in block:
                raise CachelabError(f"{path}: [{section}] is missing {key!r}")
            values[key] = _number(path, section, key, block[key])
        for key in _OPTIONAL.get(section, ()):
            values[key] = _number(path, section, key, block.get(key, 0), allow_zero=True)
    backbone, attention, mtp, engram = (data.get(s, {}) for s in ("backbone", "attention", "mtp", "engram"))
    if values["dense_replicated_params"] > values["dense_params"]:
        raise CachelabError(f"{path}: [backbone] dense_replicated_params {values['dense_replicated_params']} exceeds "
                            f"dense_params {values['dense_params']}")
    values["expert_precision"] = backbone.get("expert_precision", "fp8")
    if values["expert_precision"] not in ("fp4", "fp8"):
        raise CachelabError(f"{path}: [backbone] expert_precision must be 'fp4' or 'fp8', got {values['expert_precision']!r}")
    values["kv_replicated_across_tp"] = _flag(path, "attention", attention, "kv_replicated_across_tp", True)
    values["index_replicated_across_tp"] = _flag(path, "attention", attention, "index_replicated_across_tp", False)
    values["compress_ratios"] = _whole_numbers(path, "attention", "compress_ratios", attention.get("compress_ratios", []))
    if values["compress_ratios"] and len(values["compress_ratios"]) != values["layers"]:
        raise CachelabError(f"{path}: [attention] compress_ratios has {len(values['compress_ratios'])} entries, "
                            f"the model {values['layers']} layers")
    if values["compress_ratios"] and not values["sparse_topk"]:
        raise CachelabError(f"{path}: [attention] compress_ratios needs sparse_topk > 0")
    values["index_sources"] = _whole_numbers(path, "attention", "index_sources", attention.get("index_sources", []),
                                             pairs=True)
    if any(r < 1 for r, _ in values["index_sources"]):
        raise CachelabError(f"{path}: [attention] index_sources ratios must be >= 1")
    values["index_source_layers"], values["decoder_replay_start"] = _replay(path, attention, values)
    values["acceptance_length"] = float(_number(path, "mtp", "acceptance_length", mtp.get("acceptance_length", 1.0)))
    if not 1.0 <= values["acceptance_length"] <= values["speculative_tokens"] + 1:
        raise CachelabError(f"{path}: [mtp] acceptance_length {values['acceptance_length']} must be in "
                            f"[1, speculative_tokens + 1 = {values['speculative_tokens'] + 1}]")
    if values["speculative_tokens"] and not values["draft_passes_per_step"]:
        raise CachelabError(f"{path}: [mtp] speculative_tokens {values['speculative_tokens']} needs "
                            "draft_passes_per_step >= 1 (the sequential draft forwards of a step)")
    values["draft_experts"], values["draft_experts_per_token"] = _draft_experts(path, mtp, values)
    values["table_sharded_across_tp"] = _flag(path, "engram", engram, "table_sharded_across_tp", True)
    values["wkv_replicated_across_tp"] = _flag(path, "engram", engram, "wkv_replicated_across_tp", False)
    values["page_cache_curve"] = _curve(path, engram.get("page_cache_curve", ()))
    values["layout"] = _layout(path, engram, layout) if engram or layout is not None else None
    late = [layer for layer in (values["layout"].layers if values["layout"] is not None else ())
            if values["decoder_replay_start"] and layer >= values["decoder_replay_start"]]
    if late:
        raise CachelabError(f"{path}: [attention] decoder_replay_start {values['decoder_replay_start']} comes before "
                            f"Engram layer(s) {late}: a replay runs only the layers after every Engram layer")
    return ModelSpec(**values)


def _draft_experts(path: Path, mtp: dict, values: dict) -> tuple[int, int]:
    """``[mtp] draft_experts`` and ``draft_experts_per_token``: whole numbers, both or neither, at
    most as many picked as there are, in draft layers whose ``draft_params`` hold their bytes."""
    counts = []
    for key in ("draft_experts", "draft_experts_per_token"):
        v = mtp.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CachelabError(f"{path}: [mtp] {key} must be a whole number >= 0, got {v!r}")
        counts.append(v)
    experts, per_token = counts
    if bool(experts) != bool(per_token) or per_token > experts:
        raise CachelabError(f"{path}: [mtp] draft_experts_per_token {per_token} must be in 1..draft_experts "
                            f"({experts}), or both 0")
    nbytes = values["draft_layers"] * experts * values["expert_params"] * values["expert_bytes_per_param"]
    if experts and not (values["draft_layers"] and nbytes <= values["draft_params"]):
        raise CachelabError(f"{path}: [mtp] draft_experts {experts} in {values['draft_layers']} draft layers take "
                            f"{nbytes:.4g} B, more than draft_params {values['draft_params']:.4g}, which holds them")
    return experts, per_token


def _replay(path: Path, attention: dict, values: dict) -> tuple[tuple[int, ...], int]:
    """``[attention] index_source_layers`` and ``decoder_replay_start``, checked against the spec:
    a replay needs a sliding window, starts inside the model and knows which index sources it
    replays."""
    layers = attention.get("index_source_layers", [])
    if not isinstance(layers, list) or not all(isinstance(x, int) and 0 <= x < values["layers"] for x in layers):
        raise CachelabError(f"{path}: [attention] index_source_layers must be a list of layer indices in "
                            f"0..{values['layers'] - 1}, got {layers!r}")
    if layers and len(layers) != len(values["index_sources"]):
        raise CachelabError(f"{path}: [attention] index_source_layers has {len(layers)} entries, index_sources "
                            f"{len(values['index_sources'])}")
    start = attention.get("decoder_replay_start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < values["layers"]:
        raise CachelabError(f"{path}: [attention] decoder_replay_start must be a layer index in "
                            f"0..{values['layers'] - 1} (0: no replay), got {start!r}")
    if start and not values["sliding_window"]:
        raise CachelabError(f"{path}: [attention] decoder_replay_start {start} needs a sliding_window")
    if start and values["index_sources"] and not layers:
        raise CachelabError(f"{path}: [attention] decoder_replay_start {start} needs index_source_layers")
    return tuple(layers), start


def _curve(path: Path, points) -> tuple[tuple[float, float], ...]:
    """``[engram] page_cache_curve``: [fraction, hit] pairs, both rising, inside (0, 1]."""
    try:
        curve = tuple((float(f), float(h)) for f, h in points)
    except (TypeError, ValueError):
        raise CachelabError(f"{path}: [engram] page_cache_curve must be a list of [fraction, hit] pairs") from None
    for (f0, h0), (f1, h1) in zip(((0.0, 0.0),) + curve, curve):
        if not (f0 < f1 <= 1.0 and h0 <= h1 <= 1.0):
            raise CachelabError(f"{path}: [engram] page_cache_curve point [{f1}, {h1}] does not rise from "
                                f"[{f0}, {h0}] inside (0, 1]")
    return curve


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
