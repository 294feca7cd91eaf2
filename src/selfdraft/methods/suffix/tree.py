"""A depth-bounded suffix tree (a trie of every substring of length <= max_depth) with occurrence counts.

Appending token t to a sequence s adds the substrings that end at t: for each suffix u of s
shorter than max_depth, the path u + t (one node each). `count(node)` is how many times the path
occurs; P(t | u) = count(u + t) / Σ_t' count(u + t'), the frequency with which u was followed by t
(SuffixDecoding, arXiv 2411.04975, §3). Removing a sequence subtracts the same counts, so the
global tree can evict its oldest response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NODE_BYTES = 300  # measured: a Node (slots) + its one-entry dict, 272 bytes, + the key int (sys.getsizeof)


class Node:
    __slots__ = ("count", "last", "children")

    def __init__(self) -> None:
        self.count = 0
        self.last = 0  # when the path last occurred (the tree's append clock): ties go to the most recent
        self.children: dict[int, Node] = {}


@dataclass
class Match:
    """The longest suffix of a context found in a tree with a continuation."""

    node: Node
    length: int  # tokens of the context matched


@dataclass
class SuffixTree:
    max_depth: int
    root: Node = field(default_factory=Node)
    nodes: int = 0
    clock: int = 0  # tokens appended so far
    _active: list[Node] = field(default_factory=list)  # nodes of the current sequence's suffixes (append)

    @property
    def bytes(self) -> int:
        return self.nodes * NODE_BYTES

    # ---------------------------------------------------------------- building
    def append(self, token: int) -> None:
        """Extend the sequence being inserted by one token (O(max_depth) dict operations)."""
        nxt = []
        self.clock += 1
        for node in [self.root] + self._active[: self.max_depth - 1]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
                self.nodes += 1
            child.count += 1
            child.last = self.clock
            nxt.append(child)
        self._active = nxt  # [suffix of length 1, 2, ...]

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def end_sequence(self) -> None:
        """The next append starts a new sequence (no path crosses from one sequence into the next)."""
        self._active = []

    def insert(self, tokens: list[int]) -> None:
        self.end_sequence()
        self.extend(tokens)
        self.end_sequence()

    def remove(self, tokens: list[int]) -> None:
        """Subtract a sequence inserted before; nodes whose count reaches 0 are dropped."""
        for i in range(len(tokens)):
            path = tokens[i : i + self.max_depth]
            node = self.root
            for t in path:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    self.nodes -= _size(child)
                    break
                node = child

    # ---------------------------------------------------------------- lookup
    def match(self, context: list[int], max_len: int) -> Match | None:
        """The longest suffix of `context` (<= max_len tokens) whose node has a continuation."""
        n = min(max_len, len(context), self.max_depth - 1)
        for length in range(n, 0, -1):
            node = self.root
            for t in context[len(context) - length :]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children:
                    return Match(node, length)
        return None


def _size(node: Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


def continuation_probs(node: Node) -> list[tuple[int, float, Node]]:
    """(token, P(token | path), child) for each continuation, most frequent first (equally frequent:
    the most recent first, as prompt lookup prefers the latest match)."""
    total = sum(c.count for c in node.children.values())
    items = sorted(node.children.items(), key=lambda tc: (-tc[1].count, -tc[1].last))
    return [(t, c.count / total, c) for t, c in items]
