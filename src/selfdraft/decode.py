"""One request's speculative decoding, one round at a time (docs/architecture.md#one-round).

`Speculation` owns one request's round, for draft chains and trees alike: propose -> one target
forward -> verify (verify.py: logits -> p through sampling.py, then the acceptance rule) -> commit
-> observe -> roll back. Its three callers share that code:

- `generate` (below): `prefill`, then `round` until done, on the request's own KV cache;
- the batched engine (engine.py): ONE prefill forward for the joining requests, then `start` per
  request; per round `clip` and `block` per request, ONE padded target forward for all of them,
  then `commit` per request; the engine keeps each request's `kept_rows` in its cache;
- DSpark calibration (training/calibrate.py): `round` with a full block its own code drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.drafters.base import Drafter, Proposal
from selfdraft.scheduler import AcceptanceHistory, Scheduler
from selfdraft.target import Target, TargetStep
from selfdraft.target_loading import TargetError
from selfdraft.tree import ancestor_mask, depths, tree_inputs
from selfdraft.verify import Verification, verify


@dataclass
class RoundStats:
    proposed: int  # drafts sent to verification (tree: all nodes)
    accepted: int  # drafts accepted (the round commits accepted + 1 tokens)
    draft_s: float
    verify_s: float
    depth: int = -1  # longest chain verified: proposed for a chain, the deepest node for a tree

    def __post_init__(self) -> None:
        if self.depth < 0:
            self.depth = self.proposed


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    rounds: list[RoundStats] = field(default_factory=list)
    elapsed_s: float = 0.0
    prefill_s: float = 0.0
    finish_reason: str = "length"  # "eos" | "length" (the engine adds "cancelled" | "error")

    @property
    def accepted_lengths(self) -> list[int]:
        """Per round: accepted drafts + 1 (the correction or bonus token)."""
        return [r.accepted + 1 for r in self.rounds]

    @property
    def tau(self) -> float:
        """τ = mean accepted length per round (docs/verification.md#metrics)."""
        return sum(self.accepted_lengths) / max(1, len(self.rounds))

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def position_acceptance(self, gamma: int) -> list[tuple[int, int]]:
        """For k = 1..γ: (rounds where draft k was verified with drafts 1..k-1 accepted, accepted)."""
        counts = []
        for k in range(1, gamma + 1):
            tried = [r for r in self.rounds if r.depth >= k and r.accepted >= k - 1]
            counts.append((len(tried), sum(r.accepted >= k for r in tried)))
        return counts


@dataclass
class VerifyBlock:
    """The rows one request puts through the verification forward: [anchor, d_1 .. d_n]."""

    ids: torch.Tensor  # [n+1] int64: the anchor (last committed token), then the drafts
    past: int  # tokens in the request's cache (committed except the anchor) = the anchor's position
    parents: torch.Tensor | None = None  # [n] a tree's parent pointers (tree.py); None = a chain

    @property
    def width(self) -> int:
        return self.ids.shape[0]

    def positions(self) -> torch.Tensor:
        """[n+1] past + depth: a chain's row i sits at past + i, a tree node at past + its depth."""
        if self.parents is None:
            return self.past + torch.arange(self.width)
        return self.past + torch.cat([torch.zeros(1, dtype=torch.long), depths(self.parents)])

    def visible(self) -> torch.Tensor:
        """[n+1, n+1] bool: block row i sees block row j (causal for a chain, ancestry for a tree)."""
        if self.parents is None:
            return torch.ones(self.width, self.width, dtype=torch.bool).tril()
        return ancestor_mask(self.parents)


@dataclass
class RoundOutcome:
    """What one round did for one request."""

    new_tokens: list[int]  # committed: accepted drafts + the target's token, cut after an EOS
    verification: Verification
    kept_rows: list[int]  # block rows that stay in the cache: the old anchor + accepted drafts (len(new_tokens))
    stats: RoundStats
    logits: torch.Tensor  # [n+1, V] the target's raw logits over the whole block (calibration reads them)
    finished: bool  # the request is done (EOS or max_new_tokens)


class Speculation:
    """One request: its committed tokens, drafter, sampling state and generator, one round at a time.

    The target's KV cache is the caller's: `prefill` and `round` take it, `commit` leaves it to the
    caller (the batched engine keeps `kept_rows` in its own padded cache)."""

    def __init__(self, target: Target, drafter: Drafter, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                 config: GenerationConfig = GenerationConfig(), generator: torch.Generator | None = None,
                 request_id: int = 0, scheduler: Scheduler | None = None) -> None:
        P = len(prompt_ids)
        if P == 0:
            raise TargetError("empty prompt")
        if P + config.max_new_tokens > target.max_context:
            raise TargetError(
                f"prompt ({P} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the target's "
                f"context of {target.max_context} tokens: shorten the prompt or lower max_new_tokens"
            )
        self.id, self.target, self.drafter, self.params, self.config = request_id, target, drafter, params, config
        self.prompt = list(prompt_ids)
        if generator is None and params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        self.generator = generator
        self.out: list[int] = []  # generated so far; the last one is the next round's anchor
        self.result = GenerationResult(prompt_token_ids=list(prompt_ids), token_ids=self.out)
        self.done = False
        self.t_start = 0.0
        # The single-request scheduler (the batched engine schedules the whole batch itself):
        self.scheduler = scheduler
        self.draft_s = 0.0  # EMA of the drafting time, the round's cost besides the forward
        self.history = AcceptanceHistory(config.gamma)  # ĉ_k for drafters without confidences

    @property
    def tokens(self) -> list[int]:
        """Prompt + generated so far (what the drafter reads)."""
        return self.prompt + self.out

    @property
    def budget(self) -> int:
        """Drafts this round may verify: γ, fewer near max_new_tokens (one slot stays for the target's token)."""
        return min(self.config.gamma, self.config.max_new_tokens - len(self.out) - 1)

    def prefill(self, cache) -> list[int]:
        """One forward over the prompt [1, P] into `cache` (logits at the last position only), then
        `start`. The batched engine runs its own forward for several prompts (engine.batched_prefill)
        and calls `start` per request."""
        self.t_start = time.perf_counter()
        step = self.target.forward(torch.tensor([self.prompt]), cache, self.drafter.feature_layers, last_only=True)
        return self.start(step)

    def start(self, step: TargetStep) -> list[int]:
        """The first token from the prompt's forward -> [first token]. step: [1, P, ...] with this
        drafter's feature layers and the last hidden state at every prompt position, and the logits
        of the last prompt position ([1, 1, V]). The token is chosen by the same `verify` with an
        empty proposal, so it follows p exactly; it is round 1's anchor. The drafter begins on the
        prompt's states. Set `t_start` before the forward (prefill_s counts from it)."""
        self.out.append(verify(step.logits[0, -1:], Proposal.empty(), self.params, self.generator, ()).next_token)
        self.drafter.begin(list(self.prompt), step)
        self.drafter.prompt_len = len(self.prompt)
        self.result.prefill_s = time.perf_counter() - self.t_start
        self._check_done()
        return list(self.out)

    def propose(self) -> Proposal:
        """The drafter's proposal for this round, clipped to the budget; with a scheduler, only the
        ℓ drafts it admits (docs/scheduler.md#one-request-online-admission), or a tree's nodes it keeps."""
        d, args = self.drafter, (self.tokens, self.budget, self.params, self.generator)
        if self.scheduler is None:
            return self.clip(d.propose(*args))
        if d.drafts_trees:  # the nodes worth verifying on this machine (a tree without c_i: all)
            return self.clip(d.propose_tree(*args, self.scheduler.tree_rule(self.draft_s)))
        admission = self.scheduler.admission(self.draft_s)
        if d.gives_confidences:  # ℓ reads c_1..c_ℓ only (lossless); drafting stops at the first refusal
            return self.clip(d.propose_until(*args, admission))
        # No c_k: ℓ from this request's past rounds, chosen before drafting (ℓ = 0 drafts nothing).
        ell = self.budget if admission is None else self.history.admitted(admission, self.budget)
        return self.clip(d.propose(self.tokens, ell, self.params, self.generator))

    def clip(self, proposal: Proposal) -> Proposal:
        """At most `budget` drafts (a tree: depth <= budget), on the CPU where verification samples."""
        return proposal.truncate(self.budget).cpu()

    def block(self, proposal: Proposal) -> VerifyBlock:
        return VerifyBlock(torch.cat([torch.tensor([self.out[-1]]), proposal.tokens]),
                           len(self.prompt) + len(self.out) - 1, proposal.parents)

    def round(self, cache, proposal: Proposal | None = None) -> RoundOutcome:
        """One whole round on this request's own cache; `proposal` replaces the drafter's (calibration)."""
        t0 = time.perf_counter()
        # 1. Propose at most `budget` drafts: tokens [n] (+ parents [n] for a tree).
        proposal = self.propose() if proposal is None else self.clip(proposal)
        b = self.block(proposal)
        t1 = time.perf_counter()
        self.draft_s = 0.8 * self.draft_s + 0.2 * (t1 - t0) if self.draft_s else t1 - t0
        # 2. One target forward over [anchor, d_1..d_n] -> TargetStep [1, n+1, ...].
        if b.parents is None:
            step = self.target.forward(b.ids[None], cache, self.drafter.feature_layers)
        else:  # each node sees its ancestors, at position past + depth (tree.py)
            t = tree_inputs(b.parents, b.past, self.target.model.dtype)
            step = self.target.forward(b.ids[None], cache, self.drafter.feature_layers, t.position_ids, t.attention_mask)
        # 3-5. Verify, commit, observe: the code the engine runs after its batched forward.
        out = self.commit(proposal, step, t1 - t0, time.perf_counter() - t1)
        # 6. Roll the cache back to the committed tokens: a chain drops its tail, a tree keeps its path's rows.
        if b.parents is None:
            self.target.rollback(cache, b.past + len(out.kept_rows))
        else:
            self.target.keep_rows(cache, b.past, torch.tensor(out.kept_rows))
        return out

    def commit(self, proposal: Proposal, step: TargetStep, draft_s: float = 0.0, forward_s: float = 0.0) -> RoundOutcome:
        """Steps 3-5 of a round. step: the verification forward at this request's block rows,
        [1, n+1, ...] with its drafter's feature layers."""
        t0 = time.perf_counter()
        # 3. Verify: accepted drafts + one target token (greedy, chain rejection sampling or the sibling rule).
        v = verify(step.logits[0], proposal, self.params, self.generator, self.out)
        # 4. Commit, cut after an EOS.
        new = v.tokens
        if self.config.stop_on_eos:
            eos_at = next((i for i, t in enumerate(new) if t in self.target.eos_ids), None)
            new = new if eos_at is None else new[: eos_at + 1]
        self.out.extend(new)
        # 5. The drafter observes the target's states at the rows that stay: the old anchor and the
        #    accepted drafts (a tree: its accepted path), as if a chain of them had been verified.
        n, chain = proposal.tokens.shape[0], proposal.parents is None
        rows = list(range(len(new))) if chain else [0] + [i + 1 for i in v.path[: len(new) - 1]]
        self.drafter.observe(v, _pick_rows(step, rows, chain))
        if chain:
            self.history.update(n, v.num_accepted)
        depth = n if chain or n == 0 else int(depths(proposal.parents).max())
        stats = RoundStats(n, v.num_accepted, draft_s, forward_s + time.perf_counter() - t0, depth)
        self.result.rounds.append(stats)
        return RoundOutcome(new, v, rows, stats, step.logits[0], self._check_done())

    def _check_done(self) -> bool:
        """The stop rule (EOS, max_new_tokens); sets done and the finish reason."""
        if self.config.stop_on_eos and self.out[-1] in self.target.eos_ids:
            self.result.finish_reason, self.done = "eos", True
        elif len(self.out) >= self.config.max_new_tokens:
            self.result.finish_reason, self.done = "length", True
        return self.done

    def close(self, reason: str | None = None) -> GenerationResult:
        """End the request (`reason` overrides the stop rule's: "cancelled", "error") -> its result."""
        if reason is not None:
            self.result.finish_reason, self.done = reason, True
        self.result.elapsed_s = time.perf_counter() - self.t_start if self.t_start else 0.0
        self.drafter.end(list(self.out))
        return self.result


def _pick_rows(step: TargetStep, rows: list[int], contiguous: bool) -> TargetStep:
    """step [1, n+1, ...] -> [1, len(rows), ...] at block rows `rows` (a chain's are 0..k-1: views)."""
    if contiguous:
        k = len(rows)
        feats = None if step.features is None else step.features[:, :k]
        return TargetStep(logits=step.logits[:, :k], features=feats, last_hidden=step.last_hidden[:, :k])
    idx = torch.tensor(rows)
    pick = lambda t: None if t is None else t[:, idx.to(t.device)]  # noqa: E731
    return TargetStep(logits=pick(step.logits), features=pick(step.features), last_hidden=pick(step.last_hidden))


def generate(
    target: Target,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams = SamplingParams(),
    config: GenerationConfig = GenerationConfig(),
    on_tokens: Callable[[list[int]], None] | None = None,
    scheduler: Scheduler | None = None,
) -> GenerationResult:
    """One request: prefill, then `Speculation.round` until EOS or max_new_tokens. scheduler: picks
    ℓ ≤ γ drafts to verify each round (None: all of them)."""
    s = Speculation(target, drafter, prompt_ids, params, config, scheduler=scheduler)
    cache = target.new_cache()
    first = s.prefill(cache)
    if on_tokens:
        on_tokens(first)
    while not s.done:
        new = s.round(cache).new_tokens
        if on_tokens:
            on_tokens(new)
    return s.close()
