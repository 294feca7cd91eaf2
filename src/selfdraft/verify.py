"""Verification as pure functions (DESIGN section 2). Inputs are already-processed probabilities.

Shapes: γ = number of draft tokens, V = vocab.
  p: [γ+1, V] target probabilities at the γ+1 verified positions (last + drafts)
  q: [γ, V]   draft probabilities the drafts were sampled from, or None for deterministic
              drafts (q is then the one-hot of the draft token: n-gram, argmax drafters)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfdraft.sampling import residual, sample


@dataclass
class Verification:
    num_accepted: int  # drafts accepted, 0..γ
    next_token: int  # the correction at the first rejection, or the bonus token
    tokens: list[int]  # accepted drafts followed by next_token (len num_accepted + 1)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> Verification:
    """T = 0: accept while x_k == argmax p_k; then add the target's argmax (correction or bonus).

    target_logits: [γ+1, V], drafts: [γ] int64.
    """
    best = target_logits.argmax(-1)  # [γ+1]
    gamma = drafts.shape[0]
    match = (best[:gamma] == drafts).int()
    n = int(match.cumprod(0).sum()) if gamma else 0
    return Verification(n, int(best[n]), drafts[:n].tolist() + [int(best[n])])


def verify_chain(
    p: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> Verification:
    """Leviathan/Chen rejection sampling over a chain of γ drafts.

    For k = 1..γ accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection
    sample from norm(max(0, p_k - q_k)); if all are accepted, sample the bonus from p_{γ+1}.
    """
    gamma = drafts.shape[0]
    for k in range(gamma):
        x = int(drafts[k])
        qk = q[k] if q is not None else torch.nn.functional.one_hot(drafts[k], p.shape[-1]).to(p)
        ratio = (p[k, x] / qk[x]).clamp(max=1.0) if qk[x] > 0 else torch.tensor(0.0)
        u = torch.rand((), generator=generator)
        if u >= ratio:  # reject (u < ratio has probability ratio)
            t = int(sample(residual(p[k], qk), generator))
            return Verification(k, t, drafts[:k].tolist() + [t])
    t = int(sample(p[gamma], generator))
    return Verification(gamma, t, drafts.tolist() + [t])
