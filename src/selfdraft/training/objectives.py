"""Loss pieces shared by the parallel drafters (docs/methods/dflash.md, docs/methods/dspark.md).

Every loss is position weighted: block position k (1-based) has weight w_k = exp(-(k-1)/decay),
and a loss over the N supervised positions of a batch is Σ w_k ℓ / Σ w_k. Positions are passed
flattened: values [N] with their 0-based block index k_idx [N].
"""

from __future__ import annotations

import torch

from selfdraft.target import Target


def position_weights(gamma: int, decay: float, device=None) -> torch.Tensor:
    """[γ] w_k = exp(-(k-1)/decay), k = 1..γ."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / decay)


def weighted_mean(values: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """values: [N], k_idx: [N] in 0..γ-1, w: [γ] -> Σ w_k v / Σ w_k (0 when N = 0)."""
    wk = w[k_idx]
    return (wk * values.float()).sum() / wk.sum().clamp_min(1e-12)


@torch.no_grad()
def target_probs(target: Target, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """p_t: [N, H] final target hidden states -> [N, V] float32 target distributions, computed
    from the frozen LM head in chunks of positions (never stored per token, docs/training.md#feature-cache)."""
    w_dtype = target.model.get_output_embeddings().weight.dtype
    parts = [
        torch.softmax(target.lm_head(h.to(w_dtype)).float(), dim=-1) for h in last_hidden.split(chunk)
    ]
    return torch.cat(parts) if parts else last_hidden.new_zeros(0, target.vocab_size, dtype=torch.float32)


def l1_distance(p_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """[N, V] x [N, V] -> [N] ||p_d - p_t||_1 = 2 TV(p_d, p_t)."""
    return (p_d - p_t).abs().sum(-1)


def confidence_labels(l1: torch.Tensor) -> torch.Tensor:
    """Soft acceptance label c*_k = 1 - ½||p_d,k - p_t,k||_1 = Σ_v min(p_d, p_t) (docs/methods/dspark.md#training-loss), detached.

    l1: [N] from l1_distance (reused, so the [N, V] difference is formed once) -> [N]."""
    return (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)


def accuracy_at_k(pred: torch.Tensor, gold: torch.Tensor, k_idx: torch.Tensor, gamma: int) -> dict[str, float]:
    """Per-position top-1 accuracy {"acc@1": .., "acc@γ": ..} over the supervised positions."""
    hit = (pred == gold).float()
    out = {}
    for k in range(gamma):
        at_k = k_idx == k
        out[f"acc@{k + 1}"] = float(hit[at_k].mean()) if at_k.any() else float("nan")
    return out
