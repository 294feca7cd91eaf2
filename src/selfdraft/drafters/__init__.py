"""Drafter kinds. Importing this package fills the registry."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from selfdraft.config import ConfigError
from selfdraft.drafters import dflash, dspark, eagle3, mtp, ngram, none  # noqa: F401  (registration side effects)
from selfdraft.drafters.base import REGISTRY, Drafter, Proposal, register

if TYPE_CHECKING:
    from selfdraft.target import Target

__all__ = ["REGISTRY", "Drafter", "Proposal", "register", "load_drafter"]


def load_drafter(spec: str, target: "Target", **options) -> Drafter:
    """A registry name (`none`, `ngram`) or a trained drafter checkpoint directory."""
    if spec in REGISTRY:
        return REGISTRY[spec](target, **options)
    if Path(spec).is_dir():
        from selfdraft.checkpoint import load_checkpoint

        return load_checkpoint(spec, target)
    raise ConfigError(f"unknown drafter {spec!r}: use one of {sorted(REGISTRY)} or a checkpoint directory")
