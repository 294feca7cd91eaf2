"""The native stack's elementwise pieces, shared by the eager forward (model.py) and the compiled
step (compiled.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, same operation order (float32 statistics, weight applied in the input dtype).
    float32 takes PyTorch's one-call rms_norm (the same bits, measured; a third fewer op calls)."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, T] -> cos, signed sin [B, T, 1, d] for `rotate_heads` (HF's rope tables, scaled;
    the sin's first half negated, which folds rotate-half's sign into the table)."""
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * scaling
    sin = emb.sin() * scaling
    sin[..., : freqs.shape[-1]].neg_()
    return cos.to(dtype)[:, :, None], sin.to(dtype)[:, :, None]


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of every head at once. x: [B, T, n, d] (q and k heads side by side);
    cos, signed_sin: [B, T, 1, d] from rope_tables. x * cos + cat(x2, x1) * signed_sin is HF's
    x * cos + cat(-x2, x1) * sin bit for bit (a sign moved between two factors; no fused
    multiply-add, which would move the last bits)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def split_heads(y: torch.Tensor, nh: int, nkv: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                eps: float, cos: torch.Tensor, signed_sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV projection's output y [B, T, nh + 2 nkv, d] -> q [B, T, nh, d] and k [B, T, nkv, d]
    rotated (after Qwen3's per-head norms, when the model has them), v [B, T, nkv, d]."""
    if q_norm is not None:
        qk = torch.cat((rms_norm(y[:, :, :nh], q_norm, eps), rms_norm(y[:, :, nh : nh + nkv], k_norm, eps)), 2)
    else:
        qk = y[:, :, : nh + nkv]
    qk = rotate_heads(qk, cos, signed_sin)  # q and k heads in one call
    return qk[:, :, :nh], qk[:, :, nh:], y[:, :, nh + nkv :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
              expand_kv: bool | None = None) -> torch.Tensor:
    """SDPA over q [B, nh, T, d] and k, v [B, nkv, S, d] (nkv divides nh), mask None or [B or 1, 1, T, S].

    On CUDA a masked GQA call would take the math kernel (the flash kernel takes no mask, the
    memory-efficient one no enable_gqa), which writes the whole [B, nh, T, S] score tensor: there the
    kv heads are repeated first, so the memory-efficient kernel runs. Elsewhere SDPA groups the heads
    itself (CPU: its own flash kernel, mask or not). expand_kv overrides the choice (tests)."""
    gqa = k.shape[1] != q.shape[1]
    if expand_kv is None:
        expand_kv = gqa and mask is not None and q.device.type == "cuda"
    if gqa and expand_kv:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
