"""logits -> probabilities (temperature, top-k, top-p), applied identically to p and q."""

from __future__ import annotations

import torch

from selfdraft.config import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after the sampling transforms.

    Greedy (T = 0) returns the one-hot of the argmax, so greedy is the T -> 0 limit of the
    same code path and verification needs no special case for correctness.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays in)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] probabilities -> [...] token ids (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:  # a CPU generator drawing for a GPU drafter
        return torch.multinomial(flat.cpu(), 1, generator=generator).squeeze(-1).reshape(probs.shape[:-1]).to(probs.device)
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to sample after rejecting a draft token (docs/verification.md#residual-distribution).

    If p == q exactly the residual is empty; rejection then has probability 0, so any
    distribution is valid: we return p to stay well defined.
    """
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)
