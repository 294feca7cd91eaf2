"""Verification (docs/verification.md): `verify`, the one entry a round calls (decode.py), and the
rules it dispatches to, pure functions of already-processed probabilities.

A round goes decode -> verify -> sampling: `verify` turns the target's logits into p with the
request's logits processors and sampling transforms (sampling.py), then picks greedy, chain
rejection sampling or the sibling rule.

Shapes: γ = number of draft tokens, V = vocab.
  p: [γ+1, V] target probabilities at the γ+1 verified positions (last + drafts)
  q: [γ, V]   draft probabilities the drafts were sampled from, or None for deterministic
              drafts (q is then the one-hot of the draft token: n-gram, argmax drafters)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from selfdraft.config import SamplingParams
from selfdraft.sampling import block_contexts, probs_from_logits, process_logits, residual, sample

if TYPE_CHECKING:
    from selfdraft.drafters.base import Proposal


@dataclass
class Verification:
    num_accepted: int  # drafts accepted, 0..γ
    next_token: int  # the correction at the first rejection, or the bonus token
    tokens: list[int]  # accepted drafts followed by next_token (len num_accepted + 1)


def verify(logits: torch.Tensor, proposal: "Proposal", params: SamplingParams, generator,
           generated: Sequence[int] = ()) -> Verification:
    """logits: [γ'+1, V] target logits at [anchor, drafts] (on the target's device). Dispatches tree vs
    greedy vs rejection sampling.

    Greedy runs where the logits are (processors, argmax, acceptance) and copies γ'+2 ids to the host
    once; sampling runs on the CPU (a no-op there), where the request's CPU generator draws, whatever
    the target's device. generated: the request's generated tokens so far, anchor included (what
    penalties count)."""
    proposal = proposal.cpu()
    if not params.greedy:
        logits = logits.cpu()
    if params.has_processors:  # each row with its own context: the drafts before it
        logits = process_logits(logits, params, _row_contexts(generated, proposal, logits.shape[0]))
    if params.greedy:  # p one-hot at the argmax: a tree's sibling rule walks the argmax path
        if proposal.parents is not None:
            return verify_tree_greedy(logits, proposal.tokens, proposal.parents)
        return verify_greedy(logits, proposal.tokens)
    if proposal.parents is not None:  # a draft tree: the sibling rule
        return verify_tree(probs_from_logits(logits, params), proposal.tokens, proposal.parents, generator)
    return verify_chain(probs_from_logits(logits, params), proposal.tokens, proposal.q, generator)


def _row_contexts(generated: Sequence[int], proposal: "Proposal", n: int) -> list[list[int]]:
    """Generated tokens before each verified row: a chain's row i follows drafts[:i]; a tree's node
    row follows its ancestors' tokens and its own."""
    if proposal.parents is None:
        return block_contexts(generated, proposal.tokens.tolist(), n)
    toks, parents, rows = proposal.tokens.tolist(), proposal.parents.tolist(), [list(generated)]
    for j in range(n - 1):
        rows.append(rows[parents[j] + 1] + [toks[j]])  # parents[j] < j: its row is built already
    return rows


def greedy_outcome(target_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """T = 0 on the logits' device: [γ+1, V] logits, [γ] drafts -> [γ+2] int64 = the target's argmax
    at every row, then the number of drafts accepted (x_k == argmax p_k for k = 1..n). One copy of
    these γ+2 ids is all a GPU round sends to the host, instead of the [γ+1, V] logits."""
    best = target_logits.argmax(-1)  # [γ+1]
    gamma = drafts.shape[0]
    n = (best[:gamma] == drafts.to(best.device)).int().cumprod(0).sum()  # 0 when γ = 0
    return torch.cat([best, n.view(1).to(best.dtype)])


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> Verification:
    """T = 0: accept while x_k == argmax p_k; then add the target's argmax (correction or bonus).

    target_logits: [γ+1, V] (any device), drafts: [γ] int64 on the CPU.
    """
    *best, n = greedy_outcome(target_logits, drafts).tolist()  # the round's one host copy
    return Verification(n, best[n], drafts[:n].tolist() + [best[n]])


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


def verify_tree_greedy(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> TreeVerification:
    """The sibling rule at T = 0 (p one-hot at each row's argmax): from the anchor, accept the first
    child whose token is its row's argmax; the round ends with the argmax of the last accepted row.
    The argmax runs on the logits' device and one copy of N+1 ids reaches the host. Tokens equal
    `verify_tree` with one-hot p, which also ends at the argmax (it only draws it from the generator)."""
    from selfdraft.tree import children

    best = target_logits.argmax(-1).tolist()  # [N+1]: the round's one host copy
    kids, toks = children(parents), tokens.tolist()
    row, path = 0, []
    while True:
        child = next((c for c in kids[row] if toks[c] == best[row]), None)
        if child is None:
            return TreeVerification(len(path), best[row], [toks[i] for i in path] + [best[row]], path)
        path.append(child)
        row = child + 1


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
