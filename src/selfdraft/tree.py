"""Draft trees (SpecInfer / EAGLE-2): parent pointers -> tree attention mask, depth positions, paths.

A tree of N draft nodes hangs under the anchor (the last committed token, the root). Nodes come in
topological order with parent pointers, parents[i] < i, and -1 for a child of the anchor. The
target verifies the block [anchor, node_0, .., node_{N-1}] in ONE forward: block row 0 is the
anchor and row i + 1 is node i. Every row attends to the whole committed prefix (the KV cache) and,
inside the block, to itself and its ancestors; its position is past + depth (anchor depth 0), so a
root-to-leaf path sees exactly what a chain forward of that path would see (docs/verification.md#draft-trees).

After verification only the anchor's and the accepted path's rows stay in the KV cache, moved to
positions past, past + 1, .. (`Target.keep_rows`, called by `decode.Speculation.round`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_parents(parents: torch.Tensor) -> None:
    """parents: [N] int64 with -1 <= parents[i] < i (topological order); raises ValueError otherwise."""
    idx = torch.arange(parents.numel())
    if parents.dim() != 1 or bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError(f"parents must be a 1D tensor with -1 <= parents[i] < i, got {parents.tolist()}")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [N] depth of each node (a child of the anchor has depth 1)."""
    d = torch.zeros(parents.numel(), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        d[i] = 1 if p < 0 else d[p] + 1
    return d


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [N+1, N+1] bool over block rows [anchor, nodes]: row r may attend to column c
    iff c is r itself or one of r's ancestors (the anchor is everyone's ancestor)."""
    n = parents.numel()
    m = torch.eye(n + 1, dtype=torch.bool)
    m[:, 0] = True
    for i, p in enumerate(parents.tolist()):  # topological order: the parent's row is final
        m[i + 1] |= m[p + 1]
    return m


def children(parents: torch.Tensor) -> list[list[int]]:
    """Children (node indices, in order) of every block row: entry 0 = the anchor's, entry i + 1 = node i's."""
    kids: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i)
    return kids


def root_to_leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    """Every root-to-leaf path as node indices, leaves in index order."""
    kids = children(parents)
    paths = []
    for leaf in (i for i in range(parents.numel()) if not kids[i + 1]):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = int(parents[node])
        paths.append(path[::-1])
    return paths


def subtree(parents: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """The parents [M] of the nodes `keep` (closed under ancestors, each after its parent), re-indexed among them."""
    index = {old: new for new, old in enumerate(keep)}
    return torch.tensor([index[p] if p >= 0 else -1 for p in parents[keep].tolist()], dtype=torch.long)


def prune_depth(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the nodes of depth <= max_depth -> (kept node indices [M], re-indexed parents [M])."""
    keep = (depths(parents) <= max_depth).nonzero().flatten()
    return keep, subtree(parents, keep.tolist())


def keep_best(scores: list[float], depth: list[int], parents: list[int], total: int) -> tuple[list[int], torch.Tensor]:
    """EAGLE-2's rerank of a searched tree: the best total - 1 nodes by score (a child never outscores
    its parent, and ties go to the shallower node, so the set is closed under ancestors), in
    topological order (depth, then rank) -> (kept node indices, their parents [M] re-indexed, -1 = anchor)."""
    rank = sorted(range(len(scores)), key=lambda c: (-scores[c], depth[c], c))
    order = {c: r for r, c in enumerate(rank)}
    keep = sorted(rank[: total - 1], key=lambda c: (depth[c], order[c]))
    return keep, subtree(torch.tensor(parents, dtype=torch.long), keep)


def path_products(parents: list[int], c: list[float]) -> list[float]:
    """a_i = c_i · a_parent (a_anchor = 1): each node's product of c along its path (a chain: the
    prefix products). Nodes in topological order, parents[i] < i."""
    a: list[float] = []
    for ci, p in zip(c, parents):
        a.append(ci * (a[p] if p >= 0 else 1.0))
    return a


def conditionals(scores: list[float], parents: list[int], keep: list[int]) -> torch.Tensor:
    """[M] the drafter's own q(node | parent) = exp(score - parent's score) of the kept nodes (scores:
    Σ log q along each path): EAGLE-2's estimate of c_i, what `scheduler.tree_nodes` sizes trees by."""
    return torch.tensor([scores[c] - (scores[parents[c]] if parents[c] >= 0 else 0.0) for c in keep]).exp()


@dataclass
class TreeInputs:
    """What the target forward over [anchor, nodes] needs on top of the token ids."""

    position_ids: torch.Tensor  # [1, N+1] past + depth
    attention_mask: torch.Tensor  # [1, 1, N+1, past+N+1] additive float (0 = visible, dtype min = hidden)


def tree_inputs(parents: torch.Tensor, past: int, dtype: torch.dtype) -> TreeInputs:
    """Positions and the 4D additive mask (prefix fully visible, the tree block by ancestry).

    A float additive mask works with every HF attention backend (eager adds it, SDPA takes it as is)."""
    check_parents(parents)
    n = parents.numel()
    visible = torch.cat([torch.ones(n + 1, past, dtype=torch.bool), ancestor_mask(parents)], dim=1)
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    pos = past + torch.cat([torch.zeros(1, dtype=torch.long), depths(parents)])
    return TreeInputs(position_ids=pos[None], attention_mask=bias[None, None])

