"""DFlash: a block-parallel drafter on the target's fused hidden states (DESIGN section 6).

One forward of N decoder layers (as wide as the target) turns a block [anchor, mask, .., mask]
into γ draft logits U_1..U_γ at once. Every layer attends to the fused context
C = RMSNorm(fc([h_l1; ..; h_ln])) of the positions before the anchor via KV injection
(layers.py). Embedding and LM head are the target's own, frozen and not part of this module.

Layouts (cfg.anchor_as_first):
  False (DFlash): slots [x_t, m, .., m] (γ + 1); slot k predicts x_{t+k}, k = 1..γ.
  True  (DSpark): slots [x_t, m, .., m] (γ);     slot k - 1 predicts x_{t+k}.
Slot j sits at absolute position t + j; context keys keep their own positions 0..t-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from selfdraft.config import DrafterConfig, SamplingParams
from selfdraft.drafters.base import Proposal, TrainedDrafter
from selfdraft.drafters.layers import KV, InjectedDecoderLayer, LayerShape, RMSNorm, Rotary
from selfdraft.sampling import probs_from_logits, sample
from selfdraft.target import Target, TargetStep
from selfdraft.training.masks import block_attention_mask, block_positions, sample_anchors
from selfdraft.training.objectives import accuracy_at_k, position_weights, weighted_mean
from selfdraft.training.strategy import Batch, LossOutput, Strategy, register_strategy

Pick = Callable[[int, torch.Tensor], int]  # (k, logits_k [V]) -> chosen draft token x_k


@dataclass
class DraftBlock:
    """One round's serial decode of a block (inference, or teacher-forced replay in tests)."""

    tokens: torch.Tensor  # [γ] int64 x_1..x_γ
    logits: torch.Tensor  # [γ, V] float32 the logits each x_k was chosen from
    confidences: torch.Tensor | None  # [γ] c_k, or None without a confidence head


class DFlashModel(nn.Module):
    """Trainable DFlash weights: context fusion, mask embedding, N injected layers, final norm."""

    def __init__(self, cfg: DrafterConfig, shape: LayerShape) -> None:
        super().__init__()
        self.gamma = cfg.gamma
        self.offset = 0 if cfg.anchor_as_first else 1  # slot of draft k is k - 1 + offset
        self.block_len = cfg.gamma + self.offset
        H = shape.hidden
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.context_norm = RMSNorm(H, shape.eps)
        self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)  # learnable, not a vocab token
        self.layers = nn.ModuleList(InjectedDecoderLayer(shape) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, shape.eps)
        self.rotary = Rotary(shape.head_dim, shape.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features: [B, T, n_feat, H] target layer outputs -> C: [B, T, H]."""
        return self.context_norm(self.fc(features.to(self.dtype).flatten(2)))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """C: [B, T, H] at positions [B, T] -> per layer K/V [B, n_kv, T, d] (block independent)."""
        return [layer.context_kv(c, positions, self.rotary) for layer in self.layers]

    def backbone(
        self, ctx: list[KV], anchor_emb: torch.Tensor, anchor_pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A blocks per sequence in one pass.

        ctx: per-layer context K/V; anchor_emb: [B, A, H] target embedding of x_t; anchor_pos:
        [B, A] t; mask: [B, A·L, Tc + A·L] (masks.block_attention_mask) -> h: [B, A, γ, H]
        final-normed hidden states at the draft slots (U_k = lm_head(h_k)).
        """
        B, A, H = anchor_emb.shape
        L = self.block_len
        x = self.mask_embedding.expand(B, A, L, H).clone()  # [B, A, L, H]
        x[:, :, 0] = anchor_emb.to(self.dtype)
        x = x.flatten(1, 2)  # [B, A·L, H]
        pos = block_positions(anchor_pos, L)  # [B, A·L]
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, pos, kv, mask, self.rotary)
        h = self.norm(x).view(B, A, L, H)
        return h[:, :, self.offset : self.offset + self.gamma]  # [B, A, γ, H]

    def decode_block(self, h: torch.Tensor, U: torch.Tensor, x0: int, pick: Pick) -> DraftBlock:
        """DFlash drafts are independent given the block: logits_k = U_k. h: [γ, H], U: [γ, V]."""
        tokens = torch.tensor([pick(k, U[k]) for k in range(U.shape[0])], dtype=torch.long)
        return DraftBlock(tokens, U, None)


def lm_logits(target: Target, h: torch.Tensor) -> torch.Tensor:
    """U = target LM head (frozen, shared) on drafter states: [..., H] -> [..., V] float32."""
    w_dtype = target.model.get_output_embeddings().weight.dtype
    return target.lm_head(h.to(w_dtype)).float()


def resolve_feature_layers(cfg: DrafterConfig, target: Target) -> tuple[int, ...]:
    """Fill cfg.feature_layers with the target's default (DESIGN 3) when empty, so checkpoints record them."""
    if not cfg.feature_layers:
        cfg.feature_layers = target.default_feature_layers()
    return cfg.feature_layers


# --------------------------------------------------------------------------- training
@dataclass
class TeacherForced:
    """All sampled blocks of a batch after one backbone pass. Index [b, a, k-1] = draft k of anchor a."""

    h: torch.Tensor  # [B, A, γ, H] draft-slot hidden states
    gold: torch.Tensor  # [B, A, γ] x_{t+k}, the token draft k should predict
    prev: torch.Tensor  # [B, A, γ] x_{t+k-1} (ground truth; x_t = the anchor for k = 1)
    src: torch.Tensor  # [B, A, γ] t+k-1: where the target's own distribution p_t for x_{t+k} is read
    valid: torch.Tensor  # [B, A, γ] bool: a real anchor, t+k inside the sequence, an assistant token

    def k_idx(self) -> torch.Tensor:
        """[N] 0-based block index of every valid position (flattened like `x[self.valid]`)."""
        return torch.arange(self.gold.shape[-1], device=self.gold.device).expand_as(self.gold)[self.valid]


def teacher_forced_blocks(
    model: DFlashModel, batch: Batch, target: Target, cfg: DrafterConfig, generator: torch.Generator | None
) -> TeacherForced:
    """Sample anchors, then run every block of every sequence in ONE backbone forward (DESIGN 6)."""
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
    c = model.context(batch.features)  # [B, T, H]
    ctx = model.context_kv(c, torch.arange(T, device=ids.device).expand(B, T))
    anchor_emb = target.embed(ids.gather(1, anchors.pos))  # [B, A, H]
    mask = block_attention_mask(anchors.pos, T, model.block_len)  # [B, A·L, T + A·L]
    h = model.backbone(ctx, anchor_emb, anchors.pos, mask)  # [B, A, γ, H]
    return TeacherForced(h=h, gold=gather(ids), prev=prev, src=src, valid=valid)


class DFlashStrategy(Strategy):
    """DFlash: position-weighted cross-entropy against the hard next tokens (DESIGN 6)."""

    method = "dflash"

    def build(self, cfg: DrafterConfig, target: Target) -> DFlashModel:
        resolve_feature_layers(cfg, target)
        return DFlashModel(cfg, LayerShape.from_hf(target.model.config, cfg.qk_norm))

    def loss(self, model, batch: Batch, target: Target, cfg: DrafterConfig, generator) -> LossOutput:
        tf = teacher_forced_blocks(model, batch, target, cfg, generator)
        k_idx, gold = tf.k_idx(), tf.gold[tf.valid]  # [N], [N]
        logits = lm_logits(target, tf.h[tf.valid])  # [N, V] U_k
        w = position_weights(cfg.gamma, cfg.loss_decay, logits.device)
        ce = weighted_mean(F.cross_entropy(logits, gold, reduction="none"), k_idx, w)
        metrics = {"ce": ce.item(), **accuracy_at_k(logits.argmax(-1), gold, k_idx, cfg.gamma)}
        return LossOutput(loss=ce, tokens=int(gold.numel()), metrics=metrics)

    def drafter(self, model: DFlashModel, cfg: DrafterConfig, target: Target) -> "DFlashDrafter":
        return DFlashDrafter(model, cfg, target)


# --------------------------------------------------------------------------- inference
class DFlashDrafter(TrainedDrafter):
    """Inference wrapper (also serves DSpark: the model's decode_block adds its heads).

    Keeps the per-layer context K/V of every committed position except the anchor and appends
    only the newly committed positions after each verification, so a round's context cost is
    O(new tokens); the block itself (γ or γ + 1 queries) is one small forward.
    """

    def __init__(self, model: DFlashModel, cfg: DrafterConfig, target: Target) -> None:
        super().__init__(model, cfg, target)
        self.ctx: list[KV] = []
        self.ctx_len = 0

    @torch.inference_mode()
    def _append(self, features: torch.Tensor) -> None:
        """features: [n, n_feat, H] of the next n committed positions -> extend the context K/V."""
        n = features.shape[0]
        pos = torch.arange(self.ctx_len, self.ctx_len + n, device=features.device)[None]  # [1, n]
        new = self.model.context_kv(self.model.context(features[None]), pos)
        self.ctx = new if not self.ctx else [old.append(kv) for old, kv in zip(self.ctx, new)]
        self.ctx_len += n

    def begin(self, prompt_ids: list[int], step: TargetStep) -> None:
        self.ctx, self.ctx_len = [], 0
        self._append(step.features[0])  # [P, n_feat, H]

    def observe(self, verification, step: TargetStep) -> None:
        self._append(step.features[0])  # [n_accepted + 1, n_feat, H]: old anchor + accepted drafts

    @torch.inference_mode()
    def draft_states(self, tokens: list[int], g: int) -> torch.Tensor:
        """One backbone pass over the block [x_t, m, ..] at t = len(tokens) - 1 -> h: [g, H].

        The full trained block always runs (attention inside it is bidirectional); the first g
        draft slots are kept.
        """
        t = len(tokens) - 1  # the anchor's position; context = positions 0..t-1
        assert self.ctx_len == t, f"drafter context holds {self.ctx_len} positions, anchor is at {t}"
        dev = self.target.model.device
        pos = torch.tensor([[t]], device=dev)
        mask = block_attention_mask(pos, t, self.model.block_len)  # [1, L, t + L], all visible
        anchor_emb = self.target.embed(torch.tensor([[tokens[-1]]], device=dev))  # [1, 1, H]
        return self.model.backbone(self.ctx, anchor_emb, pos, mask)[0, 0, :g]

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        g = min(gamma, self.cfg.gamma)
        if g <= 0:
            return Proposal.empty()
        # 1. Backbone states and logits U_k of the first g drafts.
        h = self.draft_states(tokens, g)  # [g, H]
        U = lm_logits(self.target, h)  # [g, V]
        # 2. Left-to-right choice of x_k (DSpark adds the Markov bias and c_k inside decode_block).
        if params.greedy:
            pick: Pick = lambda k, logits: int(logits.argmax())  # noqa: E731
        else:
            pick = lambda k, logits: int(sample(probs_from_logits(logits, params), generator))  # noqa: E731
        block = self.model.decode_block(h, U, tokens[-1], pick)
        # 3. q_k is exactly what x_k was sampled from (one-hot when greedy: q = None).
        q = None if params.greedy else probs_from_logits(block.logits, params)
        return Proposal(tokens=block.tokens, q=q, confidences=block.confidences)


DFLASH = register_strategy(DFlashStrategy())
