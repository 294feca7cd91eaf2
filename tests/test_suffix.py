"""SuffixDecoding (`suffix`) and hybrid drafting (`hybrid:DIR`): the suffix tree against slow brute-force
references, the drafts it makes, the global tree's FIFO bound, and losslessness of both through
`generate` and the engine (greedy equality; the joint law by chi-square, with a broken control)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from scipy.stats import chisquare

from selfdraft.config import ConfigError, GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters import Proposal
from selfdraft.drafters.hybrid import RULES, HybridDrafter, merge_chains
from selfdraft.engine import Engine
from selfdraft.loader import load_drafter
from selfdraft.methods.suffix.config import SuffixConfig
from selfdraft.methods.suffix.drafter import SuffixDrafter, draft_from
from selfdraft.methods.suffix.tree import SuffixTree
from selfdraft.scheduler import CostTable, Scheduler
from selfdraft.target import Target
from tests.helpers import tiny_llama
from tests.helpers import ModelDrafter, _sequence_law


# ----------------------------------------------------------------------------- slow references
def occurrences(seqs: list[list[int]], u: tuple[int, ...]) -> int:
    return sum(tuple(s[i : i + len(u)]) == u for s in seqs for i in range(len(s) - len(u) + 1))


def followers(seqs: list[list[int]], u: tuple[int, ...]) -> dict[int, int]:
    """Brute force: how often each token follows an occurrence of u."""
    return {t: n for t, (n, _) in followers_last(seqs, u).items()}


def followers_last(seqs, u) -> dict[int, tuple[int, tuple[int, int]]]:
    """Each follower of u: (count, (sequence, position) of its latest occurrence)."""
    out: dict[int, tuple[int, tuple[int, int]]] = {}
    for k, s in enumerate(seqs):
        for i in range(len(s) - len(u)):
            if tuple(s[i : i + len(u)]) == u:
                n, _ = out.get(s[i + len(u)], (0, None))
                out[s[i + len(u)]] = (n + 1, (k, i))
    return out


def walk(tree: SuffixTree, u) -> int:
    node = tree.root
    for t in u:
        node = node.children.get(t)
        if node is None:
            return 0
    return node.count


def reference_draft(seqs, context, gamma, cfg: SuffixConfig) -> tuple[list[int], list[float], int]:
    """The chain SuffixDecoding drafts, recomputed from substring counts."""
    m = 0
    for length in range(min(cfg.max_depth - gamma, len(context), cfg.max_depth - 1), 0, -1):
        if followers(seqs, tuple(context[-length:])):
            m = length
            break
    if m == 0:
        return [], [], 0
    n = max(1, min(gamma, int(cfg.max_spec_factor * m + cfg.max_spec_offset)))
    u, toks, probs, cum = tuple(context[-m:]), [], [], 1.0
    while len(toks) < n and len(u) < cfg.max_depth:
        f = followers_last(seqs, u)
        if not f:
            break
        t = max(f, key=lambda k: f[k])  # the most frequent; equally frequent: the latest
        p = f[t][0] / sum(n for n, _ in f.values())
        if cum * p < cfg.min_token_prob:
            break
        toks.append(t), probs.append(p)
        cum, u = cum * p, u + (t,)
    return toks, probs, m


# ----------------------------------------------------------------------------- the tree
@pytest.mark.parametrize("seed", range(4))
def test_tree_counts_every_substring_like_brute_force(seed):
    rng = random.Random(seed)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    tree = SuffixTree(max_depth=5)
    for s in seqs:
        tree.insert(s)
    distinct = {tuple(s[i : i + k]) for s in seqs for k in range(1, 6) for i in range(len(s) - k + 1)}
    assert tree.nodes == len(distinct)
    for u in distinct:
        assert walk(tree, u) == occurrences(seqs, u), u
    assert walk(tree, (9,)) == 0


def test_remove_leaves_the_tree_of_the_others():
    rng = random.Random(7)
    a, b = ([rng.randrange(3) for _ in range(40)] for _ in range(2))
    both, alone = SuffixTree(6), SuffixTree(6)
    both.insert(a), both.insert(b), alone.insert(b)
    both.remove(a)
    assert both.nodes == alone.nodes

    def dump(node, path=()):
        return {path: node.count} | {k: v for t, c in node.children.items() for k, v in dump(c, path + (t,)).items()}

    assert dump(both.root) == dump(alone.root)


@pytest.mark.parametrize("seed", range(6))
def test_chain_draft_equals_the_brute_force_reference(seed):
    rng = random.Random(seed)
    cfg = SuffixConfig(max_depth=8, max_spec_factor=rng.choice([1.0, 2.0, 4.0]), min_token_prob=rng.choice([0.0, 0.1, 0.3]))
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(20, 60))] for _ in range(2)]
    tree = SuffixTree(cfg.max_depth)
    for s in seqs:
        tree.insert(s)
    for _ in range(10):
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        d = draft_from(tree, context, 4, cfg)
        toks, probs, m = reference_draft(seqs, context, 4, cfg)
        assert d.match_len == m and d.tokens == toks and d.probs == pytest.approx(probs)


def test_tree_draft_expands_by_probability_and_keeps_parents_before_children():
    tree = SuffixTree(8)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9]):
        tree.insert(s)
    d = draft_from(tree, [0, 1], 5, SuffixConfig(max_depth=8, max_spec_factor=8, min_token_prob=0.1, tree=True))
    assert d.tokens[:3] == [2, 3, 4] or d.tokens[:2] == [2, 3]
    assert all(p < i for i, p in enumerate(d.parents))
    assert 7 in d.tokens and d.parents[d.tokens.index(7)] == -1  # the rarer first branch, at the root
    assert d.score == pytest.approx(sum(_cum(d)))


def _cum(d):
    out = []
    for p, parent in zip(d.probs, d.parents):
        out.append(p * (out[parent] if parent >= 0 else 1.0))
    return out


def test_a_draft_follows_the_frequencies_and_stops_below_min_token_prob():
    tree = SuffixTree(10)
    tree.insert([5, 6, 7, 8, 9] * 3 + [5, 6, 1])
    d = draft_from(tree, [4, 5, 6], 6, SuffixConfig(max_depth=10, max_spec_factor=3.0, min_token_prob=0.5))
    assert d.match_len == 2 and d.tokens == [7, 8, 9, 5, 6, 7]
    assert d.probs[0] == pytest.approx(3 / 4)  # 5 6 was followed by 7 three times, by 1 once
    short = draft_from(tree, [4, 5, 6], 6, SuffixConfig(max_depth=10, max_spec_factor=1.0, max_spec_offset=0))
    assert len(short.tokens) == 2  # at most factor x match length


def test_global_cache_is_fifo_bounded_and_shared_by_copies():
    import copy

    cfg = SuffixConfig(max_cached_requests=2)
    proto = SuffixDrafter(config=cfg)
    one, two = copy.copy(proto), copy.copy(proto)
    for d, resp in ((one, [1, 2, 3]), (two, [4, 5, 6]), (one, [7, 8, 9])):
        d.begin([0], None)
        d.end(resp)
    assert proto.cache is one.cache is two.cache and list(proto.cache.responses) == [[4, 5, 6], [7, 8, 9]]
    assert walk(proto.cache.tree, (1,)) == 0 and walk(proto.cache.tree, (7, 8)) == 1
    assert proto.cache.tree.bytes > 0
    # a request drafts from what an earlier one generated
    proto.begin([0], None)
    assert proto.draft([9, 4, 5], 3).tokens == [6]
    cold = SuffixDrafter(config=SuffixConfig(max_cached_requests=0))
    cold.end([1, 2, 3])
    assert cold.cache.tree.nodes == 0


@pytest.mark.parametrize("kw, match", [
    (dict(max_depth=1), "max_depth"), (dict(min_token_prob=1.5), "min_token_prob"),
    (dict(max_spec_factor=0), "max_spec_factor"), (dict(max_cached_requests=-1), "max_cached_requests"),
])
def test_absurd_suffix_options_are_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        SuffixConfig(**kw)


def test_merge_chains_shares_the_common_prefix():
    a, b = Proposal(torch.tensor([1, 2, 3])), Proposal(torch.tensor([1, 2, 9, 8]))
    m = merge_chains(a, b)
    assert m.tokens.tolist() == [1, 2, 3, 9, 8] and m.parents.tolist() == [-1, 0, 1, 1, 3]
    assert merge_chains(Proposal.empty(), b).parents.tolist() == [-1, 0, 1, 2]


# ----------------------------------------------------------------------------- losslessness
class ConfidentModelDrafter(ModelDrafter):
    """A second tiny LM with confidences c_k = max q_k, known before x_k is drawn (as DSpark's c_k):
    a stand-in for DSpark in the hybrid."""

    gives_confidences = True
    name = "confident-model"

    def propose(self, tokens, gamma, params, generator):
        p = super().propose(tokens, gamma, params, generator)
        if not len(p.tokens):
            return p
        return dataclasses.replace(p, confidences=p.q.max(-1).values)


def hybrids(vocab: int, **kw) -> dict[str, HybridDrafter]:
    return {rule: HybridDrafter(ConfidentModelDrafter(tiny_llama(vocab=vocab, seed=7, **kw)), SuffixDrafter(), rule)
            for rule in RULES}


def test_greedy_suffix_and_hybrid_equal_plain(tiny_target):
    prompt, n = [5, 17, 3, 5, 17, 3, 9, 40, 2, 5], 40
    plain = generate(tiny_target, load_drafter("none", tiny_target), prompt, config=GenerationConfig(max_new_tokens=n))
    drafters = {"suffix": SuffixDrafter(), "suffix+tree": load_drafter("suffix+tree", tiny_target),
                **hybrids(tiny_target.vocab_size)}
    table = CostTable((1, 4, 8), (100.0, 80.0, 50.0))
    for name, d in drafters.items():
        for sched in (None, Scheduler("hardware", cost=table)):
            res = generate(tiny_target, d, prompt, config=GenerationConfig(max_new_tokens=n, gamma=4), scheduler=sched)
            assert res.token_ids == plain.token_ids, (name, sched)
    assert generate(tiny_target, SuffixDrafter(), prompt, config=GenerationConfig(max_new_tokens=n)).tau > 1.0
    h = hybrids(tiny_target.vocab_size)["cost"]
    generate(tiny_target, h, prompt, config=GenerationConfig(max_new_tokens=n, gamma=4), scheduler=Scheduler("hardware", cost=table))
    assert h.picked["suffix"] > 0 and h.picked["neural"] > 0  # both proposers take part


V_SMALL, N_NEW = 5, 3


@pytest.fixture(scope="module")
def small_target() -> Target:
    return Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))


def joint_pvalue(target, make_drafter, n=1500, engine=False, scheduler=None) -> float:
    """Chi-square of (y_1..y_3) sampled with speculative decoding against the enumerated law."""
    prompt, params = [1, 3, 2], SamplingParams(temperature=1.0)
    law = _sequence_law(target, prompt, params)
    counts = dict.fromkeys(law, 0)
    cfg = GenerationConfig(max_new_tokens=N_NEW, gamma=3, stop_on_eos=False)
    if engine:
        eng = Engine(target, scheduler or Scheduler("fixed"), max_concurrency=4)
        for s in range(n):
            eng.add_request(prompt, make_drafter(), dataclasses.replace(params, seed=s), cfg)
        outs = [r.token_ids for r in eng.run().values()]
    else:
        outs = [generate(target, make_drafter(), prompt, dataclasses.replace(params, seed=s), cfg, scheduler=scheduler).token_ids
                for s in range(n)]
    for o in outs:
        counts[tuple(o)] += 1
    keys = [k for k in law if law[k] > 0]
    exp = torch.tensor([law[k] for k in keys], dtype=torch.float64)
    return float(chisquare([counts[k] for k in keys], (exp / exp.sum() * n).numpy()).pvalue)


@pytest.mark.parametrize("rule", RULES)
def test_hybrid_sampling_follows_the_target_law(small_target, rule):
    """Appendix A style: the joint law of the first tokens, through generate (hardware scheduler) and the engine.
    One suffix drafter is shared by all requests, so its global tree warms as they finish."""
    shared = SuffixDrafter(config=SuffixConfig(max_spec_factor=4.0, min_token_prob=0.0))
    neural = ConfidentModelDrafter(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=2, peaked=1.0))
    make = lambda: HybridDrafter(neural, SuffixDrafter(config=shared.config, cache=shared.cache), rule)  # noqa: E731
    table = CostTable((1, 2, 4), (100.0, 90.0, 40.0))
    assert joint_pvalue(small_target, make, n=800, scheduler=Scheduler("hardware", cost=table)) > 1e-3
    assert joint_pvalue(small_target, make, n=400, engine=True) > 1e-3


class PeekingHybrid(HybridDrafter):
    """Broken on purpose: it simulates verification with the request's own generator (the coins the
    verifier will draw) and proposes whichever draft would be accepted, or none when neither would. The draft then depends on the
    verification's randomness, which biases the output: the test above must be able to see this."""

    def __init__(self, target, *a, **kw):
        super().__init__(*a, **kw)
        self.target = target

    def propose_until(self, tokens, gamma, params, generator, admission):
        from selfdraft.verify import verify

        s = self.suffix.draft(tokens, gamma).proposal()
        n = self.neural.propose(tokens, gamma, params, generator)
        if generator is None:
            return n
        best, most = Proposal.empty(), 0
        for p in (s, n):  # the first that would have drafts accepted, else no drafts at all
            if not len(p.tokens):
                continue
            state = generator.get_state()
            logits = self.target.model(torch.tensor([tokens + p.tokens.tolist()])).logits[0, len(tokens) - 1 :]
            acc = verify(logits, p, params, generator).num_accepted
            generator.set_state(state)
            if acc > most:
                best, most = p, acc
        return best


def test_the_joint_law_test_catches_a_hybrid_that_peeks_at_verification(small_target):
    shared = SuffixDrafter(config=SuffixConfig(max_spec_factor=4.0, min_token_prob=0.0))
    neural = ConfidentModelDrafter(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=2, peaked=1.0))
    make = lambda: PeekingHybrid(small_target, neural, SuffixDrafter(config=shared.config, cache=shared.cache), "cost")  # noqa: E731
    assert joint_pvalue(small_target, make) < 1e-5


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("spec, match", [
    ("hybrid:", "needs a trained drafter"),
    ("hybrid:/no/such/dir", "not a drafter checkpoint directory"),
    ("hybrid+psychic:checkpoints", "unknown rule"),
    ("suffix+huge", "unknown suffix variant"),
])
def test_bad_drafter_specs_are_config_errors(tiny_target, spec, match):
    with pytest.raises(ConfigError, match=match):
        load_drafter(spec, tiny_target)


def test_hybrid_cost_rule_leaves_one_token_matches_to_the_trained_drafter(tiny_target):
    """After a one-token match every tree frequency is 1.0, so the cost rule would take that draft over any
    trained drafter; it asks the trained drafter instead (chosen None), and takes a two-token match's draft."""
    for context, match_len, suffix_wins in (([7, 8, 9, 6, 7], 1, False), ([6, 7, 8, 9, 6, 7], 2, True)):
        h = hybrids(tiny_target.vocab_size)["cost"]
        h.prompt_len, h.neural_value = 0, 1.5  # the trained drafter's rounds were worth 1.5 tokens
        sp, chosen = h._decide(context, 4, None)
        assert h.suffix.last.match_len == match_len and h.suffix.last.score >= 2  # a draft the old rule took
        assert (chosen is sp) == suffix_wins, context


def test_hybrid_cost_rule_refuses_a_drafter_without_confidences(tiny_target):
    with pytest.raises(ConfigError, match="has none"):
        HybridDrafter(ModelDrafter(tiny_llama(vocab=tiny_target.vocab_size, seed=7)), SuffixDrafter(), "cost")
    HybridDrafter(ModelDrafter(tiny_llama(vocab=tiny_target.vocab_size, seed=7)), SuffixDrafter(), "sam")  # fine


def test_cli_bad_suffix_and_hybrid_input_is_one_line_exit_2(tmp_path):
    """Absurd --suffix-* values and broken hybrid specs: exit 2 and one `error:` line, no traceback."""
    from typer.testing import CliRunner

    from selfdraft.cli import app
    from tests.helpers import char_tokenizer

    tok, d = char_tokenizer(), tmp_path / "tiny-chat"
    tiny_llama(vocab=len(tok), hidden=32, layers=2, seed=3, max_pos=512).save_pretrained(d)
    tok.save_pretrained(d)
    base = ["generate", "-p", "hello", "--target", str(d), "--dtype", "float32", "-n", "4"]
    cases = [
        (["--drafter", "suffix", "--suffix-min-token-prob", "2"], "min_token_prob must be in [0, 1]"),
        (["--drafter", "suffix", "--suffix-max-depth", "0"], "max_depth must be in [2, 1024]"),
        (["--drafter", "suffix", "--suffix-max-cached-requests", "-5"], "max_cached_requests"),
        (["--drafter", "hybrid:"], "needs a trained drafter"),
        (["--drafter", "hybrid:" + str(tmp_path / "missing")], "not a drafter checkpoint directory"),
        (["--drafter", "hybrid+nope:" + str(tmp_path)], "unknown rule"),
    ]
    for extra, match in cases:
        res = CliRunner().invoke(app, base + extra)
        assert res.exit_code == 2 and match in res.output and "Traceback" not in res.output, (extra, res.output)
        assert len([line for line in res.output.splitlines() if line.startswith("error:")]) == 1
    ok = CliRunner().invoke(app, base + ["--drafter", "suffix", "--json"])
    assert ok.exit_code == 0, ok.output
