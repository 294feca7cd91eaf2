"""Draft trees: mask/positions vs a slow reference, tree forward == chain forwards, only the accepted
path's KV stays, the sibling rule against enumeration, and lossless tree decoding (greedy + chi-square)."""

from __future__ import annotations

import pytest
import torch

import selfdraft.verify as verify_mod
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters import Drafter, Proposal
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.sampling import sample
from selfdraft.target import Target
from selfdraft.tree import (
    ancestor_mask,
    depths,
    prune_depth,
    root_to_leaf_paths,
    tree_inputs,
)
from selfdraft.verify import TreeVerification, verify_tree
from tests.helpers import ArgmaxTreeDrafter, V_SMALL, _spec_pvalue, tiny_llama  # noqa: F401

PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 5, -1])  # 9 nodes, depth up to 4


def slow_ancestors(parents: list[int], i: int) -> set[int]:
    """Block rows visible to node i (row i + 1): itself, its ancestors and the anchor (row 0)."""
    rows, node = {0}, i
    while node >= 0:
        rows.add(node + 1)
        node = parents[node]
    return rows


def test_mask_and_positions_equal_slow_reference():
    par = PARENTS.tolist()
    past = 5
    t = tree_inputs(PARENTS, past, torch.float32)
    n = len(par)
    assert t.attention_mask.shape == (1, 1, n + 1, past + n + 1)
    visible = t.attention_mask[0, 0] == 0
    for r in range(n + 1):
        rows = {0} if r == 0 else slow_ancestors(par, r - 1)
        expected = [True] * past + [c in rows for c in range(n + 1)]
        assert visible[r].tolist() == expected, r
        depth, node = 0, r - 1
        while node >= 0:
            depth, node = depth + 1, par[node]
        assert int(t.position_ids[0, r]) == past + depth
    assert torch.equal(ancestor_mask(PARENTS), visible[:, past:])
    paths = root_to_leaf_paths(PARENTS)
    assert paths == [[0, 3], [1, 4], [0, 2, 6], [0, 2, 5, 7], [8]]
    keep, sub = prune_depth(PARENTS, 2)
    assert keep.tolist() == [0, 1, 2, 3, 4, 8] and sub.tolist() == [-1, -1, 0, 0, 1, -1]
    assert depths(sub).max() == 2


def test_tree_forward_equals_chain_forward_per_path(tiny_target):
    prompt = torch.tensor([[3, 9, 4, 7, 1]])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (PARENTS.numel(),), generator=g)
    anchor = 11
    cache = tiny_target.new_cache()
    tiny_target.forward(prompt, cache)
    t = tree_inputs(PARENTS, prompt.shape[1], torch.float32)
    block = torch.cat([torch.tensor([anchor]), tokens])[None]
    tree = tiny_target.forward(block, cache, (1, 2), t.position_ids, t.attention_mask)
    for path in root_to_leaf_paths(PARENTS):
        chain = torch.cat([prompt[0], torch.tensor([anchor]), tokens[path]])[None]
        ref = tiny_target.forward(chain, None, (1, 2))
        rows = [0] + [i + 1 for i in path]
        torch.testing.assert_close(tree.logits[0, rows], ref.logits[0, prompt.shape[1] :], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tree.features[0, rows], ref.features[0, prompt.shape[1] :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", [[], [8], [0, 2, 5, 7], [1, 4]])
def test_keep_rows_keeps_exactly_the_accepted_kv(tiny_target, path):
    """After keeping the accepted path's rows (what a tree round does) the next decode step's logits
    equal a fresh forward over the committed sequence."""
    prompt = [3, 9, 4, 7, 1]
    tokens = torch.randint(0, 96, (PARENTS.numel(),), generator=torch.Generator().manual_seed(1))
    anchor, nxt = 11, 42
    cache = tiny_target.new_cache()
    tiny_target.forward(torch.tensor([prompt]), cache)
    t = tree_inputs(PARENTS, len(prompt), torch.float32)
    step = tiny_target.forward(torch.cat([torch.tensor([anchor]), tokens])[None], cache, (), t.position_ids, t.attention_mask)
    rows = [0] + [i + 1 for i in path]
    tiny_target.keep_rows(cache, len(prompt), torch.tensor(rows))
    kept = step.logits[:, rows]
    committed = prompt + [anchor] + tokens[path].tolist()
    assert cache.get_seq_length() == len(committed) and kept.shape[1] == len(path) + 1
    after = tiny_target.forward(torch.tensor([[nxt]]), cache)
    fresh = tiny_target.forward(torch.tensor([committed + [nxt]]), None)
    torch.testing.assert_close(after.logits[0, -1], fresh.logits[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[0], fresh.logits[0, len(prompt) : -1], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the sibling rule
def _broken_tree(p, tokens, parents, generator=None) -> TreeVerification:
    """A plausible bug: after rejecting a sibling, keep its mass (no p(x) = 0 before the next try)."""
    from selfdraft.tree import children

    kids, row, path = children(parents), 0, []
    while True:
        for child in kids[row]:
            if float(torch.rand((), generator=generator)) < float(p[row, int(tokens[child])]):
                path.append(child)
                row = child + 1
                break
        else:
            t = int(sample(p[row], generator))
            return TreeVerification(len(path), t, [int(tokens[i]) for i in path] + [t], path)


def _first_token_pvalue(verifier, n=6000) -> float:
    """Context-free p over 4 tokens, three siblings at the root: the first emitted token must follow p."""
    from scipy.stats import chisquare

    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25] * 4, [0.25] * 4, [0.25] * 4])
    tokens, parents = torch.tensor([2, 0, 1]), torch.tensor([-1, -1, -1])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(n):
        counts[verifier(p, tokens, parents, g).tokens[0]] += 1
    return float(chisquare(counts.numpy(), (p[0] * n).numpy()).pvalue)


def test_sibling_rule_matches_target_law_and_broken_rule_fails():
    assert _first_token_pvalue(verify_tree) > 1e-3
    assert _first_token_pvalue(_broken_tree) < 1e-6


def test_greedy_tree_walks_the_argmax_path():
    V = 6
    logits = torch.randn(PARENTS.numel() + 1, V, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1)
    tokens = torch.randint(0, V, (PARENTS.numel(),), generator=torch.Generator().manual_seed(3))
    # node 0 (under the anchor, row 0) and its second child node 3 (row 1) match; its first child node 2 not
    tokens[0], tokens[2], tokens[3] = best[0], (best[1] + 1) % V, best[1]
    p = torch.nn.functional.one_hot(best, V).float()
    v = verify_tree(p, tokens, PARENTS)
    assert v.path[:2] == [0, 3] and v.tokens[:2] == [int(best[0]), int(best[1])]
    assert v.next_token == int(best[v.path[-1] + 1])


# --------------------------------------------------------------------------- decoding with trees
class RandomTreeDrafter(Drafter):
    """Deterministic drafts from its own RNG: a random tree of random tokens each round (no model)."""

    name = "random-tree"

    def __init__(self, vocab: int, nodes: int = 8, seed: int = 0) -> None:
        self.vocab, self.nodes, self.g = vocab, nodes, torch.Generator().manual_seed(seed)

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        parents = torch.tensor([int(torch.randint(-1, i, (), generator=self.g)) if i else -1 for i in range(self.nodes)])
        return Proposal(torch.randint(0, self.vocab, (self.nodes,), generator=self.g), parents=parents)


class ModelTreeDrafter(Drafter):
    """A second tiny LM drafts a binary tree of depth 2 from its top-2 tokens: deterministic given the
    context and correlated with p (random trees would hide a biased rule: its bias averages out)."""

    name = "model-tree"
    drafts_trees = True

    def __init__(self, model) -> None:
        self.model, self.memo = model, {}

    @torch.inference_mode()
    def top2(self, seq: list[int]) -> tuple[list[int], list[float]]:
        """The top-2 tokens after seq and their probabilities (the c_i a scheduler sizes the tree by)."""
        if tuple(seq) not in self.memo:  # the chi-square test revisits few contexts thousands of times
            top = self.model(torch.tensor([seq])).logits[0, -1].softmax(-1).topk(2)
            self.memo[tuple(seq)] = top.indices.tolist(), top.values.tolist()
        return self.memo[tuple(seq)]

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        (a, b), c = self.top2(list(tokens))
        (aa, ab), ca = self.top2(list(tokens) + [a])
        (ba, bb), cb = self.top2(list(tokens) + [b])
        return Proposal(torch.tensor([a, b, aa, ab, ba, bb]), confidences=torch.tensor(c + ca + cb),
                        parents=torch.tensor([-1, -1, 0, 0, 1, 1]))


def test_greedy_tree_decoding_equals_plain_greedy(tiny_target):
    prompt = [5, 17, 3, 42, 8]
    n = 30
    plain = generate(tiny_target, NoDrafter(), prompt, config=GenerationConfig(max_new_tokens=n))
    for drafter in (RandomTreeDrafter(96), ArgmaxTreeDrafter(tiny_target)):
        for gamma in (1, 4):
            res = generate(tiny_target, drafter, prompt, config=GenerationConfig(max_new_tokens=n, gamma=gamma))
            assert res.token_ids == plain.token_ids, (drafter.name, gamma)
    oracle = generate(tiny_target, ArgmaxTreeDrafter(tiny_target), prompt, config=GenerationConfig(max_new_tokens=n, gamma=4))
    assert oracle.tau > 4.0  # the good branch sits behind a wrong sibling at every depth


@pytest.fixture(scope="module")
def small_vocab_target() -> Target:
    return Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))


def _tree_drafter() -> ModelTreeDrafter:
    return ModelTreeDrafter(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=2, peaked=1.0))


def test_sampling_tree_is_lossless_chi_square(small_vocab_target):
    assert _spec_pvalue(small_vocab_target, _tree_drafter(), SamplingParams(temperature=1.0)) > 1e-3


def test_sampling_tree_sized_by_the_scheduler_is_lossless_chi_square(small_vocab_target, monkeypatch):
    """The hardware scheduler keeps the nodes whose a_i pays on a falling cost table (some rounds verify
    both children of the anchor, others one): the choice reads only the drafts, which are deterministic
    given the context, so the output law stays p's."""
    from selfdraft.scheduler import CostTable, Scheduler

    sizes, rule_of = [], Scheduler.tree_rule

    def recorded(self, overhead_s=0.0):
        rule = rule_of(self, overhead_s)
        return lambda parents, c: sizes.append(len(kept := rule(parents, c))) or kept

    monkeypatch.setattr(Scheduler, "tree_rule", recorded)
    table = CostTable((1, 2, 3), (10.0, 8.0, 6.5))
    p = _spec_pvalue(small_vocab_target, _tree_drafter(), SamplingParams(temperature=1.0), scheduler=Scheduler("hardware", cost=table))
    assert p > 1e-3
    assert {1, 2} <= set(sizes), sorted(set(sizes))  # 3 tokens: round 1 may verify depth 1 (2 nodes)


def test_chi_square_catches_a_broken_sibling_rule(small_vocab_target, monkeypatch):
    monkeypatch.setattr(verify_mod, "verify_tree", _broken_tree)
    assert _spec_pvalue(small_vocab_target, _tree_drafter(), SamplingParams(temperature=1.0)) < 1e-6
