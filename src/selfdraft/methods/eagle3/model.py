"""EAGLE-3's module: a one-layer autoregressive head on fused target features (docs/methods/eagle3.md).

Slot t (a committed position) feeds the head g_t = fc([h_low; h_mid; h_high]_t) (3H -> H, no bias)
and the embedding of the next token x_{t+1}; the head's output predicts x_{t+2}. The decoder layer's
attention reads the 2H concatenation [RMSNorm(emb); RMSNorm(g)], its residual is g; a final norm
and the head's own LM head over a reduced draft vocabulary give draft logits (speculators
convention: target_id = draft_id + d2t[draft_id], t2d marks the draft tokens in the target vocab).

Drafting: the head's (pre-norm) output replaces g for the next step while the input token is the
previous draft; step j sits at position t + j and attends to the committed context plus its own
earlier steps. Training-time test (TTT) unrolls γ such steps on ground-truth tokens with the mask
of training.masks.ttt_attention_mask, so training sees exactly what inference does; loss Σ_j 0.8^j L_j,
L_j = soft cross-entropy against the target distribution restricted to the draft vocabulary.
Inference: a chain of γ drafts, or an EAGLE-2 dynamic tree (`build_tree`).
"""

from __future__ import annotations

import torch
from torch import nn

from selfdraft.config import ConfigError
from selfdraft.drafters.layers import KV, MLP, InjectedAttention, LayerShape, RMSNorm, Rotary
from selfdraft.methods.eagle3.config import Eagle3Config
from selfdraft.target import Target


class WideAttention(InjectedAttention):
    """GQA attention whose q/k/v projections read the 2H input [RMSNorm(emb); RMSNorm(g)]."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__(s)
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: attention over [RMSNorm(emb); RMSNorm(g)], residual g, SwiGLU MLP."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)  # on the token embedding
        self.hidden_norm = RMSNorm(s.hidden, s.eps)  # on g (fused feature or the head's own output)
        self.self_attn = WideAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)

    def forward(
        self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, KV]:
        """emb, g: [B, Q, H], positions: [B, Q], ctx: K/V [B, n_kv, Tc, d], mask: [B, Q, Tc+Q] bool
        -> (h [B, Q, H] the pre-norm output, the K/V [B, n_kv, Q, d] of these Q positions)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g.to(emb.dtype))], dim=-1)  # [B, Q, 2H]
        h = g + self.self_attn(x, positions, ctx, mask, rotary)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, self.self_attn.kv(x, positions, rotary)


class Eagle3Model(nn.Module):
    """Trainable EAGLE-3 weights; d2t / t2d are buffers, so the draft vocabulary travels in the checkpoint."""

    def __init__(self, cfg: Eagle3Config, shape: LayerShape, vocab_size: int) -> None:
        super().__init__()
        H, n = shape.hidden, cfg.draft_vocab_size
        self.shape = shape
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.layer = Eagle3Layer(shape)
        self.norm = RMSNorm(H, shape.eps)
        self.lm_head = nn.Linear(H, n, bias=False)
        self.rotary = Rotary(shape.head_dim, shape.rope_theta)
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))  # [n] placeholder: target ids 0..n-1
        self.register_buffer("t2d", torch.arange(vocab_size) < n)  # [V]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def target_ids(self) -> torch.Tensor:
        """[n] target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor, target: Target) -> None:
        """Install a draft vocabulary (vocab.DraftVocab) and start the head from the target's
        LM-head rows of those tokens (copied, never shared)."""
        if d2t.numel() != self.d2t.numel() or t2d.numel() != self.t2d.numel():
            raise ConfigError(f"draft vocab of size {d2t.numel()}/{t2d.numel()} does not fit {self.d2t.numel()}/{self.t2d.numel()}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        w = target.model.get_output_embeddings().weight
        self.lm_head.weight.copy_(w[self.target_ids.to(w.device)].to(self.lm_head.weight))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n_feat, H] target feature-layer outputs -> g [..., H]."""
        return self.fc(features.to(self.dtype).flatten(-2))

    def step(self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor):
        """One head step over Q slots (Eagle3Layer.forward) -> (h [B, Q, H], K/V of the Q slots)."""
        return self.layer(emb.to(self.dtype), g, positions, ctx, mask, self.rotary)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., n] float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(h)).float()

    def empty_kv(self, batch: int, device) -> KV:
        z = torch.zeros(batch, self.shape.kv_heads, 0, self.shape.head_dim, device=device, dtype=self.dtype)
        return KV(z, z)


def build_eagle3(cfg: Eagle3Config, target: Target) -> Eagle3Model:
    """A fresh module; an unset or too large draft vocabulary becomes the full one (d2t = 0, t2d all True)."""
    if not 0 < cfg.draft_vocab_size < target.vocab_size:
        cfg.draft_vocab_size = target.vocab_size
    model = Eagle3Model(cfg, LayerShape.from_hf(target.model.config, cfg.qk_norm), target.vocab_size)
    model.set_vocab(model.d2t, model.t2d, target)
    return model
