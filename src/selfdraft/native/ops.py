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
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[2] <= GROUPED_MAX_ROWS:
        return grouped_attention(q, k, v, mask, scale)
    gqa = k.shape[1] != q.shape[1]
    if expand_kv is None:
        expand_kv = gqa and mask is not None and q.device.type == "cuda"
    if gqa and expand_kv:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# CPU SDPA in bfloat16 ran a decode step's attention (q rows = 1) ~5x slower than these two bf16
# matmuls with a float32 softmax (B 16, S 600, 1 thread, AMD EPYC Zen 4: 9.7 vs 2.0 ms; float32 SDPA
# 1.3 ms); it stays the faster kernel for long blocks (prefill), where this path would write the scores.
GROUPED_MAX_ROWS = 16


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None) -> torch.Tensor:
    """SDPA's result for few query rows: q [B, nh, T, d], k, v [B, nkv, S, d], mask None or [B or 1, 1, T, S]
    (bool = visible, or additive). The rep = nh / nkv query heads sharing a kv head attend as one
    [rep·T]-row block (no repeated K/V); the softmax runs in float32."""
    B, nh, T, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    rep = nh // nkv
    scores = (q.reshape(B, nkv, rep * T, d) @ k.transpose(-1, -2)).float() * (scale or d ** -0.5)
    scores = scores.view(B, nkv, rep, T, S)  # the mask [B or 1, 1, T, S] broadcasts over (nkv, rep) as [.., 1, 1, T, S]
    if mask is not None:
        m = mask[:, :, None]
        scores = scores.masked_fill(~m, torch.finfo(torch.float32).min) if m.dtype == torch.bool else scores + m.float()
    return (torch.softmax(scores, -1).to(v.dtype).view(B, nkv, rep * T, S) @ v).view(B, nh, T, d)

