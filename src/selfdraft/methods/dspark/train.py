"""DSpark training: the DFlash many-anchor pass, the heads teacher forced on ground-truth previous
tokens, and L = w_ce L_ce + w_tv L_tv + w_kl L_kl + w_conf L_conf (docs/methods/dspark.md#training-loss)."""

from __future__ import annotations

import torch.nn.functional as F

from selfdraft.methods.dflash.train import DFlashStrategy, draft_losses, teacher_forced_blocks
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.methods.dspark.model import DSparkModel
from selfdraft.target import Target
from selfdraft.training.objectives import accuracy_at_k, confidence_labels, position_weights, weighted_mean
from selfdraft.training.strategy import Batch, LossOutput


class DSparkStrategy(DFlashStrategy):
    """L = w_ce L_ce + w_tv L_tv + w_kl L_kl + w_conf L_conf, each position weighted (docs/methods/dspark.md#training-loss)."""

    method = "dspark"

    def loss(self, model: DSparkModel, batch: Batch, target: Target, cfg: DSparkConfig, generator) -> LossOutput:
        # 1. Backbone over all blocks; heads teacher forced on ground-truth previous tokens.
        tf = teacher_forced_blocks(model, batch, target, cfg, generator)
        heads = model.heads(tf.h, tf.prev)
        sel, k_idx, gold = tf.valid, tf.k_idx(), tf.gold[tf.valid]  # N valid positions
        # 2. Draft logits U_k + B_k (B_k = W2 e_k, over V' rows of W2 with a draft vocabulary) vs p_t.
        bias = None
        if heads.e is not None:
            W2 = model.markov.W2.weight if model.draft_ids is None else model.markov.W2.weight[model.draft_ids]
            bias = F.linear(heads.e[sel], W2).float()  # [N, V or V']
        d = draft_losses(model, target, batch, tf, bias, with_l1=True, ce_label=cfg.ce_label)
        # 3. The three position-weighted parts.
        w = position_weights(cfg.gamma, cfg.loss_decay, gold.device)
        l_ce = weighted_mean(d.ce, k_idx[d.ce_rows], w)
        l_tv = weighted_mean(d.l1, k_idx, w)  # ||p_d,k - p_t,k||_1
        label = confidence_labels(d.l1)  # [N] c*_k, detached
        l_kl = weighted_mean(d.kl, k_idx, w)  # soft CE against p_t
        loss = cfg.w_ce * l_ce + cfg.w_tv * l_tv + cfg.w_kl * l_kl
        metrics = {"ce": l_ce.item(), "tv": l_tv.item(), "kl": l_kl.item(), "alpha": float(weighted_mean(label, k_idx, w))}
        if heads.z is not None:
            bce = F.binary_cross_entropy_with_logits(heads.z[sel].float(), label, reduction="none")
            l_conf = weighted_mean(bce, k_idx, w)
            loss = loss + cfg.w_conf * l_conf
            metrics["conf"] = l_conf.item()
        metrics.update(accuracy_at_k(d.pred, gold, k_idx, cfg.gamma))
        return LossOutput(loss=loss, tokens=int(gold.numel()), metrics=metrics)


DSPARK = DSparkStrategy()
