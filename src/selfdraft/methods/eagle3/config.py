"""EAGLE-3's config: its draft vocabulary, training-time test and draft tree (docs/methods/eagle3.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfdraft.config import ConfigError, DrafterConfig, knob

if TYPE_CHECKING:
    from selfdraft.target import Target


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low / mid / high = [1, L/2 - 1, L - 4] (docs/architecture.md#feature-layers), deduplicated for very shallow targets."""
    return tuple(sorted({1, num_layers // 2 - 1, num_layers - 4} & set(range(num_layers - 1)))) or (0,)


@dataclass
class Eagle3Config(DrafterConfig):
    method: str = "eagle3"
    draft_vocab_size: int = knob(8192, "own LM head over the N most frequent training tokens (0 or >= target vocab = all)")
    ttt_decay: float = knob(0.8, "training-time test: step j (0-based) weighs ttt_decay^j")
    tree_depth: int = knob(0, "EAGLE-2 dynamic draft tree of this depth at inference (0 = chain of γ drafts)")
    tree_top_k: int = knob(10, "draft tree: children expanded per frontier node, and frontier nodes kept per depth")
    tree_total_tokens: int = knob(60, "draft tree: nodes verified per round, anchor included")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_vocab_size < 0 or not self.ttt_decay > 0:
            raise ConfigError("draft_vocab_size >= 0 (0 = full vocab) and ttt_decay > 0 are required")
        if self.tree_depth < 0 or self.tree_top_k < 1 or self.tree_total_tokens < 2:
            raise ConfigError(f"tree_depth >= 0 (0 = chain), tree_top_k >= 1 and tree_total_tokens >= 2 are required "
                              f"(got {self.tree_depth}, {self.tree_top_k}, {self.tree_total_tokens})")

    def default_feature_layers(self, target: "Target") -> tuple[int, ...]:
        return eagle3_feature_layers(target.num_layers)
