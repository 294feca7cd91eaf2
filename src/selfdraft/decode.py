"""The speculative decoding loop for one request (docs/architecture.md#one-round)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.drafters.base import Drafter, Proposal
from selfdraft.sampling import block_contexts, probs_from_logits, process_logits
from selfdraft.scheduler import AcceptanceHistory, Scheduler
from selfdraft.target import Target, TargetError, TargetStep
from selfdraft.tree import commit_path, depths, tree_inputs
from selfdraft.verify import Verification, verify_chain, verify_greedy, verify_tree


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
    finish_reason: str = "length"  # "eos" | "length"

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


def verify(logits: torch.Tensor, proposal: Proposal, params: SamplingParams, generator,
           generated: Sequence[int] = ()) -> Verification:
    """logits: [γ'+1, V] target logits at [anchor, drafts]. Dispatches tree vs greedy vs rejection sampling.

    Runs on the CPU (a no-op there): the request's generator is a CPU one, whatever the target's device.
    generated: the request's generated tokens so far, anchor included (what penalties count)."""
    logits, proposal = logits.cpu(), proposal.cpu()
    if params.has_processors:  # each row with its own context: the drafts before it
        logits = process_logits(logits, params, _row_contexts(generated, proposal, logits.shape[0]))
    if proposal.parents is not None:  # a draft tree: the sibling rule (greedy = one-hot p)
        return verify_tree(probs_from_logits(logits, params), proposal.tokens, proposal.parents, generator)
    if params.greedy:
        return verify_greedy(logits, proposal.tokens)
    return verify_chain(probs_from_logits(logits, params), proposal.tokens, proposal.q, generator)


def _row_contexts(generated: Sequence[int], proposal: Proposal, n: int) -> list[list[int]]:
    """Generated tokens before each verified row: a chain's row i follows drafts[:i]; a tree's node
    row follows its ancestors' tokens and its own."""
    if proposal.parents is None:
        return block_contexts(generated, proposal.tokens.tolist(), n)
    toks, parents, rows = proposal.tokens.tolist(), proposal.parents.tolist(), [list(generated)]
    for j in range(n - 1):
        rows.append(rows[parents[j] + 1] + [toks[j]])  # parents[j] < j: its row is built already
    return rows


def generate(
    target: Target,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams = SamplingParams(),
    config: GenerationConfig = GenerationConfig(),
    on_tokens: Callable[[list[int]], None] | None = None,
    scheduler: Scheduler | None = None,
) -> GenerationResult:
    """Prefill, then rounds of propose -> one target forward -> verify -> commit -> roll back.

    scheduler: picks ℓ ≤ γ' drafts to verify from the proposal's confidences (None: all of them);
    the hardware scheduler prices the round as one forward of ℓ + 1 tokens plus the drafting time."""
    P = len(prompt_ids)
    if P == 0:
        raise TargetError("empty prompt")
    if P + config.max_new_tokens > target.max_context:
        raise TargetError(
            f"prompt ({P} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the target's "
            f"context of {target.max_context} tokens: shorten the prompt or lower max_new_tokens"
        )
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    layers = drafter.feature_layers
    res = GenerationResult(prompt_token_ids=list(prompt_ids), token_ids=[])
    t_start = time.perf_counter()

    # 1. Prefill: the cache holds every committed token except the last (the next anchor).
    cache = target.new_cache()
    step = target.forward(torch.tensor([prompt_ids]), cache, layers, last_only=True)
    first = verify(step.logits[0, -1:], Proposal.empty(), params, gen, ()).next_token
    drafter.begin(list(prompt_ids), step)
    drafter.prompt_len = P
    out = [first]
    draft_s = 0.0  # EMA of the drafting time: the round's cost besides the forward
    history = AcceptanceHistory(config.gamma)  # ĉ_k for drafters without confidences
    res.prefill_s = time.perf_counter() - t_start
    if on_tokens:
        on_tokens([first])

    while not _finished(out, target, config, res):
        # 2. Draft at most what still fits under max_new_tokens (one slot is kept for the bonus).
        t0 = time.perf_counter()
        budget = min(config.gamma, config.max_new_tokens - len(out) - 1)
        if scheduler is None or drafter.drafts_trees:  # a tree is verified whole (priced by its nodes, not ℓ)
            proposal = drafter.propose(prompt_ids + out, budget, params, gen)
        elif drafter.gives_confidences:  # ℓ read from c_1..c_ℓ only (lossless); drafting stops there
            proposal = drafter.propose_until(prompt_ids + out, budget, params, gen, scheduler.admission(draft_s))
        else:  # no c_k: ℓ from this request's past rounds, chosen before drafting (ℓ = 0 drafts nothing)
            admission = scheduler.admission(draft_s)
            ell = budget if admission is None else history.admitted(admission, budget)
            proposal = drafter.propose(prompt_ids + out, ell, params, gen)  # ℓ = 0: only the drafter's bookkeeping
        proposal = proposal.truncate(budget).cpu()
        t1 = time.perf_counter()
        draft_s = 0.8 * draft_s + 0.2 * (t1 - t0) if draft_s else t1 - t0
        # 3. One target forward over [anchor, d_1..d_γ'] -> logits [γ'+1, V].
        block = torch.cat([torch.tensor([out[-1]]), proposal.tokens])[None]
        past = P + len(out) - 1
        if proposal.parents is None:
            step = target.forward(block, cache, layers)
        else:  # a draft tree: each node sees its ancestors, positions = depth (tree.py)
            tree = tree_inputs(proposal.parents, past, target.model.dtype)
            step = target.forward(block, cache, layers, tree.position_ids, tree.attention_mask)
        # 4. Verify: accepted drafts + one target token.
        v = verify(step.logits[0], proposal, params, gen, out)
        # 5. Commit (stop at EOS) and 6. roll the cache back to the committed length.
        new = v.tokens
        if config.stop_on_eos:
            eos_at = next((i for i, t in enumerate(new) if t in target.eos_ids), None)
            new = new if eos_at is None else new[: eos_at + 1]
        out.extend(new)
        if proposal.parents is not None:  # only the accepted path's rows stay (KV cache and states)
            step = commit_path(target, cache, step, past, v.path)
        target.rollback(cache, P + len(out) - 1)
        # 7. The drafter sees the target's states at the newly committed positions.
        drafter.observe(v, _slice_step(step, v.num_accepted + 1))
        if proposal.parents is None:
            history.update(len(proposal.tokens), v.num_accepted)
        depth = len(proposal.tokens) if proposal.parents is None or not len(proposal.tokens) else int(depths(proposal.parents).max())
        res.rounds.append(RoundStats(len(proposal.tokens), v.num_accepted, t1 - t0, time.perf_counter() - t1, depth))
        if on_tokens:
            on_tokens(new)

    res.token_ids = out
    res.elapsed_s = time.perf_counter() - t_start
    return res


def _finished(out: list[int], target: Target, config: GenerationConfig, res: GenerationResult) -> bool:
    if config.stop_on_eos and out[-1] in target.eos_ids:
        res.finish_reason = "eos"
        return True
    return len(out) >= config.max_new_tokens


def _slice_step(step: TargetStep, n: int) -> TargetStep:
    """Keep the first n positions of a TargetStep (the committed ones)."""
    f = None if step.features is None else step.features[:, :n]
    return TargetStep(logits=step.logits[:, :n], features=f, last_hidden=step.last_hidden[:, :n])
