"""Verification rules against brute-force enumeration of small distributions (docs/verification.md)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from selfdraft.config import SamplingParams
from selfdraft.sampling import probs_from_logits, residual, sample
from selfdraft.verify import Verification, verify_chain, verify_greedy
from tests.helpers import _broken_chain  # noqa: F401

V, GAMMA = 4, 2


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(GAMMA + 1, V, generator=g), -1)  # [γ+1, V]
    q = torch.softmax(2.0 * torch.randn(GAMMA, V, generator=g), -1)  # [γ, V]
    return p, q


def _completed_law_pvalue(verifier, p, q, n=12000, seed=0) -> float:
    """Draft x ~ q (position-wise independent), verify, then complete the emitted prefix to γ+1 tokens
    by sampling the remaining positions from p. With context-free p_k the completed sequence must
    follow Π_k p_k exactly; compare against the enumerated law with a chi-square test."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros([V] * (GAMMA + 1))
    for _ in range(n):
        drafts = sample(q, g) if q is not None else torch.randint(V, (GAMMA,), generator=g)
        v = verifier(p, drafts, q, g)
        seq = v.tokens + [int(sample(p[k], g)) for k in range(len(v.tokens), GAMMA + 1)]
        counts[tuple(seq)] += 1
    exact = torch.ones([V] * (GAMMA + 1))
    for idx in itertools.product(range(V), repeat=GAMMA + 1):  # brute-force enumeration of Π p_k
        exact[idx] = torch.prod(torch.stack([p[k, i] for k, i in enumerate(idx)]))
    return float(chisquare(counts.flatten().numpy(), (exact.flatten() * n).numpy()).pvalue)


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_matches_enumerated_target_law(seed):
    p, q = _dists(seed)
    assert _completed_law_pvalue(verify_chain, p, q, seed=seed) > 1e-3


def test_chain_with_deterministic_drafts_matches_target_law():
    p, _ = _dists(3)
    assert _completed_law_pvalue(verify_chain, p, None) > 1e-3


def test_broken_verifier_is_caught():
    """The same test must fail for a verifier that skips the residual (proof the test can fail)."""
    p, q = _dists(0)
    assert _completed_law_pvalue(_broken_chain, p, q) < 1e-6


def test_first_step_acceptance_equals_one_minus_tv():
    """α = Σ_x min(p(x), q(x)): empirical acceptance of draft 1 vs the enumerated value."""
    p, q = _dists(5)
    g = torch.Generator().manual_seed(0)
    n = 20000
    acc = sum(verify_chain(p, sample(q, g), q, g).num_accepted >= 1 for _ in range(n)) / n
    alpha = float(torch.minimum(p[0], q[0]).sum())
    assert abs(acc - alpha) < 4 * (alpha * (1 - alpha) / n) ** 0.5 + 1e-3


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.2, 0.1])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, p), p)  # empty residual: rejection has probability 0


def test_greedy_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(GAMMA + 4, V, generator=g)
        best = logits.argmax(-1)
        drafts = torch.where(torch.rand(GAMMA + 3, generator=g) < 0.7, best[:-1], torch.randint(V, (GAMMA + 3,), generator=g))
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        v = verify_greedy(logits, drafts)
        assert (v.num_accepted, v.next_token, v.tokens) == (n, int(best[n]), drafts[:n].tolist() + [int(best[n])])


def test_greedy_is_the_zero_temperature_chain():
    """With T = 0, p is one-hot, so the stochastic rule must reproduce verify_greedy exactly."""
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0)
    for _ in range(100):
        logits = torch.randn(GAMMA + 1, V, generator=g)
        drafts = torch.randint(V, (GAMMA,), generator=g)
        assert verify_chain(probs_from_logits(logits, params), drafts, None, g) == verify_greedy(logits, drafts)


def test_top_k_top_p_processing_against_enumeration():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    pk = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(pk[0, :2], full[0, :2] / full[0, :2].sum())
    assert pk[0, 2:].sum() == 0
    # top-p keeps the smallest prefix (by descending prob) whose mass reaches p
    pp = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    cum = full[0].cumsum(0)
    keep = int((cum < 0.8).sum()) + 1
    torch.testing.assert_close(pp[0, :keep], full[0, :keep] / full[0, :keep].sum())
    assert pp[0, keep:].sum() == 0
    # temperature divides logits before the softmax
    torch.testing.assert_close(probs_from_logits(logits, SamplingParams(temperature=0.5)), torch.softmax(logits / 0.5, -1))


# ---------------------------------------------------------------- numerically safe for every accepted value
TEMPERATURES = [5e-324, 1e-300, 1e-46, 1e-45, 1e-40, 1.2e-38, 1e-30, 1e-8, 0.05, 1.0, 2.0]
TOP_PS = [5e-324, 1e-300, 1e-46, 1e-8, 0.3, 1.0]


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_probabilities_are_a_distribution_for_every_accepted_parameter(temperature):
    """Tiny temperatures (down to the smallest double) and tiny top_p never give NaN: the result is
    a distribution that samples; near T = 0 it is concentrated on the argmax (ties shared)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([40.0 * torch.randn(3, 50, generator=g),  # large logits: x / T overflows for tiny T
                        torch.tensor([[5.0, 5.0] + [0.0] * 48])])  # an exact tie at the top
    for top_p in TOP_PS:
        for top_k in (0, 1, 7):
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
            p = probs_from_logits(logits, params)
            assert torch.isfinite(p).all() and (p >= 0).all(), (top_p, top_k)
            assert torch.allclose(p.sum(-1), torch.ones(4)), (top_p, top_k)
            x = sample(p, g)
            assert (p.gather(-1, x[:, None]) > 0).all()
            if temperature <= 1e-30 or top_p <= 1e-8 or top_k == 1:
                assert (p[:3].argmax(-1) == logits[:3].argmax(-1)).all() and (p[:3].max(-1).values == 1).all()
                assert p[3, 2:].sum() == 0  # the tie keeps all the mass


# ----------------------------------------------------------------------------- the fast sampler (no full sort)
FAST_CASES = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=0.8, top_k=2000, top_p=0.95),
    SamplingParams(temperature=1.3, top_k=5000, top_p=0.5),  # top_k >= V: off, as in probs_from_logits
]


@pytest.mark.parametrize("scale", [8.0, 2.0], ids=["nucleus<64", "64<nucleus<1024"])
@pytest.mark.parametrize("params", FAST_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_candidate_probs_equal_the_full_distribution(params, scale):
    """sampling.candidate_probs, scattered back to [B, V], is probs_from_logits (the slow reference),
    from the narrow search and from the wide one (the nucleus of one row outgrows the narrow)."""
    from selfdraft.sampling import candidate_probs

    logits = scale * torch.randn(3, 3000, generator=torch.Generator().manual_seed(0))
    if params == FAST_CASES[0]:  # the cases really take the search they are named for
        nucleus = int((probs_from_logits(logits, params) > 0).sum(-1).max())
        assert (nucleus < 64) == (scale == 8.0) and nucleus < 1024, nucleus
    idx, probs = candidate_probs(logits, params)
    fast = torch.zeros(3, 3000).scatter(-1, idx, probs)
    torch.testing.assert_close(fast, probs_from_logits(logits, params), atol=1e-6, rtol=1e-5)


def test_candidate_probs_defer_to_the_full_computation():
    """A nucleus wider than the candidates, no filter, greedy or a small vocabulary: no fast path."""
    from selfdraft.sampling import candidate_probs

    flat = torch.zeros(2, 3000)
    assert candidate_probs(flat, SamplingParams(temperature=1.0, top_p=0.99)) is None
    assert candidate_probs(flat, SamplingParams(temperature=1.0)) is None
    assert candidate_probs(flat, SamplingParams()) is None
    assert candidate_probs(torch.zeros(2, 500), SamplingParams(temperature=1.0, top_p=0.5)) is None


def test_sample_logits_draws_from_probs_from_logits():
    """Chi-square: sample_logits' draws (fast path) follow probs_from_logits; no token outside the
    nucleus is ever drawn. Control: the same counts fail against a shifted law."""
    from selfdraft.sampling import candidate_probs, sample_logits

    params = SamplingParams(temperature=1.0, top_p=0.8)
    row = torch.full((2000,), -20.0)
    row[:6] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5])
    logits = row.expand(4000, -1)
    assert candidate_probs(logits, params) is not None  # the fast path is what is tested
    draws = sample_logits(logits, params, torch.Generator().manual_seed(1))
    p = probs_from_logits(row, params)
    support = p.nonzero().flatten()
    assert bool(torch.isin(draws, support).all())
    counts = torch.bincount(draws, minlength=2000)[support].double()
    expected = p[support].double() * len(draws)
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    shifted = torch.roll(expected, 1)
    assert chisquare(counts.numpy(), shifted.numpy()).pvalue < 1e-6
