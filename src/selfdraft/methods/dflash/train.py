"""DFlash training: many anchors per sequence in one backbone pass, position-weighted cross-entropy
(docs/methods/dflash.md#training-on-many-anchors, docs/methods/dflash.md#training-loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfdraft.drafters.blocks import block_attention_mask
from selfdraft.methods.dflash.config import DFlashConfig
from selfdraft.methods.dflash.model import DFlashModel, Singles
from selfdraft.target import Target, lm_logits
from selfdraft.training.draft_vocab import draft_vocab_of
from selfdraft.training.masks import first_slot_queries, sample_anchors
from selfdraft.training.objectives import (
    VocabLoss,
    accuracy_at_k,
    l1_distance,
    position_weights,
    target_probs,
    vocab_losses,
    weighted_mean,
)
from selfdraft.training.strategy import Batch, LossOutput, Strategy
from selfdraft.vocab import draft_columns


def prepare_draft_vocab(model: DFlashModel, cfg: DFlashConfig, target: Target, data_dir: str) -> None:
    """Fill model.draft_ids with the cfg.loss_vocab_size most frequent answer tokens of the training data."""
    if not cfg.loss_vocab_size:
        return
    vocab = draft_vocab_of(data_dir, cfg.loss_vocab_size, target.vocab_size)
    model.draft_ids.copy_(vocab.target_ids.to(model.draft_ids.device))


@dataclass
class TeacherForced:
    """All sampled blocks of a batch after one backbone pass. Index [b, a, k-1] = draft k of anchor a."""

    h: torch.Tensor  # [B, A, γ, H] draft-slot hidden states
    gold: torch.Tensor  # [B, A, γ] x_{t+k}, the token draft k should predict
    prev: torch.Tensor  # [B, A, γ] x_{t+k-1} (ground truth; x_t = the anchor for k = 1)
    src: torch.Tensor  # [B, A, γ] t+k-1: where the target's own distribution p_t for x_{t+k} is read
    valid: torch.Tensor  # [B, A, γ] bool: a real anchor, t+k inside the sequence, an assistant token
    # [B, A, γ] bool: a row of a sampled block. dense_first appends D one-slot queries as rows A..A+D-1
    # (only k = 1 valid); accuracy@k is read on the blocks alone, so runs with and without compare.
    in_block: torch.Tensor

    def block_rows(self) -> torch.Tensor:
        """[N] bool: which valid positions belong to a sampled block (flattened like `x[self.valid]`)."""
        return self.in_block[self.valid]

    def k_idx(self) -> torch.Tensor:
        """[N] 0-based block index of every valid position (flattened like `x[self.valid]`)."""
        return torch.arange(self.gold.shape[-1], device=self.gold.device).expand_as(self.gold)[self.valid]

    def target_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, ...] per-position target values -> [N, ...] read at t+k-1 of every valid position
        (where p_t for draft k lives)."""
        b = torch.arange(self.src.shape[0], device=self.src.device)[:, None, None].expand_as(self.src)
        return x[b[self.valid], self.src[self.valid]]


def draft_losses(
    model: DFlashModel, target: Target, batch: Batch, tf: TeacherForced, bias: torch.Tensor | None, with_l1: bool,
    ce_label: str = "data",
) -> VocabLoss:
    """Draft logits U_k (+ bias B_k) at the N valid positions and their losses against p_t.

    ce_label: the cross-entropy's label, the data's next token ("data") or the target's greedy token
    argmax p_t read at t+k-1 ("argmax"); `pred` is compared with the data's tokens by the callers.

    bias: [N, V] (full vocabulary) or the low-rank factors' product computed by the caller, None for
    DFlash. Over a draft vocabulary (model.draft_ids) only V' logits are formed (objectives.vocab_losses);
    otherwise the full [N, V] distributions, as in the papers.
    """
    h = tf.h[tf.valid]  # [N, H]
    gold = tf.gold[tf.valid]  # [N] the data's tokens (accuracy is always measured against them)
    label = tf.target_rows(batch.target_argmax(target)) if ce_label == "argmax" else gold  # [N] CE label
    ids = model.draft_ids
    if ids is not None:
        rows = target.model.get_output_embeddings().weight[ids].detach()  # [V', H] frozen
        logits = lm_logits(target, h, rows.t()) + (0 if bias is None else bias)  # [N, V']
        t2d = draft_columns(ids, target.vocab_size)  # [V] target id -> column, -1 outside V'
        h_t = tf.target_rows(batch.last_hidden) if with_l1 else None
        lse = tf.target_rows(batch.target_lse(target)) if with_l1 else None
        return vocab_losses(logits, rows, ids, t2d, h_t, lse, label)
    logits = lm_logits(target, h) + (0 if bias is None else bias)  # [N, V]
    logp = torch.log_softmax(logits, dim=-1)
    p_t = target_probs(target, tf.target_rows(batch.last_hidden)) if with_l1 else None  # [N, V]
    l1 = l1_distance(logp.exp(), p_t) if with_l1 else None
    kl = -(p_t * logp).sum(-1) if with_l1 else None
    ce = -logp.gather(1, label[:, None]).squeeze(1)
    return VocabLoss(l1=l1, kl=kl, ce=ce, ce_rows=torch.ones_like(gold, dtype=torch.bool), pred=logits.argmax(-1))


def teacher_forced_blocks(
    model: DFlashModel, batch: Batch, target: Target, cfg: DFlashConfig, generator: torch.Generator | None
) -> TeacherForced:
    """Sample anchors, then run every block of every sequence in ONE backbone forward (docs/methods/dflash.md#training-on-many-anchors)."""
    ids = batch.input_ids  # [B, T]
    B, T = ids.shape
    # 1. Anchors t whose next token is a supervised assistant token (up to cfg.anchors_per_seq).
    anchors = sample_anchors(batch.loss_mask, batch.attention_mask, cfg.anchors_per_seq, generator)
    # 2. Targets x_{t+k}, k = 1..γ, and their validity.
    idx = anchors.pos[..., None] + torch.arange(1, cfg.gamma + 1, device=ids.device)  # [B, A, γ]
    at = idx.clamp(max=T - 1).flatten(1)  # [B, A·γ]

    def gather(x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, A, γ] values at t+k
        return x.gather(1, at).view(idx.shape)

    valid = (idx < T) & gather(batch.loss_mask) & gather(batch.attention_mask) & anchors.valid[..., None]
    src = (idx - 1).clamp(max=T - 1)
    prev = ids.gather(1, src.flatten(1)).view(idx.shape)
    # 3. Context once per sequence (positions 0..T-1), then all blocks under the block mask.
    nxt = None
    if model.next_token is not None:  # Emb(x_{s+1}) at every context position (the last one is never read)
        nxt = target.embed(torch.cat([ids[:, 1:], ids[:, -1:]], 1))  # [B, T, H]
    c = model.context(batch.features, nxt)  # [B, T, H]
    ctx = model.context_kv(c, torch.arange(T, device=ids.device).expand(B, T))

    def last_c(pos: torch.Tensor) -> torch.Tensor | None:  # [B, n] t -> [B, n, H] C_{t-1} (zero at t = 0)
        if model.slot_context is None:
            return None
        return c.gather(1, (pos - 1).clamp(min=0)[..., None].expand(-1, -1, c.shape[-1])) * (pos > 0)[..., None]

    # 4. dense_first: one-slot queries at every other candidate t, in the same pass (the block's first
    #    slot alone, so position 1 is supervised at every position for one slot each).
    singles = None
    if cfg.dense_first:
        q = first_slot_queries(batch.loss_mask, batch.attention_mask, anchors)  # [B, D]
        singles = Singles(target.embed(ids.gather(1, q.pos)), q.pos, last_c(q.pos))
    mask = block_attention_mask(anchors.pos, T, model.block_len, model.first_alone,
                                None if singles is None else singles.pos)  # [B, A·L + D, T + A·L + D]
    anchor_emb = target.embed(ids.gather(1, anchors.pos))  # [B, A, H]
    h = model.backbone(ctx, anchor_emb, anchors.pos, mask, last_c(anchors.pos), singles)  # [B, A, γ, H]
    tf = TeacherForced(h=h, gold=gather(ids), prev=prev, src=src, valid=valid, in_block=torch.ones_like(valid))
    return tf if singles is None else _with_singles(tf, singles, q.valid, ids)


def _with_singles(tf: TeacherForced, s: Singles, ok: torch.Tensor, ids: torch.Tensor) -> TeacherForced:
    """Append D one-slot queries to the A blocks as rows whose only valid position is k = 1:
    h_1 = s.h, x_1 = ids[t+1], x_0 = ids[t], p_t read at t. ok: [B, D] real queries."""
    B, D, H = s.h.shape
    g = tf.gold.shape[-1]
    first = torch.zeros(B, D, g, dtype=torch.bool, device=ok.device)
    first[:, :, 0] = ok  # [B, D, γ]

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, D] -> [B, D, γ] (x at k = 1, 0 elsewhere)
        return torch.where(first, x[..., None], 0)

    h = torch.cat([s.h[:, :, None], s.h.new_zeros(B, D, g - 1, H)], 2)  # [B, D, γ, H]
    cat = lambda a, b: torch.cat([a, b], 1)  # noqa: E731  (blocks first, then the singles)
    return TeacherForced(h=cat(tf.h, h), gold=cat(tf.gold, rows(ids.gather(1, s.pos + 1))),
                         prev=cat(tf.prev, rows(ids.gather(1, s.pos))), src=cat(tf.src, rows(s.pos)),
                         valid=cat(tf.valid, first), in_block=cat(tf.in_block, torch.zeros_like(first)))


class DFlashStrategy(Strategy):
    """DFlash: position-weighted cross-entropy against the hard next tokens (docs/methods/dflash.md#training-loss)."""

    method = "dflash"

    def prepare(self, model: DFlashModel, cfg: DFlashConfig, target: Target, data_dir: str) -> None:
        prepare_draft_vocab(model, cfg, target, data_dir)

    def loss(self, model, batch: Batch, target: Target, cfg: DFlashConfig, generator) -> LossOutput:
        tf = teacher_forced_blocks(model, batch, target, cfg, generator)
        k_idx, gold = tf.k_idx(), tf.gold[tf.valid]  # [N], [N]
        d = draft_losses(model, target, batch, tf, None, with_l1=False, ce_label=cfg.ce_label)  # U_k over V (or V')
        w = position_weights(cfg.gamma, cfg.loss_decay, gold.device)
        ce = weighted_mean(d.ce, k_idx[d.ce_rows], w)
        blk = tf.block_rows()  # accuracy on the sampled blocks (dense_first's extra queries excluded)
        metrics = {"ce": ce.item(), **accuracy_at_k(d.pred[blk], gold[blk], k_idx[blk], cfg.gamma)}
        return LossOutput(loss=ce, tokens=int(gold.numel()), metrics=metrics)


DFLASH = DFlashStrategy()
