"""MTP's config: the stacked DeepSeek-V3 modules and their depth weights (docs/methods/mtp.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfdraft.config import ConfigError, DrafterConfig, knob

if TYPE_CHECKING:
    from selfdraft.target import Target


@dataclass
class MTPConfig(DrafterConfig):
    method: str = "mtp"
    mtp_modules: int = knob(1, "D stacked DeepSeek-V3 modules")
    mtp_recursive: bool = knob(True, "also draft depths D+1..γ by reusing the last module (--mtp-stacked: D drafts)",
                               "--mtp-recursive/--mtp-stacked")
    mtp_normed_handoff: bool = knob(False, "depth d+1 reads the final-normed h^d (speculators' MTP) instead of h^d (DeepSeek-V3)")
    mtp_decay: float = knob(0.6, "depth d weighs mtp_decay^(d-1) (normalised)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mtp_modules < 1 or not self.mtp_decay > 0:
            raise ConfigError(f"mtp_modules >= 1 and mtp_decay > 0 are required (got {self.mtp_modules}, {self.mtp_decay})")

    def default_feature_layers(self, target: "Target") -> tuple[int, ...]:
        return ()  # MTP reads the target's final hidden state only
