"""EAGLE-3 training: training-time test over γ unrolled head steps, Σ_j ttt_decay^j · soft-CE_j against
the target distribution restricted to the draft vocabulary (docs/methods/eagle3.md#training-loss)."""

from __future__ import annotations

import torch

from selfdraft.methods.eagle3.config import Eagle3Config
from selfdraft.methods.eagle3.model import Eagle3Model
from selfdraft.target import Target
from selfdraft.training.draft_vocab import draft_vocab_of
from selfdraft.training.masks import ttt_attention_mask
from selfdraft.training.strategy import Batch, LossOutput, Strategy


def restricted_target_probs(target: Target, last_hidden: torch.Tensor, t2d: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """p_t restricted to the draft vocabulary and renormalised: [N, H] -> [N, n] float32 (chunked,
    so the [N, V] full distribution never exists at once)."""
    w_dtype = target.model.get_output_embeddings().weight.dtype
    parts = []
    for h in last_hidden.split(chunk):
        p = torch.softmax(target.lm_head(h.to(w_dtype)).float(), dim=-1)[:, t2d]
        parts.append(p / p.sum(-1, keepdim=True).clamp_min(1e-12))
    return torch.cat(parts) if parts else last_hidden.new_zeros(0, int(t2d.sum()))


def ttt_states(model: Eagle3Model, target: Target, ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: `steps` unrolled head steps over all slots at once -> per step h [B, S, H].

    ids: [B, T], features: [B, T, n_feat, H]; S = T - 1 slots. Step 0 at slot t reads (g_t, x_{t+1});
    step j reads (its own step j-1 output, ground-truth x_{t+1+j}) at position t + j, and drafts
    x_{t+2+j}. Keys grow by S per step; masks.ttt_attention_mask says who sees whom.
    """
    B, T = ids.shape
    S = T - 1
    slot = torch.arange(S, device=ids.device)
    emb = target.embed(ids)  # [B, T, H]
    mask = ttt_attention_mask(S, steps).to(ids.device)  # [steps·S, steps·S]
    h, ctx, states = model.fuse(features[:, :S]), model.empty_kv(B, ids.device), []
    for j in range(steps):
        tok = (slot + 1 + j).clamp(max=T - 1)  # past the end: padding, never supervised
        m = mask[j * S : (j + 1) * S, : (j + 1) * S].expand(B, -1, -1)
        h, kv = model.step(emb[:, tok], h, (slot + j).expand(B, S), ctx, m)
        ctx = ctx.append(kv)
        states.append(h)
    return states


class Eagle3Strategy(Strategy):
    """Training-time test over γ unrolled steps, Σ_j ttt_decay^j · soft-CE_j (docs/methods/eagle3.md#training-loss)."""

    method = "eagle3"

    def prepare(self, model: Eagle3Model, cfg: Eagle3Config, target: Target, data_dir: str) -> None:
        """The draft vocabulary = the most frequent assistant tokens of the training data (data.py)."""
        if cfg.draft_vocab_size == target.vocab_size:
            return
        vocab = draft_vocab_of(data_dir, cfg.draft_vocab_size, target.vocab_size)
        model.set_vocab(vocab.d2t.to(model.d2t.device), vocab.t2d.to(model.t2d.device), target)

    def loss(self, model: Eagle3Model, batch: Batch, target: Target, cfg: Eagle3Config, generator) -> LossOutput:
        ids = batch.input_ids  # [B, T]
        B, T = ids.shape
        slot = torch.arange(T - 1, device=ids.device)
        p_draft = restricted_target_probs(target, batch.last_hidden.flatten(0, 1), model.t2d).view(B, T, -1)
        losses, metrics = [], {}
        for j, h in enumerate(ttt_states(model, target, ids, batch.features, cfg.gamma)):
            # Step j, slot t drafts x_{t+2+j}: soft CE against p_t at t+1+j, where x_{t+2+j} is supervised.
            gold_at = (slot + 2 + j).clamp(max=T - 1).expand(B, -1)  # [B, S]
            valid = (slot + 2 + j < T)[None] & batch.loss_mask.gather(1, gold_at)
            logp = torch.log_softmax(model.draft_logits(h[valid]), dim=-1)  # [N_j, n]
            label = p_draft[:, (slot + 1 + j).clamp(max=T - 1)][valid]  # [N_j, n]
            losses.append(-(label * logp).sum(-1).mean() if valid.any() else logp.sum() * 0.0)
            gold, pred = ids.gather(1, gold_at)[valid], model.target_ids[logp.argmax(-1)]
            metrics[f"acc@{j + 1}"] = float((pred == gold).float().mean()) if gold.numel() else float("nan")
            if j == 0:
                tokens = int(valid.sum())
        w = cfg.ttt_decay ** torch.arange(cfg.gamma, dtype=torch.float32, device=ids.device)
        loss = (w * torch.stack(losses)).sum()  # Σ_j 0.8^j L_j
        return LossOutput(loss=loss, tokens=tokens, metrics={"ce": losses[0].item(), **metrics})


EAGLE3 = Eagle3Strategy()
