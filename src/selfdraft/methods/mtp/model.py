"""MTP's module: DeepSeek-V3 multi-token prediction modules on the frozen target (docs/methods/mtp.md).

Depth d (d = 1..K) at slot t (DeepSeek-V3 report, eqs. 21-23):
    h'^d_t = W_proj [RMSNorm(Emb(x_{t+d})) ; RMSNorm(h^{d-1}_t)]      (2H -> H, no bias, embedding first)
    h^d_t  = TRM_d(h'^d_{0..t})                                       (one causal transformer block)
    P^d_t  = softmax(LMHead(RMSNorm_d(h^d_t)))                         predicts x_{t+d+1}
h^0 is the target's final hidden state, taken post-norm (TargetStep.last_hidden; it is what HF
returns and what vLLM feeds native MTP layers; hnorm re-normalises it anyway). Embedding and LM
head are the target's own, frozen. Module d = modules[min(d, D) - 1]: D stacked modules, and with
cfg.mtp_recursive the last one is reused for depths D+1..γ. Loss Σ_d 0.6^(d-1) CE_d / Σ_d 0.6^(d-1).
Each depth attends causally to its own depth's states, in training as at inference (MTPDrafter).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from selfdraft.config import DEFAULT_GAMMA, ConfigError
from selfdraft.drafters.layers import KV, InjectedDecoderLayer, LayerShape, RMSNorm, Rotary
from selfdraft.methods.mtp.config import MTPConfig
from selfdraft.target import Target, lm_logits


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module (parameter names follow the native checkpoints, see load_native_mtp)."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.enorm = RMSNorm(s.hidden, s.eps)
        self.hnorm = RMSNorm(s.hidden, s.eps)
        self.eh_proj = nn.Linear(2 * s.hidden, s.hidden, bias=False)
        self.block = InjectedDecoderLayer(s)  # a pre-norm Llama block; ctx = this depth's cached K/V
        self.norm = RMSNorm(s.hidden, s.eps)  # shared_head.norm

    def forward(
        self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, KV]:
        """emb, h: [B, Q, H], positions: [B, Q], ctx: K/V [B, n_kv, Tc, d], mask: [B, Q, Tc+Q] bool
        -> (h^d [B, Q, H] before the final norm, the K/V of the Q positions for the cache)."""
        x = self.eh_proj(torch.cat([self.enorm(emb.to(h.dtype)), self.hnorm(h)], dim=-1))
        kv = self.block.self_attn.kv(self.block.input_layernorm(x), positions, rotary)
        return self.block(x, positions, ctx, mask, rotary), kv


class MTPModel(nn.Module):
    def __init__(self, cfg: MTPConfig, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(MTPModule(shape) for _ in range(cfg.mtp_modules))
        self.depths = max(cfg.gamma, cfg.mtp_modules) if cfg.mtp_recursive else cfg.mtp_modules
        self.normed_handoff = cfg.mtp_normed_handoff
        self.rotary = Rotary(shape.head_dim, shape.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].eh_proj.weight.dtype

    def module(self, d: int) -> MTPModule:
        """The module of depth d (1-based); past D the last one is reused (recursive MTP)."""
        return self.layers[min(d, len(self.layers)) - 1]

    def handoff(self, d: int, h: torch.Tensor) -> torch.Tensor:
        """What depth d + 1 reads of h^d [..., H]: h^d itself, or its final-normed form (cfg.mtp_normed_handoff)."""
        return self.module(d).norm(h) if self.normed_handoff and d > 0 else h

    def logits(self, target: Target, d: int, h: torch.Tensor) -> torch.Tensor:
        """h^d [..., H] -> [..., V] float32 through module d's final norm and the shared LM head."""
        return lm_logits(target, self.module(d).norm(h))

    def empty_kv(self, batch: int, device) -> KV:
        z = torch.zeros(batch, self.shape.kv_heads, 0, self.shape.head_dim, device=device, dtype=self.dtype)
        return KV(z, z)


def build_mtp(cfg: MTPConfig, target: Target) -> MTPModel:
    return MTPModel(cfg, LayerShape.from_hf(target.model.config, cfg.qk_norm))


# --------------------------------------------------------------------------- native weights
NATIVE_SUFFIXES = {  # DeepSeek-V3 layer-(L+d-1) names -> MTPModule names
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
    "input_layernorm.weight": "block.input_layernorm.weight",
    "post_attention_layernorm.weight": "block.post_attention_layernorm.weight",
    **{f"self_attn.{p}_proj.weight": f"block.self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": f"block.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
SHARED_SUFFIXES = ("embed_tokens.weight", "shared_head.head.weight")  # the target's own, not loaded


def load_native_mtp(path: str | Path, target: Target, gamma: int = DEFAULT_GAMMA) -> tuple[MTPModel, MTPConfig]:
    """Map native MTP weights shipped with a target checkpoint onto MTPModel.

    DeepSeek-V3 convention: the MTP module of depth d is stored as decoder layer L + d - 1 of the
    checkpoint (`model.layers.61.*` for the 61-layer V3) with enorm / hnorm / eh_proj /
    shared_head.norm and one transformer block. The block must be Llama-shaped (q/k/v/o + SwiGLU);
    MLA or MoE blocks raise, naming the tensors that have no counterpart. path: a .safetensors file
    or a directory of them. Returns the module (recursive, float32) and its MTPConfig.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no .safetensors files with native MTP weights")
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    found: dict[int, dict[str, torch.Tensor]] = {}
    unknown = []
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for key in sf.keys():
                m = pattern.match(key)
                if not m or int(m.group(1)) < target.num_layers:
                    continue  # the target's own layers
                depth, suffix = int(m.group(1)) - target.num_layers + 1, m.group(2)
                if suffix in NATIVE_SUFFIXES:
                    found.setdefault(depth, {})[NATIVE_SUFFIXES[suffix]] = sf.get_tensor(key)
                elif suffix not in SHARED_SUFFIXES:
                    unknown.append(key)
    if not found:
        raise ConfigError(f"{path} has no MTP layers (model.layers.{target.num_layers}.* and up)")
    if unknown:
        raise ConfigError(f"native MTP block is not Llama-shaped (MLA / MoE?): no counterpart for {unknown[:8]}")
    D = max(found)
    cfg = MTPConfig(gamma=gamma, feature_layers=(), mtp_modules=D, mtp_recursive=True)
    model = build_mtp(cfg, target).float()
    state = {f"layers.{d - 1}.{name}": t for d, tensors in found.items() for name, t in tensors.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"native MTP weights do not fit this target's shapes: {e}") from e
    return model, cfg
