"""SuffixDecoding's knobs: the one home of their defaults (the CLI's --suffix-* options read them)."""

from __future__ import annotations

from dataclasses import dataclass

from selfdraft.config import ConfigError


@dataclass(frozen=True)
class SuffixConfig:
    """max_depth follows SuffixDecoding (arXiv 2411.04975) and Arctic Inference; the draft length and
    probability floor were chosen by replaying greedy outputs of the bundled sets
    (docs/methods/suffix.md#choosing-the-defaults): Arctic's 1.0 / 0 / 0.1 cut drafts after short
    matches that prompt lookup would have followed. The cache bound is sized for trees of Python
    objects (docs/methods/suffix.md#memory)."""

    max_depth: int = 24  # longest path stored in a tree (match length + draft length)
    max_spec_factor: float = 4.0  # a draft of at most factor x match length + offset tokens (and γ)
    max_spec_offset: float = 2.0
    min_token_prob: float = 0.05  # stop once the draft's cumulative probability falls below this
    max_cached_requests: int = 64  # responses in the global tree (FIFO); 0 = no global tree (<= ~6k nodes, 1.8 MB each)
    # ...and at most this many MiB of tree (est. NODE_BYTES a node): a response can be 24 nodes a token,
    # so 64 responses near an 8k context would take ~4 GB
    max_cached_mb: int = 256
    tree: bool = False  # draft a tree (best-first by cumulative probability) instead of a chain

    def __post_init__(self) -> None:
        problems = []
        if not 2 <= self.max_depth <= 1024:
            problems.append(f"max_depth must be in [2, 1024], got {self.max_depth}")
        if not 0 < self.max_spec_factor <= 64:
            problems.append(f"max_spec_factor must be in (0, 64], got {self.max_spec_factor}")
        if not 0 <= self.max_spec_offset <= 64:
            problems.append(f"max_spec_offset must be in [0, 64], got {self.max_spec_offset}")
        if not 0 <= self.min_token_prob <= 1:
            problems.append(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if not 0 <= self.max_cached_requests <= 1_000_000:
            problems.append(f"max_cached_requests must be in [0, 1000000], got {self.max_cached_requests}")
        if not 1 <= self.max_cached_mb <= 1 << 20:
            problems.append(f"max_cached_mb must be in [1, {1 << 20}], got {self.max_cached_mb}")
        if problems:
            raise ConfigError("suffix: " + "; ".join(problems))
