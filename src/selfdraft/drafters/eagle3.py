"""EAGLE-3: a one-layer autoregressive head on fused target features (docs/methods/eagle3.md).

Slot t (a committed position) feeds the head g_t = fc([h_low; h_mid; h_high]_t) (3H -> H, no bias)
and the embedding of the next token x_{t+1}; the head's output predicts x_{t+2}. The decoder layer's
attention reads the 2H concatenation [RMSNorm(emb); RMSNorm(g)], its residual is g; a final norm
and the head's own LM head over a reduced draft vocabulary give draft logits (speculators
convention: target_id = draft_id + d2t[draft_id], t2d marks the draft tokens in the target vocab).

Drafting: the head's (pre-norm) output replaces g for the next step while the input token is the
previous draft; step j sits at position t + j and attends to the committed context plus its own
earlier steps. Training-time test (TTT) unrolls γ such steps on ground-truth tokens with the mask
of training.masks.ttt_attention_mask, so training sees exactly what inference does; loss Σ_j 0.8^j L_j,
L_j = soft cross-entropy against the target distribution restricted to the draft vocabulary.
Inference: a chain of γ drafts, or an EAGLE-2 dynamic tree (`build_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from selfdraft.config import ConfigError, DrafterConfig, SamplingParams
from selfdraft.drafters.base import Proposal, TrainedDrafter, TrainedMethod, register_trained
from selfdraft.drafters.layers import KV, MLP, InjectedAttention, LayerShape, RMSNorm, Rotary
from selfdraft.sampling import probs_from_logits, process_logits, sample
from selfdraft.target import Target, TargetStep


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low / mid / high = [1, L/2 - 1, L - 4] (docs/architecture.md#feature-layers), deduplicated for very shallow targets."""
    return tuple(sorted({1, num_layers // 2 - 1, num_layers - 4} & set(range(num_layers - 1)))) or (0,)


class WideAttention(InjectedAttention):
    """GQA attention whose q/k/v projections read the 2H input [RMSNorm(emb); RMSNorm(g)]."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__(s)
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: attention over [RMSNorm(emb); RMSNorm(g)], residual g, SwiGLU MLP."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)  # on the token embedding
        self.hidden_norm = RMSNorm(s.hidden, s.eps)  # on g (fused feature or the head's own output)
        self.self_attn = WideAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)

    def forward(
        self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, KV]:
        """emb, g: [B, Q, H], positions: [B, Q], ctx: K/V [B, n_kv, Tc, d], mask: [B, Q, Tc+Q] bool
        -> (h [B, Q, H] the pre-norm output, the K/V [B, n_kv, Q, d] of these Q positions)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g.to(emb.dtype))], dim=-1)  # [B, Q, 2H]
        h = g + self.self_attn(x, positions, ctx, mask, rotary)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, self.self_attn.kv(x, positions, rotary)


class Eagle3Model(nn.Module):
    """Trainable EAGLE-3 weights; d2t / t2d are buffers, so the draft vocabulary travels in the checkpoint."""

    def __init__(self, cfg: DrafterConfig, shape: LayerShape, vocab_size: int) -> None:
        super().__init__()
        H, n = shape.hidden, cfg.draft_vocab_size
        self.shape = shape
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.layer = Eagle3Layer(shape)
        self.norm = RMSNorm(H, shape.eps)
        self.lm_head = nn.Linear(H, n, bias=False)
        self.rotary = Rotary(shape.head_dim, shape.rope_theta)
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))  # [n] placeholder: target ids 0..n-1
        self.register_buffer("t2d", torch.arange(vocab_size) < n)  # [V]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def target_ids(self) -> torch.Tensor:
        """[n] target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor, target: Target) -> None:
        """Install a draft vocabulary (vocab.DraftVocab) and start the head from the target's
        LM-head rows of those tokens (copied, never shared)."""
        if d2t.numel() != self.d2t.numel() or t2d.numel() != self.t2d.numel():
            raise ConfigError(f"draft vocab of size {d2t.numel()}/{t2d.numel()} does not fit {self.d2t.numel()}/{self.t2d.numel()}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        w = target.model.get_output_embeddings().weight
        self.lm_head.weight.copy_(w[self.target_ids.to(w.device)].to(self.lm_head.weight))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n_feat, H] target feature-layer outputs -> g [..., H]."""
        return self.fc(features.to(self.dtype).flatten(-2))

    def step(self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, ctx: KV, mask: torch.Tensor):
        """One head step over Q slots (Eagle3Layer.forward) -> (h [B, Q, H], K/V of the Q slots)."""
        return self.layer(emb.to(self.dtype), g, positions, ctx, mask, self.rotary)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., n] float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(h)).float()

    def empty_kv(self, batch: int, device) -> KV:
        z = torch.zeros(batch, self.shape.kv_heads, 0, self.shape.head_dim, device=device, dtype=self.dtype)
        return KV(z, z)


# --------------------------------------------------------------------------- inference
@dataclass
class TreeNode:
    token: int  # target id
    parent: int  # node index, -1 = the anchor
    depth: int  # 1 = a child of the anchor
    score: float  # cumulative draft log-probability of the path
    ancestors: frozenset[int]  # node indices on the path, itself included


class Eagle3Drafter(TrainedDrafter):
    """Chain or EAGLE-2 tree drafting (cfg.tree_depth > 0) with a KV cache over the committed context.

    Committed slot t (input g_t, x_{t+1}) enters the cache once x_{t+1} is known: after begin/observe
    the features wait in `pending` until the next propose brings the new anchor. Draft steps attend
    to the cache plus their own ancestors and are never cached (real features replace them).
    """

    def __init__(self, model: Eagle3Model, cfg: DrafterConfig, target: Target) -> None:
        super().__init__(model, cfg, target)
        self.ctx: KV | None = None
        self.ctx_len = 0
        self.pending: torch.Tensor | None = None  # [n, H] fused features of slots not yet cached

    @property
    def drafts_trees(self) -> bool:
        return bool(self.cfg.tree_depth)

    def set_tree(self, depth: int, top_k: int = 10, total_tokens: int = 60) -> None:
        """Switch to EAGLE-2 tree drafting (depth 0 = chain), validated like the config."""
        self.cfg = replace(self.cfg, tree_depth=depth, tree_top_k=top_k, tree_total_tokens=total_tokens)

    @torch.inference_mode()
    def begin(self, prompt_ids: list[int], step: TargetStep) -> None:
        self.ctx, self.ctx_len = self.model.empty_kv(1, step.features.device), 0
        self.pending = self.model.fuse(step.features[0])  # [P, H]

    @torch.inference_mode()
    def observe(self, verification, step: TargetStep) -> None:
        self.pending = torch.cat([self.pending, self.model.fuse(step.features[0])])  # + old anchor, accepted

    def _emb(self, tokens: list[int]) -> torch.Tensor:
        return self.target.embed(torch.tensor([tokens], device=self.target.model.device))  # [1, Q, H]

    def _flush(self, tokens: list[int]) -> torch.Tensor:
        """Cache the pending slots t (their next token x_{t+1} is known now) -> h [H] of the last slot,
        whose output drafts the token after the anchor."""
        n = self.pending.shape[0]
        t0 = self.ctx_len
        pos = torch.arange(t0, t0 + n, device=self.pending.device)[None]
        causal = torch.ones(n, t0 + n, dtype=torch.bool).tril(t0)[None]
        h, kv = self.model.step(self._emb(tokens[t0 + 1 : t0 + n + 1]), self.pending[None], pos, self.ctx, causal)
        self.ctx, self.ctx_len, self.pending = self.ctx.append(kv), t0 + n, self.pending[:0]
        return h[0, -1]

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[n] draft-vocab logits -> [V] logits (-inf outside the draft vocabulary)."""
        full = logits.new_full((self.target.vocab_size,), float("-inf"))
        return full.index_put_((self.model.target_ids,), logits)

    @torch.inference_mode()
    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator) -> Proposal:
        assert self.ctx_len + self.pending.shape[0] == len(tokens) - 1, "drafter out of sync with the tokens"
        h = self._flush(tokens)  # 1. cache the newly committed slots
        if gamma <= 0:
            return Proposal.empty()
        if self.cfg.tree_depth:
            return self.build_tree(h, tokens[-1], min(gamma, self.cfg.tree_depth))
        # 2. Chain: γ head steps, each fed the previous output and the previous draft.
        drafts, qs, kv = [], [], self.ctx
        seen = self.generated(tokens)
        for k in range(gamma):
            logits = self._to_target(self.model.draft_logits(h))  # [V]
            logits = process_logits(logits[None], params, [seen + drafts])[0]  # penalties, logit_bias (if any)
            q = probs_from_logits(logits, params)
            x = int(q.argmax()) if params.greedy else int(sample(q, generator))
            drafts.append(x), qs.append(q)
            if k + 1 < gamma:
                pos = torch.tensor([[self.ctx_len + k]], device=h.device)
                see_all = torch.ones(1, 1, kv.k.shape[2] + 1, dtype=torch.bool)
                out, new = self.model.step(self._emb([x]), h[None, None], pos, kv, see_all)
                h, kv = out[0, -1], kv.append(new)
        q = None if params.greedy else torch.stack(qs)
        return Proposal(torch.tensor(drafts, dtype=torch.long), q)

    def build_tree(self, h: torch.Tensor, anchor: int, depth: int) -> Proposal:
        """EAGLE-2 dynamic tree: expand the top-k children of each frontier node, score nodes by the
        cumulative draft log-prob, keep the global top-k per depth as the next frontier; finally keep
        the best total_tokens - 1 nodes (an ancestor-closed set: a child never outscores its parent,
        ties go to the shallower node). Children are deterministic (q one-hot: the sibling rule)."""
        k = min(self.cfg.tree_top_k, self.model.d2t.numel())
        nodes: list[TreeNode] = []
        expanded: list[int] = []  # node indices whose K/V are in `kv`, in order
        outs: dict[int, torch.Tensor] = {}  # node -> its head output (input g of its children)
        kv = self.ctx

        def add_children(parent: int, h_parent: torch.Tensor, base: float, d: int) -> list[int]:
            logp = torch.log_softmax(self.model.draft_logits(h_parent), -1)
            top = logp.topk(k)
            anc = nodes[parent].ancestors if parent >= 0 else frozenset()
            new = []
            for lp, i in zip(top.values.tolist(), top.indices.tolist()):
                new.append(len(nodes))
                tok = int(self.model.target_ids[i])
                nodes.append(TreeNode(tok, parent, d, base + lp, anc | {len(nodes)}))
            return new

        frontier = add_children(-1, h, 0.0, 1)
        for d in range(1, depth):
            # 1. One head step over the frontier (position ctx_len + d - 1), each node seeing its ancestors.
            F_ = frontier
            g = torch.stack([outs.get(nodes[f].parent, h) for f in F_])[None]  # [1, |F|, H]
            pos = torch.full((1, len(F_)), self.ctx_len + d - 1, device=h.device)
            anc = torch.tensor([[e in nodes[f].ancestors for e in expanded] for f in F_], dtype=torch.bool)
            anc = anc.reshape(len(F_), len(expanded))
            mask = torch.cat([torch.ones(len(F_), kv.k.shape[2] - len(expanded), dtype=torch.bool), anc,
                              torch.eye(len(F_), dtype=torch.bool)], dim=1)[None]  # fmt: skip
            out, new = self.model.step(self._emb([nodes[f].token for f in F_]), g, pos, kv, mask)
            kv, expanded = kv.append(new), expanded + F_
            # 2. Children of every frontier node; the global top-k by cumulative score is the next frontier.
            cands = []
            for i, f in enumerate(F_):
                outs[f] = out[0, i]
                cands += add_children(f, out[0, i], nodes[f].score, d + 1)
            frontier = sorted(cands, key=lambda c: -nodes[c].score)[:k]
        # 3. Rerank: the best total_tokens - 1 nodes, then topological order (depth, then rank).
        rank = sorted(range(len(nodes)), key=lambda c: (-nodes[c].score, nodes[c].depth, c))
        order = {c: r for r, c in enumerate(rank)}
        keep = sorted(rank[: self.cfg.tree_total_tokens - 1], key=lambda c: (nodes[c].depth, order[c]))
        new_index = {c: i for i, c in enumerate(keep)}
        parents = [new_index[nodes[c].parent] if nodes[c].parent >= 0 else -1 for c in keep]
        return Proposal(torch.tensor([nodes[c].token for c in keep], dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


def build_eagle3(cfg: DrafterConfig, target: Target) -> Eagle3Model:
    """A fresh module; empty feature layers get the method's default, an unset or too large draft
    vocabulary becomes the full one (d2t = 0, t2d all True)."""
    if not cfg.feature_layers:
        cfg.feature_layers = eagle3_feature_layers(target.num_layers)
    if not 0 < cfg.draft_vocab_size < target.vocab_size:
        cfg.draft_vocab_size = target.vocab_size
    model = Eagle3Model(cfg, LayerShape.from_hf(target.model.config, cfg.qk_norm), target.vocab_size)
    model.set_vocab(model.d2t, model.t2d, target)
    return model


register_trained(TrainedMethod("eagle3", build_eagle3, Eagle3Drafter, lambda target: eagle3_feature_layers(target.num_layers),
                               strategy="selfdraft.training.strategies.eagle3:EAGLE3"))
