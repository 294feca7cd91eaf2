"""DSpark training: the DFlash many-anchor pass, the heads teacher forced on ground-truth previous
tokens, and L = w_ce L_ce + w_tv L_tv + w_kl L_kl + w_conf L_conf (docs/methods/dspark.md#training-loss),
with TV's weight optionally annealed in from the soft CE (kl_to_tv_tokens)."""

from __future__ import annotations

import torch.nn.functional as F

from selfdraft.methods.dflash.train import DFlashStrategy, draft_losses, teacher_forced_blocks
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.methods.dspark.model import DSparkModel
from selfdraft.target import Target
from selfdraft.training.objectives import accuracy_at_k, confidence_labels, position_weights, weighted_mean
from selfdraft.training.strategy import Batch, LossOutput


def tv_share(cfg: DSparkConfig, tokens_seen: int | None) -> float:
    """r in [0, 1]: how much of w_tv goes to TV (the rest to the soft CE) after `tokens_seen` tokens."""
    if not cfg.kl_to_tv_tokens or tokens_seen is None:
        return 1.0
    return min(1.0, tokens_seen / cfg.kl_to_tv_tokens)


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
        blk = tf.block_rows()  # [N] the sampled blocks (dense_first's extra queries excluded from metrics)
        l_kl = weighted_mean(d.kl, k_idx, w)  # soft CE against p_t
        r = tv_share(cfg, batch.tokens_seen)  # 1 unless the soft-CE-to-TV schedule is still running
        loss = cfg.w_ce * l_ce + r * cfg.w_tv * l_tv + (cfg.w_kl + (1 - r) * cfg.w_tv) * l_kl
        metrics = {"ce": l_ce.item(), "tv": l_tv.item(), "kl": l_kl.item(), "alpha": float(weighted_mean(label[blk], k_idx[blk], w))}
        if heads.z is not None:
            bce = F.binary_cross_entropy_with_logits(heads.z[sel].float(), label, reduction="none")
            l_conf = weighted_mean(bce, k_idx, w)
            loss = loss + cfg.w_conf * l_conf
            metrics["conf"] = l_conf.item()
        metrics.update(accuracy_at_k(d.pred[blk], gold[blk], k_idx[blk], cfg.gamma))
        return LossOutput(loss=loss, tokens=int(gold.numel()), metrics=metrics)


DSPARK = DSparkStrategy()
