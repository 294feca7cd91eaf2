"""`suffix`: SuffixDecoding (arXiv 2411.04975, docs/methods/suffix.md).

Each round: find the longest suffix of prompt + output (up to max_depth - γ tokens) that continues
somewhere in the request's own tree or in the global tree over earlier responses; from there, follow
the most frequent continuation while the cumulative probability Π P(x_k | ...) stays >= min_token_prob,
for at most max_spec_factor x match length + max_spec_offset tokens (and γ). The tree with the larger
score Σ_k Π_{i<=k} P(x_i | ...) (the expected number of accepted drafts if the frequencies were the
target's) gives the draft. Confidences are the conditional frequencies P(x_k | x_<k), so the
hardware-aware scheduler can price the drafts like DSpark's.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import torch

from selfdraft.drafters.base import Drafter, Proposal
from selfdraft.methods.suffix.config import SuffixConfig
from selfdraft.methods.suffix.tree import SuffixTree, continuation_probs
from selfdraft.tree import path_products


@dataclass
class GlobalSuffixCache:
    """Earlier responses of this process (the engine's and the server's requests share one), FIFO-bounded
    by count and by size (the oldest go first; a response alone over the size bound is not kept)."""

    config: SuffixConfig
    tree: SuffixTree = field(init=False)
    responses: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.tree = SuffixTree(self.config.max_depth)

    def clear(self) -> None:
        self.tree, self.responses = SuffixTree(self.config.max_depth), deque()

    def add(self, response: list[int]) -> None:
        if self.config.max_cached_requests == 0 or not response:
            return
        self.tree.insert(response)
        self.responses.append(list(response))
        limit = self.config.max_cached_mb << 20
        while self.responses and (len(self.responses) > self.config.max_cached_requests or self.tree.bytes > limit):
            self.tree.remove(self.responses.popleft())


@dataclass
class SuffixDraft:
    """A draft from one tree: tokens [n], parents [n] (tree mode) and per-token probabilities."""

    tokens: list[int]
    probs: list[float]  # P(x_k | its path): conditional on the drafts before it
    parents: list[int] | None
    match_len: int

    @property
    def score(self) -> float:
        """Σ_k of the cumulative path probability: expected accepted drafts (chain); for a tree,
        the expected number of accepted nodes."""
        return sum(path_products(list(range(-1, len(self.probs) - 1)) if self.parents is None else self.parents, self.probs))

    def proposal(self) -> Proposal:
        if not self.tokens:
            return Proposal.empty()
        toks, c = torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.probs, dtype=torch.float32)
        parents = None if self.parents is None else torch.tensor(self.parents, dtype=torch.long)
        return Proposal(toks, confidences=c, parents=parents)  # a tree's c_i: P(node | its parent), what sizes it


def draft_from(tree: SuffixTree, context: list[int], gamma: int, cfg: SuffixConfig) -> SuffixDraft:
    """The draft of one tree for `context` (its last token is the anchor)."""
    m = tree.match(context, max_len=max(1, cfg.max_depth - gamma))
    if m is None or gamma == 0:
        return SuffixDraft([], [], None, 0)
    n = min(gamma, int(cfg.max_spec_factor * m.length + cfg.max_spec_offset))
    n = max(1, n)
    if cfg.tree:
        return _tree_draft(m.node, n, gamma, cfg, m.length)
    tokens, probs, node, cum = [], [], m.node, 1.0
    while len(tokens) < n and node.children:
        t, p, child = continuation_probs(node)[0]
        if cum * p < cfg.min_token_prob:
            break
        tokens.append(t)
        probs.append(p)
        cum, node = cum * p, child
    return SuffixDraft(tokens, probs, None, m.length)


def _tree_draft(root, depth: int, nodes: int, cfg: SuffixConfig, match_len: int) -> SuffixDraft:
    """Best-first expansion by cumulative probability: at most `nodes` nodes, depth <= `depth`."""
    tokens, probs, parents = [], [], []
    heap = [(-p, i, t, p, child, -1, 1) for i, (t, p, child) in enumerate(continuation_probs(root))]
    heapq.heapify(heap)
    tie = len(heap)
    while heap and len(tokens) < nodes:
        neg_cum, _, t, p, node, parent, d = heapq.heappop(heap)
        if -neg_cum < cfg.min_token_prob:
            break
        me = len(tokens)
        tokens.append(t), probs.append(p), parents.append(parent)
        if d < depth:
            for t2, p2, child in continuation_probs(node):
                tie += 1
                heapq.heappush(heap, (neg_cum * p2, tie, t2, p2, child, me, d + 1))
    return SuffixDraft(tokens, probs, parents, match_len)


class SuffixDrafter(Drafter):
    """Per request: a tree over prompt + output (updated with each round's committed tokens); shared:
    a `GlobalSuffixCache` over earlier responses (copies of this drafter share it)."""

    name = "suffix"

    def __init__(self, target=None, config: SuffixConfig | None = None, cache: GlobalSuffixCache | None = None) -> None:
        self.config = config or SuffixConfig()
        self.cache = cache if cache is not None else GlobalSuffixCache(self.config)
        self.gives_confidences = not self.config.tree
        self.drafts_trees = self.config.tree
        self.local = SuffixTree(self.config.max_depth)
        self.seen = 0
        self.last: SuffixDraft | None = None  # the last round's draft (the hybrid reads its score)

    def begin(self, prompt_ids, step) -> None:
        self.local, self.seen = SuffixTree(self.config.max_depth), 0

    def draft(self, tokens: list[int], gamma: int) -> SuffixDraft:
        """The better of the request's and the global tree's drafts (larger score)."""
        self.local.extend(tokens[self.seen :])  # the committed tokens since the last round
        self.seen = len(tokens)
        best = draft_from(self.local, tokens, gamma, self.config)
        if self.cache.tree.nodes:
            other = draft_from(self.cache.tree, tokens, gamma, self.config)
            if other.score > best.score:
                best = other
        self.last = best
        return best

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        return self.draft(tokens, gamma).proposal()

    def end(self, generated: list[int]) -> None:
        self.cache.add(generated)

    def forget(self) -> None:
        self.cache.clear()
