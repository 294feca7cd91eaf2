"""Verification as pure functions (docs/verification.md). Inputs are already-processed probabilities.

Shapes: γ = number of draft tokens, V = vocab.
  p: [γ+1, V] target probabilities at the γ+1 verified positions (last + drafts)
  q: [γ, V]   draft probabilities the drafts were sampled from, or None for deterministic
              drafts (q is then the one-hot of the draft token: n-gram, argmax drafters)
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class TreeVerification(Verification):
    path: list[int] = field(default_factory=list)  # accepted node indices, root to leaf (len num_accepted)


def verify_tree(
    p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, generator: torch.Generator | None = None
) -> TreeVerification:
    """Deterministic draft tree (q one-hot per child): the SpecInfer / EAGLE sibling rule (docs/verification.md#the-sibling-rule).

    p: [N+1, V] target probabilities at block rows [anchor, nodes]; tokens, parents: [N] (tree.py).
    From the anchor: try the children of the current node in order; accept child x with probability
    p(x) (p renormalised); on rejection set p(x) = 0, renormalise and try the next sibling. An
    accepted child becomes the current node; when all children fail (or there are none) sample the
    round's last token from what remains of p. With one-hot (greedy) p this walks the argmax path.
    """
    from selfdraft.tree import children

    kids = children(parents)
    row, path = 0, []
    while True:
        rest = p[row].clone()
        for child in kids[row]:
            total = float(rest.sum())
            ratio = float(rest[int(tokens[child])]) / total if total > 0 else 0.0
            if ratio >= 1.0 or (ratio > 0.0 and float(torch.rand((), generator=generator)) < ratio):
                path.append(child)
                row = child + 1
                break
            rest[int(tokens[child])] = 0.0
        else:
            rest = rest if float(rest.sum()) > 0 else p[row]  # all mass rejected: probability 0 event
            t = int(sample(rest / rest.sum(), generator))
            accepted = [int(tokens[i]) for i in path]
            return TreeVerification(len(path), t, accepted + [t], path)
