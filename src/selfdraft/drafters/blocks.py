"""Block layout of the parallel drafters (DFlash, DSpark) for A anchors at once
(docs/methods/dflash.md#training-on-many-anchors).

An anchor t is the last verified token of a round: a block of L slots starts at position t and
sees the context (target features) of positions strictly before t. All A blocks of a sequence run
in one forward; queries are the A·L block slots, keys are [T context positions ; A·L block slots].
Inference drafts one block per request (A = 1); training samples many anchors per sequence
(training/masks.py) and runs them through the same layout.

Shapes: B sequences, T tokens, A anchors per sequence, L block length (γ or γ + 1).
"""

from __future__ import annotations

import torch


def block_positions(anchor_pos: torch.Tensor, block_len: int) -> torch.Tensor:
    """[B, A] anchors -> [B, A·L] absolute positions t, t+1, .., t+L-1 of every block slot."""
    offsets = torch.arange(block_len, device=anchor_pos.device)
    return (anchor_pos[..., None] + offsets).flatten(1)


def block_attention_mask(
    anchor_pos: torch.Tensor, context_len: int, block_len: int, first_alone: bool = False,
    singles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask [B, A·L + D, T + A·L + D] (True = may attend) for the many-anchor forward.

    Query slot (a, j) attends to context key s iff s < t_a, and to block key (a', j') iff a' == a
    (bidirectional inside its own block, blind to other blocks); with `first_alone` the first slot
    (j = 0) attends to no other slot of its block (dense_first: it is then a one-slot query).
    singles: [B, D] positions t_d of one-slot queries (training only), each attending to context
    s < t_d and to itself. Inference is the case A = 1, T = t, no singles.
    """
    B, A = anchor_pos.shape
    dev = anchor_pos.device
    s = torch.arange(context_len, device=dev)
    to_ctx = s[None, None, :] < anchor_pos[..., None]  # [B, A, T]
    to_ctx = to_ctx.repeat_interleave(block_len, dim=1)  # [B, A·L, T]
    block_id = torch.arange(A, device=dev).repeat_interleave(block_len)  # [A·L]
    to_block = block_id[:, None] == block_id[None, :]  # [A·L, A·L]
    if first_alone:
        slot = torch.arange(block_len, device=dev).repeat(A)  # [A·L] j of every slot
        to_block &= (slot[:, None] > 0) | torch.eye(A * block_len, dtype=torch.bool, device=dev)
    mask = torch.cat([to_ctx, to_block.expand(B, -1, -1)], dim=2)  # [B, A·L, T + A·L]
    if singles is None:
        return mask
    D = singles.shape[1]
    single_ctx = s[None, None, :] < singles[..., None]  # [B, D, T]
    single_self = torch.eye(D, dtype=torch.bool, device=dev).expand(B, -1, -1)  # [B, D, D]
    top = torch.cat([mask, mask.new_zeros(B, A * block_len, D)], dim=2)
    bottom = torch.cat([single_ctx, mask.new_zeros(B, D, A * block_len), single_self], dim=2)
    return torch.cat([top, bottom], dim=1)
