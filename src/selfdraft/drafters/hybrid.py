"""`hybrid:DIR`: suffix drafts and a trained drafter's, one of them per round (docs/methods/hybrid.md).

Every round the suffix lookup runs (microseconds); the trained drafter's pass (milliseconds) runs
only when it may be worth more. The choice reads only what is known before verification (the
drafts, their probabilities and confidences, past rounds' costs), so the output keeps the target's
law: verification sees one ordinary proposal, as from any drafter.

Rules (`RULES`):
- cost (default): the suffix draft when its expected tokens per second,
  (1 + Σ_j a_j) · SPS(1 + n) with a_j = Π_{k<=j} P(x_k | ...) from the tree's frequencies and SPS
  from the cost table (`selfdraft profile`), is at least what the trained drafter's recent rounds
  were worth, (1 + Σ_j a_j) / (1 / SPS(1 + n) + t_draft) from its calibrated confidences and its
  measured pass time (EMAs); else the trained drafter drafts (its pass skipped otherwise). Its
  drafts of this round are never compared: x_1 would then be chosen for what c_2.. say of it. A
  suffix draft that rests on a one-token match is left to the trained drafter (COST_MIN_MATCH).
- arctic: the suffix draft when its score Σ_j a_j >= γ (Arctic Inference), else the trained one.
- sam: the suffix draft when its match is >= 4 tokens long (SAM-Decoding), else the trained one.
- merged: one draft tree, the suffix chain and the trained chain under the anchor (shared prefix
  merged), verified whole with the sibling rule (RASD-style).
"""

from __future__ import annotations

import copy
import time

import torch

from selfdraft.config import ConfigError
from selfdraft.drafters.base import Drafter, Proposal
from selfdraft.scheduler import Admission, prefix_survival, with_overhead

RULES = ("cost", "arctic", "sam", "merged")
SAM_MIN_MATCH = 4  # SAM-Decoding / TensorRT-LLM's SA enhancer switch at a match of 4 tokens
# The cost rule's shortest match: after a one-token match, one earlier occurrence makes every tree frequency
# 1.0, and such drafts (5-6 tokens) accepted 0.2-0.4 tokens a round where the trained drafter's accepted as
# many for one or two verified drafts (docs/methods/hybrid.md#the-shortest-match).
COST_MIN_MATCH = 2


class HybridDrafter(Drafter):
    def __init__(self, neural: Drafter, suffix, rule: str = "cost", source: str = "") -> None:
        if rule not in RULES:
            raise ConfigError(f"hybrid rule must be one of {RULES}, got {rule!r}")
        if rule == "cost" and not neural.gives_confidences:
            raise ConfigError(f"hybrid:{source or neural.name}: the cost rule prices the trained drafter's drafts by "
                              f"its confidences c_k, and a {neural.name} drafter has none; use a DSpark checkpoint, "
                              "or hybrid+arctic: / hybrid+sam: for other drafters")
        if neural.drafts_trees or suffix.drafts_trees:
            raise ConfigError("hybrid takes chain drafters (a suffix tree and a draft tree cannot be chosen between per round)")
        self.neural, self.suffix, self.rule = neural, suffix, rule
        self.name = f"hybrid-{rule}" if rule != "cost" else "hybrid"
        self.feature_layers = neural.feature_layers
        self.drafts_trees = rule == "merged"
        self.gives_confidences = rule == "cost"
        self.neural_s = 0.0  # EMA of the trained drafter's pass
        self.neural_value = 0.0  # EMA of (1 + E[accepted]) of its admitted drafts
        self.neural_n = 0.0  # EMA of its admitted draft count
        self.picked = {"suffix": 0, "neural": 0}

    def fresh(self) -> "HybridDrafter":
        """Another request's hybrid: its own drafter states, the same weights and global suffix tree."""
        return HybridDrafter(copy.copy(self.neural), copy.copy(self.suffix), self.rule)

    # ---------------------------------------------------------------- the request's life
    def begin(self, prompt_ids, step) -> None:
        self.neural.begin(prompt_ids, step)
        self.suffix.begin(prompt_ids, step)
        self.neural.prompt_len = self.suffix.prompt_len = self.prompt_len

    def observe(self, verification, step) -> None:
        self.neural.observe(verification, step)  # the committed rows, whichever proposal they came from

    def end(self, generated: list[int]) -> None:
        self.suffix.end(generated)

    def forget(self) -> None:
        self.suffix.forget()

    # ---------------------------------------------------------------- proposing
    def propose(self, tokens, gamma, params, generator) -> Proposal:
        return self.propose_until(tokens, gamma, params, generator, None)

    def propose_until(self, tokens, gamma, params, generator, admission: Admission | None) -> Proposal:
        """1. the suffix draft (cut by the scheduler's rule, its pass free); 2. the rule decides whether
        the trained drafter runs (cut by the rule with its own pass time); 3. the better proposal."""
        sp, chosen = self._decide(tokens, gamma, admission)
        if chosen is not None:
            return chosen
        t0 = time.perf_counter()
        neural_admission = None if self.rule == "merged" else _fresh(admission, self.neural_s)
        p = self.neural.propose_until(tokens, gamma, params, generator, neural_admission)
        return self._with_neural(sp, p, time.perf_counter() - t0)

    def batch_key(self) -> object | None:
        key = self.neural.batch_key()  # hybrids over one loaded drafter: their trained passes run batched
        return None if key is None else ("hybrid", self.rule, key)

    @staticmethod
    def propose_many(drafters, tokens, gammas, params, generators) -> list[Proposal]:
        """R rounds (the batched engine): each hybrid decides from its own suffix draft, as in
        `propose`; the trained drafters asked to draft then run in ONE batched pass."""
        decided = [d._decide(t, g, None) for d, t, g in zip(drafters, tokens, gammas)]
        out = [chosen for _, chosen in decided]
        ask = [r for r, p in enumerate(out) if p is None]
        if ask:
            pick = lambda xs: [xs[r] for r in ask]  # noqa: E731
            t0 = time.perf_counter()
            neural = type(drafters[ask[0]].neural).propose_many(
                [drafters[r].neural for r in ask], pick(tokens), pick(gammas), pick(params), pick(generators))
            dt = (time.perf_counter() - t0) / len(ask)  # each request's share of the pass
            for r, p in zip(ask, neural):
                out[r] = drafters[r]._with_neural(decided[r][0], p, dt)
        return out

    def _decide(self, tokens, gamma, admission: Admission | None) -> tuple[Proposal, Proposal | None]:
        """(the suffix proposal, the round's proposal if the rule settles it without the trained
        drafter, else None). Reads only what is known before the trained drafter drafts."""
        self.neural.prompt_len = self.suffix.prompt_len = self.prompt_len
        s = self.suffix.draft(tokens, gamma)
        sp = s.proposal()
        if self.rule == "merged":
            return sp, None
        if admission is not None and len(sp.tokens):
            sp = sp.truncate(_fresh(admission, 0.0).count(sp.confidences))
        if self.rule in ("arctic", "sam"):
            use_suffix = s.score >= gamma if self.rule == "arctic" else s.match_len >= SAM_MIN_MATCH
            return sp, self._pick("suffix", sp) if use_suffix and len(sp.tokens) else None
        # cost: (1 + Σ a_j) per second of the round. The trained drafter's value is what its recent
        # rounds were worth: its drafts of this round are not looked at, since choosing them for what
        # they turned out to be would condition x_1 on c_2.. (the bias of the paper's Appendix A).
        cost = None if admission is None else (admission.cost or admission.sps)
        if len(sp.tokens) and s.match_len >= COST_MIN_MATCH and self._value(sp, 0.0, cost) >= self._predicted(cost):
            return sp, self._pick("suffix", sp)
        return sp, None

    def _with_neural(self, sp: Proposal, p: Proposal, dt: float) -> Proposal:
        """The round's proposal once the trained drafter drafted p in dt seconds (its EMAs updated)."""
        e = _expected_tokens(p)
        ema = lambda old, new: new if not old else 0.8 * old + 0.2 * new  # noqa: E731
        self.neural_s, self.neural_value, self.neural_n = ema(self.neural_s, dt), ema(self.neural_value, e), \
            ema(self.neural_n, float(len(p.tokens)))
        return merge_chains(sp, p) if self.rule == "merged" else self._pick("neural", p)

    def _value(self, p: Proposal, draft_s: float, cost) -> float:
        """Expected tokens of the round (1 + Σ a_j), per second of it when a cost table is known."""
        e = _expected_tokens(p)
        return e if cost is None else e / (1.0 / cost(1 + len(p.tokens)) + draft_s)

    def _predicted(self, cost) -> float:
        """What the trained drafter's rounds were worth lately (its pass time included); before its
        first round, infinite (it runs once to be measured)."""
        if not self.neural_value:
            return float("inf")
        if cost is None:
            return self.neural_value
        return self.neural_value / (1.0 / cost(1 + round(self.neural_n)) + self.neural_s)

    def _pick(self, who: str, p: Proposal) -> Proposal:
        self.picked[who] += 1
        return p


def _expected_tokens(p: Proposal) -> float:
    """1 + Σ_j a_j: the tokens a round with this proposal is expected to commit (1 without confidences)."""
    if not len(p.tokens) or p.confidences is None:
        return 1.0
    return 1.0 + float(prefix_survival(p.confidences).sum())


def _fresh(admission: Admission | None, overhead_s: float) -> Admission | None:
    """A new online rule like `admission` (which is stateful), priced with this pass's own overhead."""
    if admission is None:
        return None
    if admission.sps is None:
        return Admission(None, admission.threshold)
    cost = admission.cost or admission.sps
    return Admission(with_overhead(cost, overhead_s), cost=cost)


def merge_chains(a: Proposal, b: Proposal) -> Proposal:
    """Two chains under one root -> a draft tree (tokens [n], parents [n]); a shared prefix is one path."""
    ta, tb = a.tokens.tolist(), b.tokens.tolist()
    tokens, parents = list(ta), list(range(-1, len(ta) - 1))
    node, k = -1, 0
    while k < len(tb) and k < len(ta) and ta[k] == tb[k]:  # follow the common prefix
        node, k = k, k + 1
    for t in tb[k:]:
        tokens.append(t)
        parents.append(node)
        node = len(tokens) - 1
    if not tokens:
        return Proposal.empty()
    return Proposal(torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))
