"""MTP training: every depth teacher forced over all slots, cross-entropy per depth weighted
mtp_decay^(d-1) and normalised (docs/methods/mtp.md#training-loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfdraft.methods.mtp.config import MTPConfig
from selfdraft.methods.mtp.model import MTPModel
from selfdraft.target import Target
from selfdraft.training.objectives import accuracy_at_k
from selfdraft.training.strategy import Batch, LossOutput, Strategy


def mtp_states(model: MTPModel, target: Target, ids: torch.Tensor, h0: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Teacher-forced forward of every depth over all slots -> per depth h^d [B, T, H].

    ids: [B, T], h0: [B, T, H] target final hidden states. Slot t at depth d reads x_{t+d} at
    position t + d (clamped past the end: those slots are never supervised) and is causal over slots.
    """
    B, T = ids.shape
    slot = torch.arange(T, device=ids.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril().expand(B, -1, -1)
    emb = target.embed(ids)
    h, states = h0.to(model.dtype), []
    for d in range(1, depths + 1):
        pos = (slot + d).expand(B, T)
        h_in = model.handoff(d - 1, h)
        h, _ = model.module(d)(emb[:, (slot + d).clamp(max=T - 1)], h_in, pos, model.empty_kv(B, ids.device), causal, model.rotary)
        states.append(h)
    return states


class MTPStrategy(Strategy):
    """Cross-entropy per depth against the next tokens, weighted mtp_decay^(d-1), normalised (docs/methods/mtp.md#training-loss)."""

    method = "mtp"

    def loss(self, model: MTPModel, batch: Batch, target: Target, cfg: MTPConfig, generator) -> LossOutput:
        ids = batch.input_ids
        B, T = ids.shape
        slot = torch.arange(T, device=ids.device)
        losses, preds, golds, k_idx = [], [], [], []
        for d, h in enumerate(mtp_states(model, target, ids, batch.last_hidden, model.depths), start=1):
            gold_at = (slot + d + 1).clamp(max=T - 1).expand(B, -1)  # slot t at depth d predicts x_{t+d+1}
            valid = (slot + d + 1 < T)[None] & batch.loss_mask.gather(1, gold_at)
            logits, gold = model.logits(target, d, h[valid]), ids.gather(1, gold_at)[valid]
            losses.append(F.cross_entropy(logits, gold) if gold.numel() else logits.sum() * 0.0)
            preds.append(logits.argmax(-1)), golds.append(gold), k_idx.append(torch.full_like(gold, d - 1))
        w = cfg.mtp_decay ** torch.arange(model.depths, dtype=torch.float32, device=ids.device)
        loss = (w * torch.stack(losses)).sum() / w.sum()
        metrics = {"ce": losses[0].item(), **accuracy_at_k(torch.cat(preds), torch.cat(golds), torch.cat(k_idx), model.depths)}
        return LossOutput(loss=loss, tokens=int(golds[0].numel()), metrics=metrics)


MTP = MTPStrategy()
