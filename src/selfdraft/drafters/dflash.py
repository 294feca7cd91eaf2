"""DFlash: a block-parallel drafter on the target's fused hidden states (docs/methods/dflash.md).

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

from selfdraft.config import ConfigError, DrafterConfig, SamplingParams
from selfdraft.drafters.base import Proposal, TrainedDrafter, TrainedMethod, default_feature_layers, register_trained
from selfdraft.drafters.blocks import block_attention_mask, block_positions
from selfdraft.drafters.layers import KV, InjectedDecoderLayer, LayerShape, RMSNorm, Rotary
from selfdraft.sampling import block_contexts, probs_from_logits, process_logits, sample
from selfdraft.target import Target, TargetStep, lm_logits

Pick = Callable[[int, torch.Tensor], int]  # (k, logits_k [V]) -> chosen draft token x_k
PickMany = Callable[[int, torch.Tensor], torch.Tensor]  # (k, logits_k [R, V]) -> x_k [R] for R blocks at once


@dataclass
class DraftBlock:
    """One round's serial decode of a block (inference, or teacher-forced replay in tests)."""

    tokens: torch.Tensor  # [γ] int64 x_1..x_γ ([R, γ] when R blocks are decoded together)
    logits: torch.Tensor  # [γ, V] float32 the logits each x_k was chosen from ([R, γ, V])
    confidences: torch.Tensor | None  # [γ] c_k ([R, γ]), or None without a confidence head


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
        if cfg.mask_token_id < 0:
            self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)  # learnable, not a vocab token
        else:  # the target's embedding row of mask_token_id (vLLM's layout): filled by attach_target, not saved
            self.register_buffer("mask_embedding", torch.zeros(H), persistent=False)
        # [V'] ascending target ids the LM head and losses run over (cfg.loss_vocab_size); None = all V
        n = cfg.loss_vocab_size
        self.register_buffer("draft_ids", torch.zeros(n, dtype=torch.long) if n else None)
        self.layers = nn.ModuleList(InjectedDecoderLayer(shape) for _ in range(cfg.num_layers))
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

    def decode_blocks(
        self, h: torch.Tensor, U: torch.Tensor, x0: torch.Tensor, pick: PickMany, vocab: torch.Tensor | None = None
    ) -> DraftBlock:
        """DFlash drafts are independent given the block: logits_k = U_k. h: [R, γ, H], U: [R, γ, V'], x0: [R].

        vocab: [V'] target ids when U covers only a draft vocabulary (pick returns indices into it;
        the block's tokens are target ids, its logits stay over the V' columns)."""
        idx = torch.stack([pick(k, U[:, k]) for k in range(U.shape[1])], dim=1)  # [R, γ]
        return DraftBlock(idx if vocab is None else vocab[idx], U, None)

    def decode_block(self, h: torch.Tensor, U: torch.Tensor, x0: int, pick: Pick) -> DraftBlock:
        """One block (h: [γ, H], U: [γ, V]): `decode_blocks` with R = 1."""
        many = lambda k, logits: torch.tensor([pick(k, logits[0])])  # noqa: E731
        b = self.decode_blocks(h[None], U[None], torch.tensor([x0], device=h.device), many)
        return DraftBlock(b.tokens[0], b.logits[0], None if b.confidences is None else b.confidences[0])


def warm_start(model: "DFlashModel", cfg: DrafterConfig, target: Target) -> "DFlashModel":
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


def build_dflash(cfg: DrafterConfig, target: Target) -> DFlashModel:
    resolve_feature_layers(cfg, target)
    return warm_start(DFlashModel(cfg, LayerShape.from_hf(target.model.config, cfg.qk_norm)), cfg, target)


def resolve_feature_layers(cfg: DrafterConfig, target: Target) -> tuple[int, ...]:
    """Fill cfg.feature_layers with the target's default (docs/architecture.md#feature-layers) when empty, so checkpoints record them."""
    if not cfg.feature_layers:
        cfg.feature_layers = target.default_feature_layers()
    return cfg.feature_layers


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
        self.gives_confidences = getattr(model, "confidence", None) is not None  # DSpark's head
        self.vocab: torch.Tensor | None = None  # [V'] draft vocabulary (target ids), None = all V
        self.lm_rows: torch.Tensor | None = None  # [H, V'] the target's LM-head rows of self.vocab, transposed
        if self.model.draft_ids is not None:  # trained over a draft vocabulary: draft among it
            self.restrict_vocab(self.model.draft_ids)

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Draft only among `ids` ([V'] target ids, e.g. the 8,192 most frequent answer tokens, which
        cover ~99 % of them). The LM head and Markov bias over V' rows instead of V are most of a
        draft round's cost. Lossless: q is exactly the distribution the drafts are drawn from (zero
        outside ids); only the target's mass outside ids can no longer be drafted."""
        V = self.target.vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long).unique()  # sorted
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ConfigError(f"a draft vocabulary needs target ids in [0, {V}), got {ids.numel()} ids")
        self.vocab = ids
        # stored [H, V'] contiguous: a few-row product with a row-major right operand is ~2x faster on CPU
        self.lm_rows = self.target.model.get_output_embeddings().weight[ids].detach().t().contiguous()

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

    def batch_key(self) -> tuple[int, int]:
        # copies of one loaded drafter share weights (and draft vocabulary): they draft together
        return id(self.model), id(self.vocab)

    @torch.inference_mode()
    def draft_states(self, tokens: list[int], g: int) -> torch.Tensor:
        """One backbone pass over the block [x_t, m, ..] at t = len(tokens) - 1 -> h: [g, H]."""
        return self.draft_states_many([self], [tokens])[0, :g]

    @staticmethod
    @torch.inference_mode()
    def draft_states_many(drafters: list["DFlashDrafter"], tokens: list[list[int]]) -> torch.Tensor:
        """R blocks in ONE backbone pass, each over its own context -> h: [R, γ, H].

        Contexts differ in length t_r: their K/V are right-padded to the longest and the block mask
        hides key s ≥ t_r from block r. The full trained block always runs (attention inside it is
        bidirectional).
        """
        model, target = drafters[0].model, drafters[0].target
        dev = target.model.device
        t = [len(x) - 1 for x in tokens]  # anchor positions; context = positions 0..t_r-1
        for d, t_r in zip(drafters, t):
            assert d.ctx_len == t_r, f"drafter context holds {d.ctx_len} positions, anchor is at {t_r}"
        T = max(t)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [1, n_kv, t_r, d] -> [1, n_kv, T, d]
            return F.pad(x, (0, 0, 0, T - x.shape[2]))

        ctx = [KV(torch.cat([pad(d.ctx[i].k) for d in drafters]), torch.cat([pad(d.ctx[i].v) for d in drafters]))
               for i in range(len(model.layers))]  # per layer [R, n_kv, T, d]
        pos = torch.tensor(t, device=dev)[:, None]  # [R, 1]
        mask = block_attention_mask(pos, T, model.block_len)  # [R, L, T + L]: context s < t_r
        anchor_emb = target.embed(torch.tensor([[x[-1]] for x in tokens], device=dev))  # [R, 1, H]
        return model.backbone(ctx, anchor_emb, pos, mask)[:, 0]  # [R, γ, H]

    def propose(
        self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return self.propose_many([self], [tokens], [gamma], [params], [generator])[0]

    @torch.inference_mode()
    def propose_until(self, tokens, gamma, params, generator, admission) -> Proposal:
        """DSpark: c_1 reads only h_1 and the anchor, so a round whose first draft is not worth
        verifying (most rounds on a CPU, where verifying 2 tokens costs ~1.6 decodes) skips the LM
        head and the Markov steps: only the backbone pass is paid."""
        if admission is None or not self.gives_confidences or min(gamma, self.cfg.gamma) < 1:
            return super().propose_until(tokens, gamma, params, generator, admission)
        h = DFlashDrafter.draft_states_many([self], [tokens])  # [1, γ, H]
        x0 = torch.tensor([tokens[-1]], device=h.device)
        if not admission.admit(float(self.model.confidence_at(h[:, 0], x0, 0)[0])):
            return Proposal.empty()
        p = DFlashDrafter.propose_many([self], [tokens], [gamma], [params], [generator], h=h)[0]
        return p.truncate(1 + admission.count(p.confidences[1:]))

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters, tokens, gammas, params, generators, h: torch.Tensor | None = None) -> list[Proposal]:
        """R requests' rounds in one backbone pass and one LM-head matmul; each request keeps its own
        γ_r, sampling parameters and generator (a request draws exactly the samples it would alone)."""
        live = [r for r, g in enumerate(gammas) if min(g, drafters[r].cfg.gamma) > 0]
        out = [Proposal.empty() for _ in drafters]
        if not live:
            return out
        model, target = drafters[live[0]].model, drafters[live[0]].target
        g = [min(gammas[r], drafters[r].cfg.gamma) for r in live]
        # 1. Backbone states and logits U_k of every live request's block.
        if h is None:  # h: [R', γ, H] given by propose_until
            h = DFlashDrafter.draft_states_many([drafters[r] for r in live], [tokens[r] for r in live])
        h = h[:, : max(g)]
        vocab, rows = drafters[live[0]].vocab, drafters[live[0]].lm_rows  # shared by a batch_key group
        U = lm_logits(target, h, rows)  # [R', γ, V'] (V' = V without a draft vocabulary)
        # 2. Left-to-right choice of x_k (DSpark adds the Markov bias and c_k inside decode_blocks);
        #    positions past a request's own γ_r are filled greedily and cut, drawing no randomness.

        all_greedy = all(params[r].greedy for r in live)
        # Logits processors (penalties, logit_bias) see each request's generated tokens plus its drafts so far.
        shown = {i: drafters[r].generated(tokens[r]) for i, r in enumerate(live) if params[r].has_processors}

        def pick(k: int, logits: torch.Tensor) -> torch.Tensor:  # [R', V] -> [R']
            if shown:
                logits = logits.clone()
                for i, seen in shown.items():
                    logits[i] = process_logits(logits[i : i + 1], params[live[i]], [seen], vocab, target.vocab_size)[0]
            if all_greedy:  # the common case: one batched argmax
                x = logits.argmax(-1)
            else:
                x = torch.stack([
                    logits[i].argmax() if params[r].greedy or k >= g[i]
                    else sample(probs_from_logits(logits[i], params[r]), generators[r])
                    for i, r in enumerate(live)
                ])
            for i, seen in shown.items():
                seen.append(int(x[i]) if vocab is None else int(vocab[x[i]]))
            return x

        x0 = torch.tensor([tokens[r][-1] for r in live], device=h.device)
        block = model.decode_blocks(h, U, x0, pick, vocab)
        # 3. q_k is exactly what x_k was sampled from (one-hot when greedy: q = None), over all V.
        for i, r in enumerate(live):
            q = None
            if not params[r].greedy:
                logits = block.logits[i, : g[i]]
                if i in shown:
                    ctx = block_contexts(drafters[r].generated(tokens[r]), block.tokens[i, : g[i]].tolist(), g[i])
                    logits = process_logits(logits, params[r], ctx, vocab, target.vocab_size)
                q = probs_from_logits(logits, params[r])
            if q is not None and vocab is not None:
                q = q.new_zeros(g[i], target.vocab_size).index_copy_(1, vocab, q)
            c = None if block.confidences is None else block.confidences[i, : g[i]]
            out[r] = Proposal(tokens=block.tokens[i, : g[i]], q=q, confidences=c)
        return out


register_trained(TrainedMethod("dflash", build_dflash, DFlashDrafter, default_feature_layers,
                               strategy="selfdraft.training.strategies.dflash:DFLASH"))
