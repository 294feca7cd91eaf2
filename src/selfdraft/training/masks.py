"""Training-only layouts: the anchors of the many-anchor forward of the parallel drafters
(docs/methods/dflash.md#training-on-many-anchors; the block positions and mask themselves are
inference's too, in drafters/blocks.py) and EAGLE-3's training-time-test mask.
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


def first_slot_queries(loss_mask: torch.Tensor, attention_mask: torch.Tensor, anchors: Anchors) -> Anchors:
    """Every candidate anchor position (x_{t+1} a real assistant token) that `anchors` did not pick:
    the one-slot first-position queries of dense_first. loss_mask, attention_mask: [B, T] bool ->
    Anchors [B, D] (sorted, padded with valid = False)."""
    B, T = loss_mask.shape
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, 1:] & attention_mask[:, 1:]  # [B, T]: t is a candidate
    b = torch.arange(B, device=ok.device)[:, None].expand_as(anchors.pos)
    ok[b[anchors.valid], anchors.pos[anchors.valid]] = False  # already a block's first slot
    n = ok.sum(1)  # [B]
    D = max(1, int(n.max()))
    # stable sort puts candidates first, in position order
    pos = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :D]  # [B, D]
    valid = torch.arange(D, device=ok.device)[None] < n[:, None]
    return Anchors(torch.where(valid, pos, 0), valid)


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
