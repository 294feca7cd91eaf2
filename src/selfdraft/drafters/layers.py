"""Shared blocks for the parallel drafters: RMSNorm, rotary embedding, and a Llama-style decoder
layer with KV injection (docs/methods/dflash.md#kv-injection).

KV injection: queries come only from the draft block X; keys/values are the concatenation of the
fused target context C and the block, [W_K C ; W_K X] and [W_V C ; W_V X]. The context half does
not depend on the block, so it is computed once per sequence (training) or appended incrementally
(inference) and passed in as a `KV` pair.

Shapes: B batch, Tc context positions, Q block (query) positions, H hidden, n_h / n_kv heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfdraft.native.ops import attention, rms_norm


@dataclass(frozen=True)
class LayerShape:
    """The target's width, read from its HF config, so draft layers are as wide as the target."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3 style; DrafterConfig.qk_norm)

    @classmethod
    def from_hf(cls, cfg, qk_norm: bool = False) -> "LayerShape":
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        heads = cfg.num_attention_heads
        return cls(
            hidden=cfg.hidden_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate=cfg.intermediate_size,
            eps=getattr(cfg, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            qk_norm=qk_norm,
        )


@dataclass
class KV:
    """Rotated keys and values of one layer: k, v [B, n_kv, S, d]."""

    k: torch.Tensor
    v: torch.Tensor

    def append(self, other: "KV") -> "KV":
        return KV(torch.cat([self.k, other.k], dim=2), torch.cat([self.v, other.v], dim=2))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # float32 statistics; one call in float32


class Rotary(nn.Module):
    """Llama rotary embedding (rotate-half convention) at explicit absolute positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, n, S, d], positions: [B, S] int -> x rotated, same shape and dtype: rotate-half,
        x·cos + [−x2, x1]·sin over the half-width tables (the same bits, fewer ops: a draft round is
        dozens of small ops)."""
        freqs = positions[:, None, :, None].float() * self.inv_freq  # [B, 1, S, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class InjectedAttention(nn.Module):
    """Multi-head (GQA) attention: queries from the block, keys/values from [context ; block]."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        if s.qk_norm:  # Qwen3 layout, as vLLM's DFlash / DSpark / MTP draft layers have it
            self.q_norm = RMSNorm(s.head_dim, s.eps)
            self.k_norm = RMSNorm(s.head_dim, s.eps)

    def _qk_norm(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """[B, n, S, d] -> the same, normalised per head when the layer has q/k norms."""
        return getattr(self, which)(x) if self.s.qk_norm else x

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.s.head_dim).transpose(1, 2)  # [B, S, n·d] -> [B, n, S, d]

    def kv(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> KV:
        """x: [B, S, H] (context C or block), positions: [B, S] -> this layer's rotated K, V."""
        k = rotary(self._qk_norm(self._heads(self.k_proj(x), self.s.kv_heads), "k_norm"), positions)
        return KV(k, self._heads(self.v_proj(x), self.s.kv_heads))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """x: [B, Q, H] block, positions: [B, Q], ctx: K/V [B, n_kv, Tc, d], mask: [B, Q, Tc+Q] bool."""
        q = rotary(self._qk_norm(self._heads(self.q_proj(x), self.s.heads), "q_norm"), positions)  # [B, n_h, Q, d]
        kv = ctx.append(self.kv(x, positions, rotary))  # [B, n_kv, Tc+Q, d]
        out = attention(q, kv.k.to(q.dtype), kv.v.to(q.dtype), mask[:, None])  # [B, n_h, Q, d] (GQA, masked)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class MLP(nn.Module):
    """SwiGLU feed-forward, as in Llama."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class InjectedDecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer whose attention also sees the injected context K/V.

    The context C is normalised once by the drafter (C = RMSNorm(fc(features))); this layer's
    input norm applies to the block only, as in the public DFlash implementation.
    """

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = InjectedAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> KV:
        """c: [B, Tc, H] fused context, positions: [B, Tc] -> K/V [B, n_kv, Tc, d] of this layer."""
        return self.self_attn.kv(c, positions, rotary)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """x: [B, Q, H] -> [B, Q, H]."""
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx, mask, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))
