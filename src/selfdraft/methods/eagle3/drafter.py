"""EAGLE-3 inference (docs/methods/eagle3.md): a chain of γ drafts, or an EAGLE-2 dynamic draft tree."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from selfdraft.config import SamplingParams
from selfdraft.drafters.base import Proposal, TrainedDrafter
from selfdraft.drafters.layers import KV
from selfdraft.methods.eagle3.config import Eagle3Config
from selfdraft.methods.eagle3.model import Eagle3Model
from selfdraft.sampling import probs_from_logits, process_logits, sample
from selfdraft.scheduler import TreeRule
from selfdraft.target import Target, TargetStep
from selfdraft.tree import conditionals, keep_best


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

    def __init__(self, model: Eagle3Model, cfg: Eagle3Config, target: Target) -> None:
        super().__init__(model, cfg, target)
        self.ctx: KV | None = None
        self.ctx_len = 0
        self.pending: torch.Tensor | None = None  # [n, H] fused features of slots not yet cached

    @property
    def drafts_trees(self) -> bool:
        return bool(self.cfg.tree_depth)

    def block_rows(self, gamma: int) -> int:
        return self.cfg.tree_total_tokens if self.drafts_trees else gamma + 1

    def set_tree(self, depth: int | None = None, top_k: int | None = None, total_tokens: int | None = None) -> None:
        """Switch to EAGLE-2 tree drafting (depth 0 = chain), validated like the config; None keeps the
        config's value (depth: the config's tree depth, else γ)."""
        self.cfg = replace(self.cfg, tree_depth=(self.cfg.tree_depth or self.cfg.gamma) if depth is None else depth,
                           tree_top_k=top_k or self.cfg.tree_top_k, tree_total_tokens=total_tokens or self.cfg.tree_total_tokens)

    @torch.inference_mode()
    def begin(self, prompt_ids: list[int], step: TargetStep) -> None:
        self.ctx, self.ctx_len = self.model.empty_kv(1, step.features.device), 0
        self.pending = self.model.fuse(step.features[0])  # [P, H]

    @torch.inference_mode()
    def observe(self, verification, step: TargetStep) -> None:
        self.pending = torch.cat([self.pending, self.model.fuse(step.features[0])])  # + old anchor, accepted

    def _emb(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Token ids (a list, or a tensor already on the device: a draft) -> [1, Q, H]."""
        ids = tokens.view(1, -1) if isinstance(tokens, torch.Tensor) else torch.tensor([tokens], device=self.target.model.device)
        return self.target.embed(ids)  # [1, Q, H]

    def _flush(self, tokens: list[int]) -> torch.Tensor:
        """Cache the pending slots t (their next token x_{t+1} is known now) -> h [H] of the last slot,
        whose output drafts the token after the anchor."""
        n = self.pending.shape[0]
        t0 = self.ctx_len
        pos = torch.arange(t0, t0 + n, device=self.pending.device)[None]
        causal = torch.ones(n, t0 + n, dtype=torch.bool, device=self.pending.device).tril(t0)[None]
        h, kv = self.model.step(self._emb(tokens[t0 + 1 : t0 + n + 1]), self.pending[None], pos, self.ctx, causal)
        self.ctx, self.ctx_len, self.pending = self.ctx.append(kv), t0 + n, self.pending[:0]
        return h[0, -1]

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[n] draft-vocab logits -> [V] logits (-inf outside the draft vocabulary)."""
        full = logits.new_full((self.target.vocab_size,), float("-inf"))
        return full.index_put_((self.model.target_ids,), logits)

    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator) -> Proposal:
        return self.propose_tree(tokens, gamma, params, generator, None)

    @torch.inference_mode()
    def propose_tree(self, tokens: list[int], gamma: int, params: SamplingParams, generator,
                     rule: TreeRule | None) -> Proposal:
        """A chain, or a tree grown only along paths the scheduler's rule would verify (`build_tree`)."""
        assert self.ctx_len + self.pending.shape[0] == len(tokens) - 1, "drafter out of sync with the tokens"
        h = self._flush(tokens)  # 1. cache the newly committed slots
        if gamma <= 0:
            return Proposal.empty()
        if self.cfg.tree_depth:
            return self.build_tree(h, tokens[-1], min(gamma, self.cfg.tree_depth), rule).keep(rule)
        # 2. Chain: γ head steps, each fed the previous output and the previous draft. A draft stays
        #    on the device (a 0-dim tensor) unless penalties need it on the host: greedy drafting does
        #    not wait for the GPU until the proposal is copied out.
        drafts, qs, kv = [], [], self.ctx
        seen = self.generated(tokens)
        for k in range(gamma):
            logits = self._to_target(self.model.draft_logits(h))  # [V]
            if params.has_processors:  # penalties, logit_bias
                logits = process_logits(logits[None], params, [seen + [int(x) for x in drafts]])[0]
            q = probs_from_logits(logits, params)
            x = q.argmax() if params.greedy else sample(q, generator)  # [] on q's device
            drafts.append(x), qs.append(q)
            if k + 1 < gamma:
                pos = torch.tensor([[self.ctx_len + k]], device=h.device)
                see_all = torch.ones(1, 1, kv.k.shape[2] + 1, dtype=torch.bool, device=h.device)
                out, new = self.model.step(self._emb(x), h[None, None], pos, kv, see_all)
                h, kv = out[0, -1], kv.append(new)
        q = None if params.greedy else torch.stack(qs)
        return Proposal(torch.stack(drafts).long(), q)

    def build_tree(self, h: torch.Tensor, anchor: int, depth: int, rule: TreeRule | None = None) -> Proposal:
        """EAGLE-2 dynamic tree: expand the top-k children of each frontier node, score nodes by the
        cumulative draft log-prob, keep the global top-k per depth as the next frontier; finally keep
        the best total_tokens - 1 nodes (an ancestor-closed set: a child never outscores its parent,
        ties go to the shallower node). Children are deterministic (q one-hot: the sibling rule).

        rule (the scheduler's, Scheduler.tree_rule): a frontier node is expanded only if the rule
        would verify it in the tree grown so far. Its descendants' a_i never exceed its own, so a
        node the rule cuts rarely has a descendant worth verifying: each head step (one per depth,
        the cost of a tree here) is paid only where the scheduler could use it."""
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

        def worth(frontier: list[int]) -> list[int]:  # the frontier nodes the rule would verify now
            if rule is None:
                return frontier
            parent_of = [n.parent for n in nodes]
            kept = set(rule(torch.tensor(parent_of), conditionals([n.score for n in nodes], parent_of, range(len(nodes)))))
            return [f for f in frontier if f in kept]

        frontier = worth(add_children(-1, h, 0.0, 1))
        for d in range(1, depth):
            if not frontier:
                break
            # 1. One head step over the frontier (position ctx_len + d - 1), each node seeing its ancestors.
            F_ = frontier
            g = torch.stack([outs.get(nodes[f].parent, h) for f in F_])[None]  # [1, |F|, H]
            pos = torch.full((1, len(F_)), self.ctx_len + d - 1, device=h.device)
            anc = [[e in nodes[f].ancestors for e in expanded] for f in F_]
            mask = frontier_mask(anc, kv.k.shape[2] - len(expanded), len(expanded), h.device)
            out, new = self.model.step(self._emb([nodes[f].token for f in F_]), g, pos, kv, mask)
            kv, expanded = kv.append(new), expanded + F_
            # 2. Children of every frontier node; the global top-k by cumulative score is the next frontier.
            cands = []
            for i, f in enumerate(F_):
                outs[f] = out[0, i]
                cands += add_children(f, out[0, i], nodes[f].score, d + 1)
            frontier = worth(sorted(cands, key=lambda c: -nodes[c].score)[:k])
        # 3. Rerank: the best total_tokens - 1 nodes, then topological order (depth, then rank).
        scores, parent_of = [n.score for n in nodes], [n.parent for n in nodes]
        keep, parents = keep_best(scores, [n.depth for n in nodes], parent_of, self.cfg.tree_total_tokens)
        return Proposal(torch.tensor([nodes[c].token for c in keep], dtype=torch.long), parents=parents,
                        confidences=conditionals(scores, parent_of, keep))


def frontier_mask(ancestors: list[list[bool]], cached: int, expanded: int, device: torch.device) -> torch.Tensor:
    """[1, F, cached + expanded + F] bool for one tree step over F frontier nodes: every committed slot,
    the expanded nodes on each node's own path (ancestors[f][e]), and the node itself. Built on the
    device the head runs on (the attention mask must live with q, k and v)."""
    n = len(ancestors)
    anc = torch.tensor(ancestors, dtype=torch.bool, device=device).reshape(n, expanded)
    return torch.cat([torch.ones(n, cached, dtype=torch.bool, device=device), anc,
                      torch.eye(n, dtype=torch.bool, device=device)], dim=1)[None]
