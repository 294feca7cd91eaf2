"""Exact and near-duplicate prompt search: word n-gram Jaccard, exact, with a prefix filter.

A prompt is a set of word n-grams (`shingles`); two prompts are near-duplicates when the Jaccard
similarity of their sets |x ∩ y| / |x ∪ y| reaches a threshold t. `NearDupIndex` answers "which
indexed prompts are within t of this one?" without comparing against every prompt, and without
MinHash's misses: its answers equal a brute-force scan (tests/test_synthesize.py checks that).

Why it is exact (the prefix filter of all-pairs similarity joins, Chaudhuri et al. 2006): order all
n-grams by one fixed total order. J(x, y) >= t implies |x ∩ y| >= o := ceil(t * max(|x|, |y|)).
Take as x's prefix its first |x| - ceil(t|x|) + 1 n-grams in that order, likewise for y. If the
prefixes were disjoint, say x's prefix ends before y's, every common n-gram inside x's prefix
would lie inside y's prefix too, so all of x ∩ y would lie among x's last ceil(t|x|) - 1 n-grams:
fewer than o. So it suffices to look up the prefix n-grams, then verify each candidate exactly.
The order puts n-grams that are rare in the indexed corpus first, so prefixes hold rare n-grams
and the lists looked up stay short ("how do i" is common; "triangular prism volume" is not).
A size filter skips candidates that cannot reach t: t|x| <= |y| <= |x| / t.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"\w+")


def normalize(text: str) -> str:
    """Lowercased words joined by single spaces: what exact-duplicate detection compares."""
    return " ".join(WORD.findall(text.lower()))


def shingles(text: str, n: int = 3) -> np.ndarray:
    """The sorted, unique 64-bit hashes of the text's word n-grams (a shorter text: its words as one n-gram).

    Python's string hash is salted per process; the index and every query live in one process, and
    the search is exact for any order and any collision-free hash, so the salt changes nothing found.
    """
    words = normalize(text).split()
    grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)] or [" ".join(words)]
    return np.unique(np.fromiter((hash(g) for g in grams), dtype=np.int64, count=len(grams)))


def jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique hash arrays."""
    inter = len(np.intersect1d(x, y, assume_unique=True))
    return inter / (len(x) + len(y) - inter)


def prefix_length(size: int, threshold: float) -> int:
    """How many of a set's first n-grams (in the index order) must be looked up: size - ceil(t size) + 1."""
    return size - math.ceil(threshold * size - 1e-9) + 1


@dataclass
class Match:
    index: int  # position of the matching prompt in the order prompts were added
    similarity: float


class NearDupIndex:
    """Prompts indexed for exact and Jaccard near-duplicate queries.

    Built once from a reference corpus (`NearDupIndex(texts, ...)`: numpy arrays, so a corpus of
    hundreds of thousands of prompts costs tens of MB), then grown one prompt at a time with `add`
    (a dict: synthesis adds each prompt it keeps, so later ones are checked against it).
    """

    def __init__(self, texts: list[str] = (), threshold: float = 0.7, n: int = 3, labels: list[str] | None = None) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        self.threshold, self.n = threshold, n
        self.labels: list[str] = list(labels) if labels is not None else [""] * len(texts)
        self.exact: dict[str, int] = {}  # normalized text -> first index
        sets = [shingles(t, n) for t in texts]
        for i, t in enumerate(texts):
            self.exact.setdefault(normalize(t), i)
        # 1. the order: n-grams by their count in this corpus (rarest first), ties by hash value
        flat = np.concatenate(sets) if sets else np.zeros(0, dtype=np.int64)
        self._vocab, counts = np.unique(flat, return_counts=True)
        self._rank = np.empty(len(self._vocab), dtype=np.int64)
        self._rank[np.lexsort((self._vocab, counts))] = np.arange(len(self._vocab))
        # 2. the sets, concatenated (offsets), each kept sorted by hash for exact verification
        self._sizes = np.array([len(s) for s in sets], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self._flat = flat
        # 3. the prefix n-grams of every set -> (hash, set) pairs sorted by hash, for searchsorted lookups
        pre = [self._prefix(s) for s in sets]
        keys = np.concatenate(pre) if pre else np.zeros(0, dtype=np.int64)
        owners = np.repeat(np.arange(len(sets), dtype=np.int64), [len(p) for p in pre])
        order = np.argsort(keys, kind="stable")
        self._keys, self._owners = keys[order], owners[order]
        self._added: list[np.ndarray] = []  # sets added later, indices len(texts) + i
        self._added_prefix: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._sizes) + len(self._added)

    def _prefix(self, s: np.ndarray) -> np.ndarray:
        """The set's first prefix_length n-grams in the index order: (corpus rank, hash); n-grams the
        corpus lacks rank first (-1), so the order is total and fixed for every later set."""
        rank = np.full(len(s), -1, dtype=np.int64)
        if len(self._vocab):
            pos = np.minimum(np.searchsorted(self._vocab, s), len(self._vocab) - 1)
            rank = np.where(self._vocab[pos] == s, self._rank[pos], -1)
        order = np.lexsort((s, rank))
        return s[order[: prefix_length(len(s), self.threshold)]]

    def _set(self, i: int) -> np.ndarray:
        if i < len(self._sizes):
            return self._flat[self._offsets[i] : self._offsets[i + 1]]
        return self._added[i - len(self._sizes)]

    def add(self, text: str, label: str = "") -> int:
        """Index one more prompt; returns its index."""
        i = len(self)
        s = shingles(text, self.n)
        self._added.append(s)
        self.labels.append(label)
        self.exact.setdefault(normalize(text), i)
        for h in self._prefix(s).tolist():
            self._added_prefix.setdefault(h, []).append(i)
        return i

    def find_exact(self, text: str) -> int | None:
        """Index of an earlier prompt with the same normalized text, if any."""
        return self.exact.get(normalize(text))

    def matches(self, text: str) -> list[Match]:
        """Every indexed prompt with Jaccard >= threshold to `text`, by index."""
        x = shingles(text, self.n)
        lo, hi = self.threshold * len(x), len(x) / self.threshold
        candidates: set[int] = set()
        for h in self._prefix(x).tolist():
            a, b = np.searchsorted(self._keys, h, "left"), np.searchsorted(self._keys, h, "right")
            candidates.update(self._owners[a:b].tolist())
            candidates.update(self._added_prefix.get(h, ()))
        out = []
        for i in sorted(candidates):
            y = self._set(i)
            if lo - 1e-9 <= len(y) <= hi + 1e-9:
                sim = jaccard(x, y)
                if sim >= self.threshold - 1e-12:
                    out.append(Match(i, sim))
        return out

    def best(self, text: str) -> Match | None:
        """The most similar indexed prompt within the threshold (exact duplicates included), if any."""
        found = self.matches(text)
        return max(found, key=lambda m: (m.similarity, -m.index)) if found else None
