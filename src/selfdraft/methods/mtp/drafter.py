"""MTP inference (docs/methods/mtp.md): chain drafting with the exact training computation, depth by depth."""

from __future__ import annotations

import torch

from selfdraft.config import SamplingParams
from selfdraft.drafters.base import Proposal, TrainedDrafter
from selfdraft.drafters.layers import KV
from selfdraft.methods.mtp.config import MTPConfig
from selfdraft.methods.mtp.model import MTPModel
from selfdraft.sampling import probs_from_logits, process_logits, sample
from selfdraft.target import Target, TargetStep


class MTPDrafter(TrainedDrafter):
    """Chain drafting with the exact training computation, depth by depth.

    With the anchor x_n known, depth d at slot i needs x_{i+d}: slots i <= n - d are committed and
    cached per depth (K/V and outputs), the last d - 1 slots n-d+1..n-1 are provisional: they read the
    drafts d_1..d_{d-1} and are recomputed every round. The draft d_d comes from h^d_{n-1}.
    """

    def __init__(self, model: MTPModel, cfg: MTPConfig, target: Target) -> None:
        super().__init__(model, cfg, target)
        self.feature_layers = ()  # MTP reads the final hidden state only
        self.h0: torch.Tensor | None = None  # [n, H] target final hidden states of the committed slots
        self.kv: dict[int, KV] = {}  # depth -> cached K/V of the committed slots
        self.outs: dict[int, torch.Tensor] = {}  # depth -> [c_d, H] committed h^d

    def begin(self, prompt_ids: list[int], step: TargetStep) -> None:
        self.h0 = step.last_hidden[0].to(self.model.dtype)
        self.kv, self.outs = {}, {}

    def observe(self, verification, step: TargetStep) -> None:
        self.h0 = torch.cat([self.h0, step.last_hidden[0].to(self.model.dtype)])

    def _run(self, d: int, slots: range, y: list[int], h_in: torch.Tensor, ctx: KV) -> tuple[torch.Tensor, KV]:
        """Depth d over `slots` (consecutive) after the cached ctx: inputs h_in [Q, H], tokens y[i + d]."""
        dev = self.h0.device
        ids = torch.tensor([[y[i + d] for i in slots]], device=dev)
        pos = torch.tensor([[i + d for i in slots]], device=dev)
        Tc, Q = ctx.k.shape[2], len(slots)
        mask = torch.ones(Q, Tc + Q, dtype=torch.bool, device=dev).tril(Tc)[None]
        h, kv = self.model.module(d)(self.target.embed(ids), h_in[None], pos, ctx, mask, self.model.rotary)
        return h[0], kv

    def _hidden(self, d: int, i: int, prov: dict[int, tuple[int, torch.Tensor]]) -> torch.Tensor:
        """h^d at slot i: the target's (d = 0), committed, or this round's provisional state."""
        if d == 0:
            return self.h0[i]
        if d in self.outs and i < self.outs[d].shape[0]:
            return self.outs[d][i]
        start, h = prov[d]
        return h[i - start]

    @torch.inference_mode()
    def propose(self, tokens: list[int], gamma: int, params: SamplingParams, generator) -> Proposal:
        n = len(tokens) - 1  # the anchor's position; h0 covers slots 0..n-1
        assert self.h0.shape[0] == n, f"drafter holds {self.h0.shape[0]} slots, the anchor is at {n}"
        g = min(gamma, self.model.depths)
        # 1. Cache the slots that became committed at depths 1..g (slot i needs x_{i+d}: i <= n - d).
        for d in range(1, g + 1):
            done = self.outs[d].shape[0] if d in self.outs else 0
            new = range(done, max(done, n - d + 1))
            if len(new):
                h_in = self.model.handoff(d - 1, torch.stack([self._hidden(d - 1, i, {}) for i in new]))
                ctx = self.kv.get(d, self.model.empty_kv(1, self.h0.device))
                h, kv = self._run(d, new, tokens, h_in, ctx)
                self.kv[d], self.outs[d] = ctx.append(kv), torch.cat([self.outs.get(d, h[:0]), h])
        # 2. Draft depth by depth; depth d's last d - 1 slots read the drafts so far (provisional).
        y, prov, qs = list(tokens), {}, []
        for d in range(1, g + 1):
            slots = range(max(0, n - d + 1), n)
            if d > 1:
                h_in = self.model.handoff(d - 1, torch.stack([self._hidden(d - 1, i, prov) for i in slots]))
                ctx = self.kv.get(d, self.model.empty_kv(1, self.h0.device))
                prov[d] = (slots.start, self._run(d, slots, y, h_in, ctx)[0])
            logits = self.model.logits(self.target, d, self._hidden(d, n - 1, prov))  # [V]
            logits = process_logits(logits[None], params, [self.generated(y)])[0]  # penalties, logit_bias (if any)
            q = probs_from_logits(logits, params)
            y.append(int(q.argmax()) if params.greedy else int(sample(q, generator)))
            qs.append(q)
        drafts = torch.tensor(y[n + 1 :], dtype=torch.long)
        return Proposal(drafts, None if params.greedy or not qs else torch.stack(qs))
