"""Block layout for training parallel drafters on many anchors at once (docs/methods/dflash.md#training-on-many-anchors).

An anchor t is the last verified token of a round: a block of L slots starts at position t and
sees the context (target features) of positions strictly before t. All A blocks of a sequence run
in one forward; queries are the A·L block slots, keys are [T context positions ; A·L block slots].

Shapes: B sequences, T tokens, A anchors per sequence, L block length (γ or γ + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Anchors:
    pos: torch.Tensor  # [B, A] int64 anchor positions t (0 where not valid)
    valid: torch.Tensor  # [B, A] bool: a real anchor (sequences may have fewer than A)


def sample_anchors(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None
) -> Anchors:
    """Up to `max_anchors` anchors t per sequence, uniformly without replacement, among the
    positions whose next token x_{t+1} is a real assistant token (the first draft is supervised).

    loss_mask, attention_mask: [B, T] bool. Anchors come back sorted within each sequence.
    """
    B, T = loss_mask.shape
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, 1:] & attention_mask[:, 1:]  # [B, T]: t is a candidate
    picks = []
    for b in range(B):
        cand = ok[b].nonzero().flatten()
        order = torch.randperm(cand.numel(), generator=generator)[:max_anchors]
        picks.append(cand[order].sort().values)
    A = max(1, max(p.numel() for p in picks))
    pos = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, p in enumerate(picks):
        pos[b, : p.numel()], valid[b, : p.numel()] = p, True
    return Anchors(pos.to(loss_mask.device), valid.to(loss_mask.device))


def block_positions(anchor_pos: torch.Tensor, block_len: int) -> torch.Tensor:
    """[B, A] anchors -> [B, A·L] absolute positions t, t+1, .., t+L-1 of every block slot."""
    offsets = torch.arange(block_len, device=anchor_pos.device)
    return (anchor_pos[..., None] + offsets).flatten(1)


def block_attention_mask(anchor_pos: torch.Tensor, context_len: int, block_len: int) -> torch.Tensor:
    """Boolean attention mask [B, A·L, T + A·L] (True = may attend) for the many-anchor forward.

    Query slot (a, j) attends to context key s iff s < t_a, and to block key (a', j') iff a' == a
    (bidirectional inside its own block, blind to other blocks). Inference is the case A = 1,
    T = t, where everything is visible.
    """
    B, A = anchor_pos.shape
    dev = anchor_pos.device
    s = torch.arange(context_len, device=dev)
    to_ctx = s[None, None, :] < anchor_pos[..., None]  # [B, A, T]
    to_ctx = to_ctx.repeat_interleave(block_len, dim=1)  # [B, A·L, T]
    block_id = torch.arange(A, device=dev).repeat_interleave(block_len)  # [A·L]
    to_block = (block_id[:, None] == block_id[None, :]).expand(B, -1, -1)  # [B, A·L, A·L]
    return torch.cat([to_ctx, to_block], dim=2)


def ttt_attention_mask(slots: int, steps: int) -> torch.Tensor:
    """EAGLE-3 training-time test mask [γ·S, γ·S] bool (True = may attend), γ = steps, S = slots.

    Row j·S + t is slot t at unrolled step j (it drafts token t + j + 2 at position t + j); column
    i·S + s is slot s's key at step i. Step 0 is causal over the real target features (s <= t);
    step j >= 1 adds only its own slot's keys of steps 1..j, exactly the draft chain inference
    builds on top of the committed context (docs/methods/eagle3.md#training-time-test). Step j's queries use the first (j+1)·S keys.
    """
    t = torch.arange(slots)
    causal = t[None, :] <= t[:, None]  # [S, S]
    own = torch.eye(slots, dtype=torch.bool)
    blocks = [
        [causal if i == 0 else own if i <= j else torch.zeros_like(own) for i in range(steps)] for j in range(steps)
    ]
    return torch.cat([torch.cat(row, dim=1) for row in blocks], dim=0)
