"""The Drafter protocol, the Proposal it returns, and the shared setup of trained drafters.

A drafter reads the committed tokens (and, for self-drafters, the target's hidden states at
the committed positions) and proposes up to γ next tokens. Each method's drafter lives in its
package under selfdraft/methods/ (registered once in selfdraft.methods).
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfdraft.config import SamplingParams
from selfdraft.tree import prune_depth, subtree

if TYPE_CHECKING:
    from selfdraft.scheduler import Admission, TreeRule
    from selfdraft.target import Target, TargetStep
    from selfdraft.verify import Verification


@dataclass
class Proposal:
    """γ' <= γ draft tokens for one round."""

    tokens: torch.Tensor  # [γ'] int64
    q: torch.Tensor | None = None  # [γ', V] probabilities the drafts were sampled from; None = deterministic (one-hot)
    confidences: torch.Tensor | None = None  # [γ'] c_k ≈ P(draft k accepted | 1..k-1 accepted); a tree: | its parent accepted
    # A draft tree (EAGLE-2): parent index of each node (-1 = the anchor), parents[i] < i. Tree
    # drafts are deterministic (q is None): verification uses the sibling rule (docs/verification.md#the-sibling-rule, tree.py).
    parents: torch.Tensor | None = None  # [γ'] int64, None = a chain

    @classmethod
    def empty(cls) -> "Proposal":
        return cls(tokens=torch.zeros(0, dtype=torch.long))

    def cpu(self) -> "Proposal":
        """On the CPU, where verification samples with the request's CPU generator."""
        move = lambda t: None if t is None else t.cpu()  # noqa: E731
        return Proposal(self.tokens.cpu(), move(self.q), move(self.confidences), move(self.parents))

    def truncate(self, n: int) -> "Proposal":
        """Keep the first n drafts (a scheduler verifies only a prefix); a tree keeps depth <= n."""
        if self.parents is not None:
            return self.subtree(prune_depth(self.parents, n)[0].tolist())
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        return Proposal(self.tokens[:n], cut(self.q), cut(self.confidences))

    def keep(self, rule: "TreeRule | None") -> "Proposal":
        """A tree cut to the nodes `rule` chooses from its confidences (the scheduler's); chains,
        trees without confidences and rule None stay whole."""
        if rule is None or self.parents is None or self.confidences is None:
            return self
        return self.subtree(rule(self.parents, self.confidences))

    def subtree(self, keep: list[int]) -> "Proposal":
        """A tree's nodes `keep` (ascending, closed under ancestors), parents re-indexed."""
        conf = None if self.confidences is None else self.confidences[keep]
        return Proposal(self.tokens[keep], confidences=conf, parents=subtree(self.parents, keep))


class Drafter:
    """Base class. The decoding loop calls begin() once, then propose()/observe() every round."""

    name: str = "base"
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states this drafter reads
    prompt_len: int = 0  # set by the decoding loop after begin(): penalties count tokens[prompt_len:]
    gives_confidences: bool = False  # proposals carry c_k (a confidence head): a scheduler can use them
    drafts_trees: bool = False  # proposals are draft trees (no ℓ cut: the scheduler keeps nodes, Scheduler.tree_rule)

    def block_rows(self, gamma: int) -> int:
        """The most rows one round sends through the target forward: the anchor + γ drafts (a tree: its nodes)."""
        return gamma + 1

    def generated(self, tokens: list[int]) -> list[int]:
        """The generated part of `tokens` (prompt + output): what presence/frequency penalties count."""
        return tokens[self.prompt_len :]

    def begin(self, prompt_ids: list[int], step: "TargetStep") -> None:
        """After prefill: step holds the features of every prompt position ([1, P, n_feat, H])."""

    def propose(
        self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """tokens = prompt + generated so far (the last one is the anchor, not yet verified)."""
        raise NotImplementedError

    def propose_until(self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None,
                      admission: "Admission | None") -> Proposal:
        """propose(), cut at the first draft the scheduler's online rule refuses (None: keep all;
        no confidences: keep all, as the fixed scheduler does). A drafter that can tell c_k before
        drafting x_k overrides this to stop drafting there."""
        p = self.propose(tokens, gamma, params, generator)
        if admission is None or p.confidences is None or p.parents is not None:
            return p
        return p.truncate(admission.count(p.confidences))

    def propose_tree(self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None,
                     rule: "TreeRule | None") -> Proposal:
        """propose() (a draft tree), cut to the nodes the scheduler's rule verifies (None: all). A
        drafter that pays a step per depth overrides this to stop growing paths the rule would cut."""
        return self.propose(tokens, gamma, params, generator).keep(rule)

    def observe(self, verification: "Verification", step: "TargetStep") -> None:
        """After verification: step is sliced to the committed positions ([1, n_accepted + 1, ...]):
        the previous anchor and the accepted drafts. The new anchor is verification.next_token."""

    def end(self, generated: list[int]) -> None:
        """After the request's last round (any finish reason): its generated tokens. Drafters that
        learn from earlier responses (suffix's global tree) keep them here."""

    def forget(self) -> None:
        """Drop what earlier requests taught (a benchmark's warm-up must not warm the suffix tree)."""

    def batch_key(self) -> object | None:
        """Drafters with the same non-None key draft together in one `propose_many` call."""
        return None

    @staticmethod
    def propose_many(drafters, tokens, gammas, params, generators) -> list[Proposal]:
        """R rounds at once (the batched engine); a kind with batched weights overrides this."""
        return [d.propose(*a) for d, *a in zip(drafters, tokens, gammas, params, generators)]


def propose_all(
    drafters: list[Drafter], tokens: list[list[int]], gammas: list[int], params: list[SamplingParams],
    generators: list[torch.Generator | None], errors: dict[int, Exception] | None = None,
    tree_rule: "TreeRule | None" = None,
) -> list[Proposal]:
    """Every request's proposal, drafters sharing a `batch_key` in one batched call each; a tree
    drafter drafting alone grows its tree by the scheduler's `tree_rule` (Drafter.propose_tree).

    With `errors` given, a failing call does not raise: a batched group that fails is retried one
    request at a time from the generator states it started with (batched drafters keep no state in
    propose, so the retry draws what the request would have drawn), and a request whose own call
    fails gets errors[r] and an empty proposal. One request's bad input never fails the others.
    """
    groups: dict[object, list[int]] = {}
    for r, d in enumerate(drafters):
        key = d.batch_key()
        groups.setdefault(("alone", r) if key is None else key, []).append(r)
    out: list[Proposal] = [Proposal.empty()] * len(drafters)

    def call(idx: list[int]) -> None:
        d = drafters[idx[0]]
        if len(idx) == 1 and d.drafts_trees and tree_rule is not None:
            r = idx[0]
            out[r] = d.propose_tree(tokens[r], gammas[r], params[r], generators[r], tree_rule)
            return
        pick = lambda xs: [xs[r] for r in idx]  # noqa: E731
        for r, p in zip(idx, type(drafters[idx[0]]).propose_many(
            pick(drafters), pick(tokens), pick(gammas), pick(params), pick(generators)
        )):
            out[r] = p

    for idx in groups.values():
        if errors is None:
            call(idx)
            continue
        states = {r: generators[r].get_state() for r in idx if generators[r] is not None}
        try:
            call(idx)
            continue
        except Exception as e:  # noqa: BLE001  (isolated below, reported through `errors`)
            if len(idx) == 1:
                errors[idx[0]] = e
                continue
        for r in idx:
            if r in states:
                generators[r].set_state(states[r])
            try:
                call([r])
            except Exception as e:  # noqa: BLE001
                errors[r] = e
    return out


class TrainedDrafter(Drafter):
    """Shared setup of drafters with trained weights (MTP, EAGLE-3, DFlash, DSpark).

    The module runs in the target's dtype; a module in another dtype is copied, not cast, because
    the trainer may still be training it (validation builds drafters from the live model). Beside a
    target with fp16 weights, a copy's linear layers run FBGEMM's fp16 kernel as the target's do:
    the drafter's few-row products cost about half (docs/engine.md#speed); drafts may differ in the
    last bits, which changes acceptance only, never the output.
    """

    def __init__(self, model: torch.nn.Module, cfg, target: "Target") -> None:
        dtype, device = target.model.dtype, target.model.device
        same = model.dtype == dtype and next(model.parameters(), torch.empty(0, device=device)).device == device
        self.model = model if same else copy.deepcopy(model).to(device, dtype)
        if getattr(target, "weights", None) == "fp16":
            from selfdraft.native.quant import fp16_linears

            self.model = fp16_linears(copy.deepcopy(model) if self.model is model else self.model)
        self.cfg, self.target = cfg, target
        self.name = cfg.method
        self.feature_layers = tuple(cfg.feature_layers)

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Draft only among the target ids `ids` (a checkpoint's draft_vocab.safetensors)."""
        from selfdraft.config import ConfigError

        raise ConfigError(f"{self.name} drafters do not take an inference draft vocabulary")
