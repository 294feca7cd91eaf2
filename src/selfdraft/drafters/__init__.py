"""Drafter kinds. Importing this package fills the registries (REGISTRY: no weights; TRAINED: from a
checkpoint). `selfdraft.loader.load_drafter` turns a name or a directory into a drafter."""

from __future__ import annotations

from selfdraft.drafters import dflash, dspark, eagle3, mtp, ngram, none  # noqa: F401  (registration side effects)
from selfdraft.drafters.base import REGISTRY, TRAINED, Drafter, Proposal, TrainedMethod, register, register_trained

__all__ = ["REGISTRY", "TRAINED", "Drafter", "Proposal", "TrainedMethod", "register", "register_trained"]
