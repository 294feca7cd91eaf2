"""Loss pieces shared by the parallel drafters (docs/methods/dflash.md, docs/methods/dspark.md).

Every loss is position weighted: block position k (1-based) has weight w_k = exp(-(k-1)/decay),
and a loss over the N supervised positions of a batch is Σ w_k ℓ / Σ w_k. Positions are passed
flattened: values [N] with their 0-based block index k_idx [N].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


# ------------------------------------------------------------------ losses over a draft vocabulary V'
@dataclass
class TargetStats:
    """Per-position statistics of p_t from one pass of the frozen LM head over the full vocabulary."""

    lse: torch.Tensor  # [...] float32 log Σ_v exp(z_v)
    argmax: torch.Tensor  # [...] int64 argmax_v p_t(v), the token greedy decoding emits (ce_label="argmax"); [0] if not asked


@torch.no_grad()
def target_stats(target: Target, last_hidden: torch.Tensor, chunk: int = 1024, argmax: bool = True) -> TargetStats:
    """[..., H] final target hidden states -> their TargetStats, in chunks (logits never stored per token);
    argmax=False skips the argmax (its field is then empty).

    With lse, p_t restricted to any subset of rows is exp(z_S - lse) without materialising [N, V]."""
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    w_dtype = target.model.get_output_embeddings().weight.dtype
    lse, top = [flat.new_zeros(0, dtype=torch.float32)], [flat.new_zeros(0, dtype=torch.long)]
    for h in flat.split(chunk):
        z = target.lm_head(h.to(w_dtype)).float()  # [chunk, V]
        lse.append(torch.logsumexp(z, dim=-1))
        if argmax:
            top.append(z.argmax(-1))
    shape = last_hidden.shape[:-1]
    return TargetStats(torch.cat(lse).view(shape), torch.cat(top).view(shape) if argmax else torch.cat(top))


def target_lse(target: Target, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[..., H] final target hidden states -> [...] float32 log Σ_v exp(z_v) over the FULL vocabulary."""
    return target_stats(target, last_hidden, chunk, argmax=False).lse


@dataclass
class VocabLoss:
    """Per-position pieces of the draft-vocabulary losses (N supervised positions)."""

    l1: torch.Tensor | None  # [N] ||q - p_t||_1 over the full vocabulary (q is zero outside V'); None if not asked
    kl: torch.Tensor | None  # [N] soft CE -Σ_{v∈V'} p_t(v) log q(v) (KL(p_t||q) up to a constant in q); with l1
    ce: torch.Tensor  # [M] -log q(gold) at the M positions whose gold token lies in V'
    ce_rows: torch.Tensor  # [N] bool: which positions those are
    pred: torch.Tensor  # [N] target id of argmax q


def vocab_losses(
    logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, t2d: torch.Tensor,
    h_t: torch.Tensor | None, lse_t: torch.Tensor | None, gold: torch.Tensor,
) -> VocabLoss:
    """Losses of a drafter that drafts over V' ⊂ V, exactly as over the full vocabulary.

    logits: [N, V'] draft logits over V' (q = softmax over V', zero elsewhere, as at inference);
    rows: [V', H] the target's LM-head rows of V'; ids: [V'] their target ids; t2d: [V] target id ->
    draft index (-1 outside V'); h_t: [N, H] target final hidden states and lse_t: [N] their full-vocab
    log-partition (p_t(v) = exp(z_v - lse)); gold: [N] target ids.

    ||q - p_t||_1 = Σ_{v∈V'} |q_v - p_t,v| + Σ_{v∉V'} p_t,v, and the second term is one bucket,
    1 - Σ_{v∈V'} p_t,v: the loss stays the true L1 distance (2·TV) while only V' logits are formed.
    The soft CE -Σ_{v∈V'} p_t,v log q_v is KL(p_t || q) up to a constant in q over V' (q has no mass outside
    V', so the full KL is infinite wherever p_t has; EAGLE-3's draft-vocabulary loss is the same term).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)  # [N, V']
    l1 = kl = None  # h_t None: cross-entropy only (DFlash)
    if h_t is not None:
        with torch.no_grad():
            p_in = torch.exp(F.linear(h_t.to(rows.dtype), rows).float() - lse_t[:, None])  # [N, V']
            rest = (1.0 - p_in.sum(-1)).clamp_min(0.0)  # [N] target mass outside V'
        l1 = (logq.exp() - p_in).abs().sum(-1) + rest
        kl = -(p_in * logq).sum(-1)
    g = t2d[gold]  # [N] draft index of the gold token, -1 outside V'
    ce_rows = g >= 0
    ce = -logq[ce_rows].gather(1, g[ce_rows, None]).squeeze(1)
    return VocabLoss(l1=l1, kl=kl, ce=ce, ce_rows=ce_rows, pred=ids[logits.argmax(-1)])
