"""DFlash's module: a block-parallel drafter on the target's fused hidden states (docs/methods/dflash.md).

One forward of N decoder layers (as wide as the target) turns a block [anchor, mask, .., mask]
into γ draft logits U_1..U_γ at once. Every layer attends to the fused context
C = RMSNorm(fc([h_l1; ..; h_ln])) of the positions before the anchor via KV injection
(layers.py). Embedding and LM head are the target's own, frozen and not part of this module.

Layouts (cfg.anchor_as_first):
  False (DFlash): slots [x_t, m, .., m] (γ + 1); slot k predicts x_{t+k}, k = 1..γ.
  True  (DSpark): slots [x_t, m, .., m] (γ);     slot k - 1 predicts x_{t+k}.
Slot j sits at absolute position t + j; context keys keep their own positions 0..t-1.
With cfg.dense_first the first slot attends to the context and itself only: it is then the same
computation as a one-slot query at t, which training runs at every position (EAGLE-style density).
With cfg.context_residual every slot's input also gets W_s C_{t-1} (W_s zero at init): the last context
position enters the residual stream directly, as h_{t-1} does in EAGLE-3 and MTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from selfdraft.config import ConfigError
from selfdraft.drafters.blocks import block_positions
from selfdraft.drafters.layers import KV, InjectedDecoderLayer, LayerShape, RMSNorm, Rotary
from selfdraft.methods.dflash.config import DFlashConfig
from selfdraft.target import Target
from selfdraft.tree import conditionals, keep_best

Pick = Callable[[int, torch.Tensor], int]  # (k, logits_k [V]) -> chosen draft token x_k
PickMany = Callable[[int, torch.Tensor], torch.Tensor]  # (k, logits_k [R, V]) -> x_k [R] for R blocks at once


@dataclass
class DraftBlock:
    """One round's serial decode of a block (inference, or teacher-forced replay in tests)."""

    tokens: torch.Tensor  # [γ] int64 x_1..x_γ ([R, γ] when R blocks are decoded together)
    logits: torch.Tensor  # [γ, V] float32 the logits each x_k was chosen from ([R, γ, V])
    confidences: torch.Tensor | None  # [γ] c_k ([R, γ]), or None without a confidence head


@dataclass
class DraftTree:
    """One round's draft tree over a block (tree.py's layout: topological order, parents[i] < i)."""

    tokens: torch.Tensor  # [N] int64 target ids
    parents: torch.Tensor  # [N] int64 parent node index, -1 = a child of the anchor
    confidences: torch.Tensor  # [N] float32 q(node | parent): the scheduler's c_i


@dataclass
class Singles:
    """One-slot first-position queries of a training batch (dense_first): the block's first slot alone."""

    emb: torch.Tensor  # [B, D, H] target embedding of x_t
    pos: torch.Tensor  # [B, D] int64 t
    last_c: torch.Tensor | None  # [B, D, H] C_{t-1} (context_residual), else None
    h: torch.Tensor | None = None  # [B, D, H] final-normed h_1, filled by the backbone


class DFlashModel(nn.Module):
    """Trainable DFlash weights: context fusion, mask embedding, N injected layers, final norm."""

    def __init__(self, cfg: DFlashConfig, shape: LayerShape) -> None:
        super().__init__()
        self.gamma = cfg.gamma
        self.offset = 0 if cfg.anchor_as_first else 1  # slot of draft k is k - 1 + offset
        self.block_len = cfg.gamma + self.offset
        self.first_alone = cfg.dense_first  # the block mask's first slot sees only context and itself
        H = shape.hidden
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.context_norm = RMSNorm(H, shape.eps)
        if cfg.mask_token_id < 0:
            self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)  # learnable, not a vocab token
        else:  # the target's embedding row of mask_token_id (vLLM's layout): filled by attach_target, not saved
            self.register_buffer("mask_embedding", torch.zeros(H), persistent=False)
        # [V'] ascending target ids the LM head and losses run over (cfg.loss_vocab_size); None = all V
        n = cfg.loss_vocab_size
        self.register_buffer("draft_ids", torch.zeros(n, dtype=torch.long) if n else None)
        self.layers = nn.ModuleList(InjectedDecoderLayer(shape) for _ in range(cfg.num_layers))
        self.slot_context = nn.Linear(H, H, bias=False) if cfg.context_residual else None  # W_s
        self.next_token = nn.Linear(H, H, bias=False) if cfg.context_next_token else None  # W_e
        for lin in (self.slot_context, self.next_token):
            if lin is not None:
                nn.init.zeros_(lin.weight)
        self.norm = RMSNorm(H, shape.eps)
        self.rotary = Rotary(shape.head_dim, shape.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @torch.no_grad()
    def init_from_target(self, target: Target) -> None:
        """Warm start (cfg.init_from_target): draft layer i <- the target's layer L - N + i (same
        parameter names as HF Llama layers), final norm <- the target's; the fusion starts by passing
        the deepest feature layer through, normed as the first copied layer normed its input."""
        layers, norm = getattr(target.model.base_model, "layers", None), getattr(target.model.base_model, "norm", None)
        if layers is None or norm is None or len(layers) < len(self.layers):
            raise ConfigError("init_from_target needs a Llama-style target (base_model.layers and .norm)")
        src = list(layers)[-len(self.layers):]
        for mine, theirs in zip(self.layers, src):
            try:
                missing, unexpected = mine.load_state_dict(theirs.state_dict(), strict=False)
            except RuntimeError as e:
                raise ConfigError(f"init_from_target: the target's layers do not match a Llama layer: {e}") from None
            # q/k norms (qk_norm) have no counterpart in a Llama layer: they start at 1 (identity scale)
            extra = [k for k in missing if not k.endswith(("q_norm.weight", "k_norm.weight"))]
            if extra or unexpected:
                raise ConfigError(f"init_from_target: the target's layers do not match a Llama layer "
                                  f"(missing {extra}, unexpected {unexpected})")
        self.norm.weight.copy_(norm.weight)
        H = self.norm.weight.shape[0]
        self.fc.weight.zero_()
        self.fc.weight[:, -H:] = torch.eye(H)
        self.context_norm.weight.copy_(src[0].input_layernorm.weight)

    def context(self, features: torch.Tensor, next_emb: torch.Tensor | None = None) -> torch.Tensor:
        """features: [B, T, n_feat, H] target layer outputs, next_emb: [B, T, H] Emb(x_{s+1}) (context_next_token)
        -> C: [B, T, H]."""
        c = self.context_norm(self.fc(features.to(self.dtype).flatten(2)))
        return c if self.next_token is None else c + self.next_token(next_emb.to(self.dtype))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """C: [B, T, H] at positions [B, T] -> per layer K/V [B, n_kv, T, d] (block independent)."""
        return [layer.context_kv(c, positions, self.rotary) for layer in self.layers]

    def backbone(
        self, ctx: list[KV], anchor_emb: torch.Tensor, anchor_pos: torch.Tensor, mask: torch.Tensor,
        last_c: torch.Tensor | None = None, singles: Singles | None = None,
    ) -> torch.Tensor:
        """A blocks per sequence in one pass.

        ctx: per-layer context K/V; anchor_emb: [B, A, H] target embedding of x_t; anchor_pos:
        [B, A] t; mask: [B, A·L (+ D), Tc + A·L (+ D)] (blocks.block_attention_mask); last_c: [B, A, H]
        C_{t-1} (context_residual only; zero for t = 0) -> h: [B, A, γ, H] final-normed hidden states at
        the draft slots (U_k = lm_head(h_k)). singles (training, dense_first): D one-slot queries run in
        the same pass; their h_1 [B, D, H] is written to singles.h.
        """
        B, A, H = anchor_emb.shape
        L = self.block_len
        x = self.mask_embedding.expand(B, A, L, H).clone()  # [B, A, L, H]
        x[:, :, 0] = anchor_emb.to(self.dtype)
        if self.slot_context is not None:
            x = x + self.slot_context(last_c.to(self.dtype))[:, :, None]  # every slot: + W_s C_{t-1}
        x = x.flatten(1, 2)  # [B, A·L, H]
        pos = block_positions(anchor_pos, L)  # [B, A·L]
        if singles is not None:  # a first slot alone: x_t's embedding (+ W_s C_{t-1}) at position t
            first = singles.emb.to(self.dtype)  # [B, D, H]
            if self.slot_context is not None:
                first = first + self.slot_context(singles.last_c.to(self.dtype))
            x, pos = torch.cat([x, first], 1), torch.cat([pos, singles.pos], 1)  # [B, A·L + D, H], [B, A·L + D]
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, pos, kv, mask, self.rotary)
        x = self.norm(x)
        if singles is not None:
            singles.h = x[:, A * L :]  # [B, D, H]
        h = x[:, : A * L].view(B, A, L, H)
        return h[:, :, self.offset : self.offset + self.gamma]  # [B, A, γ, H]

    def decode_blocks(
        self, h: torch.Tensor, U: torch.Tensor, x0: torch.Tensor, pick: PickMany, vocab: torch.Tensor | None = None,
        admit=None,
    ) -> DraftBlock:
        """DFlash drafts are independent given the block: logits_k = U_k. h: [R, γ, H], U: [R, γ, V'], x0: [R].

        vocab: [V'] target ids when U covers only a draft vocabulary (pick returns indices into it;
        the block's tokens are target ids, its logits stay over the V' columns). admit: DSpark's
        (DFlash has no c_k to admit drafts by)."""
        if admit is not None:
            raise ValueError("DFlash gives no confidences c_k: the scheduler's online rule cannot stop its block")
        idx = torch.stack([pick(k, U[:, k]) for k in range(U.shape[1])], dim=1)  # [R, γ]
        return DraftBlock(idx if vocab is None else vocab[idx], U, None)

    def child_logits(self, h_k: torch.Tensor, U_k: torch.Tensor, prev: torch.Tensor, s: torch.Tensor | None,
                     vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the children of F tree nodes at block position k: h_k [H], U_k [V'], prev [F] the
        nodes' tokens, s their recurrent state -> ([F, V'], the children's state). DFlash's drafts are
        independent given the block, so every node's children share U_k; DSpark adds its Markov bias."""
        return U_k.expand(prev.shape[0], -1), None

    def tree_state(self, h: torch.Tensor) -> torch.Tensor | None:
        """The anchor's recurrent state ([1, r] in h's dtype for DSpark's rnn head; None otherwise)."""
        return None

    @torch.no_grad()
    def decode_tree(self, h: torch.Tensor, U: torch.Tensor, x0: int, top_k: int, total: int,
                    vocab: torch.Tensor | None = None) -> DraftTree:
        """EAGLE-2's dynamic tree (Li et al. 2024, §4) over one block: h [g, H], U [g, V'] float32 the
        backbone logits of depths 1..g, x0 the anchor. A node's score is its path's Σ log q; per depth k:
        1. children of the frontier: the top_k of log softmax(child_logits) of each node;
        2. the next frontier: the global top_k children by score.
        3. Keep the best total - 1 nodes (ancestor-closed: a child never outscores its parent, ties go
           to the shallower node), in topological order (depth, then score).
        One backbone pass serves the whole tree: only the Markov step (rank r) runs per node."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depth: list[int] = []
        frontier = torch.tensor([-1])  # node indices (-1 = the anchor)
        prev = torch.tensor([x0], device=h.device)  # [F] the frontier's tokens
        score = torch.zeros(1, device=h.device)  # [F]
        s = self.tree_state(h)
        for k in range(h.shape[0]):
            logits, s = self.child_logits(h[k], U[k], prev, s, vocab)  # [F, V']
            top = torch.log_softmax(logits, -1).topk(min(top_k, logits.shape[-1]))  # [F, k']
            cand = (score[:, None] + top.values).flatten()  # [F·k']
            ids = top.indices.flatten() if vocab is None else vocab[top.indices.flatten()]  # target ids
            base = len(tokens)
            tokens += ids.tolist()
            scores += cand.tolist()
            parents += frontier.repeat_interleave(top.values.shape[1]).tolist()
            depth += [k + 1] * cand.numel()
            best = cand.topk(min(top_k, cand.numel())).indices  # [F'] into this depth's children
            frontier, prev, score = base + best.cpu(), ids[best], cand[best]
            s = None if s is None else s[best // top.values.shape[1]]
        keep, kept_parents = keep_best(scores, depth, parents, total)
        return DraftTree(torch.tensor([tokens[c] for c in keep], dtype=torch.long), kept_parents, conditionals(scores, parents, keep))

    def decode_block(self, h: torch.Tensor, U: torch.Tensor, x0: int, pick: Pick) -> DraftBlock:
        """One block (h: [γ, H], U: [γ, V]): `decode_blocks` with R = 1."""
        many = lambda k, logits: torch.tensor([pick(k, logits[0])], device=logits.device)  # noqa: E731  (x_k feeds the next step)
        b = self.decode_blocks(h[None], U[None], torch.tensor([x0], device=h.device), many)
        return DraftBlock(b.tokens[0], b.logits[0], None if b.confidences is None else b.confidences[0])


def warm_start(model: "DFlashModel", cfg: DFlashConfig, target: Target) -> "DFlashModel":
    """Attach what the module takes from the target (a mask embedding row), then the optional warm start."""
    V = target.vocab_size
    if cfg.mask_token_id >= V or cfg.loss_vocab_size > V:
        raise ConfigError(f"mask_token_id ({cfg.mask_token_id}) and loss_vocab_size ({cfg.loss_vocab_size}) "
                          f"must not exceed the target's vocabulary ({V} tokens; mask ids below it)")
    if cfg.mask_token_id >= 0:
        with torch.no_grad():
            row = target.embed(torch.tensor([cfg.mask_token_id], device=target.model.device))[0]
            model.mask_embedding.copy_(row.float())
    if cfg.init_from_target:
        model.init_from_target(target)
    return model


def build_dflash(cfg: DFlashConfig, target: Target) -> DFlashModel:
    return warm_start(DFlashModel(cfg, LayerShape.from_hf(target.model.config, cfg.qk_norm)), cfg, target)
