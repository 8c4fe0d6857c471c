"""The live model: a decoder-only torch transformer with DeepSeek-V4.1 Engram modules.

The residual is ``hc_mult`` streams (V4.1's hyper-connections, static here: fixed weights
collapse the streams before attention and the MLP, and spread the output back). A decoder
layer that holds an Engram module first adds ``alpha[m] * value`` to every stream ``m``
(ENGRAM.md section 4.2): the token's 24 rows of 256 values are concatenated, one fused
bias-free ``wkv`` projection gives a key per stream and one shared value, and the gate is
``sigmoid(signed_sqrt(<h*q_w*k_w, key> * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(d)))``.
No short convolution (V4.1 dropped it).

Attention reads and writes a paged KV cache (``cachelab.live.kv_cache``): every layer first
writes the step's new keys and values into their slots, then attends over the blocks of each
sequence, so prefix-cached blocks are read, never recomputed. The step's ``StepBatch.clock``
times the paged attention and the weight GEMMs (``OpClock``) for the per-step log. Weights are seeded dummies by
default (vLLM's ``--load-format dummy``) or a safetensors file with the same tensor names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cachelab.errors import CachelabError
from cachelab.live.config import ModelConfig
from cachelab.live.kv_cache import NO_CLOCK, PagedKVCache, StepBatch

GATE_CLAMP = 1e-6  # the signed square root's floor on |s| (V4.1: s = 0 gives +sqrt(1e-6))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Engram(nn.Module):
    """V4.1's module after lookup: rows -> one key per stream and a shared value, gated per stream."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.streams, self.dim, self.eps = cfg.hc_mult, cfg.hidden, cfg.rms_norm_eps
        self.wkv = nn.Linear(cfg.engram_in, cfg.hidden * (cfg.hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden))

    def gate(self, h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """alpha [T, streams] from the streams ``h`` and keys ``key`` (both [T, streams, d])."""
        dot = (h * (self.q_weight * self.k_weight) * key).sum(-1)
        s = dot * torch.rsqrt(h.pow(2).mean(-1) + self.eps) * torch.rsqrt(key.pow(2).mean(-1) + self.eps)
        s = s / math.sqrt(self.dim)
        s = torch.where(s >= 0, 1.0, -1.0) * s.abs().clamp_min(GATE_CLAMP).sqrt()
        return torch.sigmoid(s)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, clock=NO_CLOCK) -> torch.Tensor:
        """``h`` [T, streams, d] plus the gated value; ``rows`` [T, 24, 256] (dequantized)."""
        flat = rows.reshape(rows.shape[0], -1).to(h.dtype)
        t = clock.now()
        kv = self.wkv(flat)
        clock.gemm(t)
        kv = kv.view(-1, self.streams + 1, self.dim)
        key, value = kv[:, : self.streams], kv[:, self.streams]
        return h + self.gate(h.float(), key.float()).to(h.dtype).unsqueeze(-1) * value.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index, self.heads, self.kv_heads, self.head_dim = index, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache, rope) -> torch.Tensor:
        hd, nh, nk, clock = self.head_dim, self.heads, self.kv_heads, batch.clock
        t = clock.now()
        qkv = self.qkv(x)
        clock.gemm(t)
        q, k, v = qkv.split([nh * hd, nk * hd, nk * hd], dim=-1)
        q = _rotate(q.view(-1, nh, hd), rope)
        k = _rotate(k.view(-1, nk, hd), rope)
        t = clock.now()
        kv.write(self.index, batch.slots, k, v.view(-1, nk, hd))
        out = torch.empty_like(q)
        if batch.decode_idx.numel():
            keys, values, mask = kv.gather(self.index, batch.decode_tables, batch.decode_lens)
            o = F.scaled_dot_product_attention(q[batch.decode_idx].unsqueeze(2), keys, values, attn_mask=mask,
                                               enable_gqa=True)
            out[batch.decode_idx] = o.squeeze(2)
        for a, b, table, positions in batch.prefills:
            keys, values, _ = kv.gather(self.index, table.unsqueeze(0), positions[-1:] + 1)
            mask = torch.arange(keys.shape[2], device=x.device)[None, :] <= positions[:, None]
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                               enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
        t = clock.attention(t)
        out = self.out(out.reshape(-1, nh * hd))
        clock.gemm(t)
        return out


def _rotate(x: torch.Tensor, rope) -> torch.Tensor:
    """RoPE, rotate-half form; ``rope`` is (cos, sin) [T, head_dim / 2] at the tokens' positions."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, clock=NO_CLOCK) -> torch.Tensor:
        t = clock.now()
        g, u = self.gate_up(x).chunk(2, dim=-1)
        clock.gemm(t)
        act = F.silu(g) * u
        t = clock.now()
        out = self.down(act)
        clock.gemm(t)
        return out


class DecoderLayer(nn.Module):
    """Engram (if any) on the streams, then attention and the MLP, each collapsed from and
    spread back to the streams by static hyper-connection weights."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.engram = Engram(cfg) if index in cfg.engram_layers else None
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_norm_eps)
        self.attn = Attention(cfg, index)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.hc_pre = nn.Parameter(torch.full((2, cfg.hc_mult), 1.0 / cfg.hc_mult))
        self.hc_post = nn.Parameter(torch.ones(2, cfg.hc_mult))

    def forward(self, h, batch, kv, rope, rows=None):
        if self.engram is not None:
            h = self.engram(h, rows, batch.clock)
        x = torch.einsum("tmd,m->td", h, self.hc_pre[0])
        h = h + self.hc_post[0][None, :, None] * self.attn(self.attn_norm(x), batch, kv, rope).unsqueeze(1)
        x = torch.einsum("tmd,m->td", h, self.hc_pre[1])
        return h + self.hc_post[1][None, :, None] * self.mlp(self.mlp_norm(x), batch.clock).unsqueeze(1)


class EngramLM(nn.Module):
    """The whole model; ``forward`` runs one scheduler step over the paged KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_model_len, dtype=torch.float64), inv)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

    def forward(self, batch: StepBatch, kv: PagedKVCache, engram_rows: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Logits [len(batch.sample_idx), vocab] of the step's sampled positions.

        ``engram_rows()`` is called once, at the first Engram layer, and returns the step's
        rows [T, table layers, 24, 256]; the layers before it compute while a prefetch runs.
        """
        rope = (self.rope_cos[batch.positions], self.rope_sin[batch.positions])
        h = self.embed(batch.input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1)
        rows, table = None, {layer: j for j, layer in enumerate(self.config.engram_layers)}
        for i, layer in enumerate(self.layers):
            if i in table and rows is None:
                rows = engram_rows()
            h = layer(h, batch, kv, rope, rows[:, table[i]] if i in table else None)
        x = self.norm(h[batch.sample_idx].mean(1))
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        t = batch.clock.now()
        logits = F.linear(x, weight)
        batch.clock.gemm(t)
        return logits.float()


def dummy_weights(model: EngramLM, seed: int) -> EngramLM:
    """Seeded random weights (vLLM's ``--load-format dummy`` for systems work): linear layers
    at 1/sqrt(fan_in), embeddings at 1, hyper-connection weights near their identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "q_weight", "k_weight")):
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "hc_" in name:
                p.copy_(p.float() * (1.0 + 0.1 * noise))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(noise / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise)
    return model


def build_model(cfg: ModelConfig, weights: Path | None = None, seed: int = 0, device: str = "cpu") -> EngramLM:
    """The model in eval mode on ``device``: dummy weights from ``seed``, or ``weights``."""
    model = EngramLM(cfg)
    if weights is None:
        dummy_weights(model, seed)
    else:
        load_weights(model, weights)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype)).eval()


def save_weights(model: EngramLM, path: Path) -> None:
    """The model's tensors as ``load_weights`` reads them, with the umask's mode as every model file."""
    from cachelab.learning.predictor import write_tensors

    write_tensors(path, model.state_dict())


def load_weights(model: EngramLM, path: Path) -> None:
    """Load a safetensors file whose tensors match the model's names and shapes exactly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise CachelabError(f"weights file not found: {path}")
    try:
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise CachelabError(f"{path}: not a safetensors file: {exc}") from None
    expected = model.state_dict()
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise CachelabError(f"{path}: tensors missing {missing[:5]}, unknown {unknown[:5]} for this model config")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise CachelabError(f"{path}: tensor {name} has shape {list(t.shape)}, "
                                f"the model expects {list(expected[name].shape)}")
    model.load_state_dict(tensors)
