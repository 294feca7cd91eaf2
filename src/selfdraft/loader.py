"""The one place a drafter spec becomes an inference `Drafter` (docs/architecture.md#drafters).

A spec is the name of a training-free method (`none`, `ngram`), a selfdraft checkpoint directory (checkpoint.py) or a
speculators directory (export.py: a drafter exported for vLLM, or released for the target elsewhere).
It sits above both formats, so neither imports the other and the drafters import neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from selfdraft import methods
from selfdraft.checkpoint import load_checkpoint
from selfdraft.config import ConfigError
from selfdraft.drafters import Drafter
from selfdraft.export import is_speculators_dir, load_speculators

if TYPE_CHECKING:
    from selfdraft.target import Target


def load_drafter(spec: str, target: "Target", **options) -> Drafter:
    """A training-free method's name, a selfdraft checkpoint directory or a speculators directory -> a drafter for `target`."""
    if spec in methods.METHODS and not methods.get(spec).trained:
        return methods.get(spec).new(target, **options)
    if Path(spec).is_dir():
        return load_speculators(spec, target) if is_speculators_dir(spec) else load_checkpoint(spec, target)
    raise ConfigError(f"unknown drafter {spec!r}: use one of {methods.names(trained=False)} or a checkpoint directory")
