"""logits -> probabilities (logits processors, temperature, top-k, top-p), applied identically to p and q."""

from __future__ import annotations

from typing import Sequence

import torch

from selfdraft.config import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after the sampling transforms.

    Greedy (T = 0) returns the one-hot of the argmax, so greedy is the T -> 0 limit of the
    same code path and verification needs no special case for correctness.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shift the max to 0 before dividing: every scaled logit is then <= 0 and a tiny temperature
    # sends the others to -inf (probability 0) instead of the max to inf (inf - inf = NaN in softmax).
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays in)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (top_p below float32's resolution)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def logit_adjustment(params: SamplingParams, vocab_size: int, generated: Sequence[Sequence[int]],
                     device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The additive logits processors of `params` at n positions -> [n, V] float32 (None if none).

    generated[i]: the tokens generated before position i (after the prompt; for a verified block
    that is the committed output followed by the drafts before row i). Penalties follow OpenAI's
    definition: - frequency_penalty * count - presence_penalty * (count > 0); logit_bias adds.
    """
    if not params.has_processors:
        return None
    adj = torch.zeros(len(generated), vocab_size, device=device)
    for t, b in params.logit_bias:
        if t < vocab_size:
            adj[:, t] += b
    if params.presence_penalty or params.frequency_penalty:
        for i, ids in enumerate(generated):
            if len(ids):
                c = torch.bincount(torch.as_tensor(list(ids), dtype=torch.long), minlength=vocab_size)[:vocab_size]
                adj[i] -= params.frequency_penalty * c.to(adj) + params.presence_penalty * (c > 0).to(adj)
    return adj


def process_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[Sequence[int]],
                   vocab: torch.Tensor | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """[n, V'] logits + the processors' adjustment at n positions (see `logit_adjustment`).

    vocab: [V'] target ids when the logits cover only a draft vocabulary (then vocab_size = V)."""
    V = logits.shape[-1] if vocab is None else vocab_size
    adj = logit_adjustment(params, V, generated, logits.device)
    if adj is None:
        return logits
    return logits.float() + (adj if vocab is None else adj[:, vocab])


def block_contexts(generated: Sequence[int], drafts: Sequence[int], n: int) -> list[list[int]]:
    """The generated tokens before each of n consecutive positions whose inputs are drafts:
    row i sees generated + drafts[:i] (the rows of a verified chain or a drafted block)."""
    drafts = [int(x) for x in drafts]
    return [list(generated) + drafts[:i] for i in range(n)]


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] probabilities -> [B, 1] draws, on the probabilities' device. A request's generator is a
    CPU one (its seed means the same stream on every machine), and torch draws only on the
    generator's own device: GPU probabilities come to the CPU for the draw, the ids go back."""
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] probabilities -> [...] token ids (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return multinomial(flat, generator).squeeze(-1).reshape(probs.shape[:-1])


# The nucleus is looked for among this many best tokens (a wider search only if a row's nucleus does
# not fit the narrower one) before sorting the whole vocabulary.
NUCLEUS_CANDIDATES = (64, 1024)


def candidate_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`probs_from_logits` restricted to the top candidates, when that is all of its support:
    [B, V] logits -> (ids [B, K], probabilities [B, K] summing to 1; every other id has probability 0),
    or None when a filter-free, greedy or small-vocabulary call (or a nucleus larger than the widest
    NUCLEUS_CANDIDATES in some row) needs the full computation.

    A full sort of a 49k vocabulary per row costs more than a 135M target's decode step on CPU (data
    regeneration samples every token this way), and a top-1024 search over 32 rows costs ~6x a top-64
    one. The candidates' probabilities are exact: normalised over the whole vocabulary (or over the k
    kept tokens with top-k), then cut by top-p as `probs_from_logits` cuts them. (Ties at the k-th
    logit keep exactly k tokens here, all of them there.)
    """
    V = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < V else 0
    if params.greedy or (top_k == 0 and params.top_p == 1.0) or V <= NUCLEUS_CANDIDATES[-1]:
        return None
    x = logits.float()
    z = (x - x.amax(-1, keepdim=True)) / params.temperature  # [B, V]; max 0: no inf - inf
    lse = None if top_k else torch.logsumexp(z, dim=-1, keepdim=True)  # [B, 1]
    for K in (top_k,) if top_k else NUCLEUS_CANDIDATES:
        vals, idx = torch.topk(z, K, dim=-1)  # [B, K] descending
        probs = torch.exp(vals - (torch.logsumexp(vals, dim=-1, keepdim=True) if top_k else lse))  # [B, K]
        before = probs.cumsum(-1) - probs  # mass strictly before each candidate
        if top_k or bool((before[:, -1] + probs[:, -1] >= params.top_p).all()):
            probs = probs.masked_fill(before >= params.top_p, 0.0)
            return idx, probs / probs.sum(-1, keepdim=True)
    return None  # some row's nucleus reaches past the widest search


def sample_logits(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] logits -> [B] ids drawn from `probs_from_logits(logits, params)`, without sorting the
    vocabulary when the distribution's support lies among the top candidates (`candidate_probs`)."""
    cand = candidate_probs(logits, params)
    if cand is None:
        return sample(probs_from_logits(logits, params), generator)
    idx, probs = cand
    return idx.gather(-1, multinomial(probs, generator)).squeeze(-1)  # [B]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to sample after rejecting a draft token (docs/verification.md#residual-distribution).

    If p == q exactly the residual is empty; rejection then has probability 0, so any
    distribution is valid: we return p to stay well defined.
    """
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)
