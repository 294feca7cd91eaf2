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
    from selfdraft.methods.suffix.config import SuffixConfig
    from selfdraft.target import Target


SUFFIX_VARIANTS = {"tree": {"tree": True}, "cold": {"max_cached_requests": 0}}  # suffix+VARIANT


def load_drafter(spec: str, target: "Target", suffix: "SuffixConfig | None" = None, **options) -> Drafter:
    """A drafter spec -> a drafter for `target`:

    - a training-free method's name (`none`, `ngram`, `suffix`; `suffix+tree`, `suffix+cold`: tree drafts,
      no global tree), with `suffix` the SuffixConfig of the suffix drafters (the --suffix-* options);
    - a selfdraft checkpoint directory or a speculators directory;
    - `hybrid:DIR` or `hybrid+RULE:DIR` (RULE in drafters.hybrid.RULES): suffix drafts and DIR's, per round;
    - `tree:DIR`: DIR's drafter (DFlash, DSpark, EAGLE-3) drafting a tree each round.
    """
    head, colon, rest = spec.partition(":")
    if colon and (head == "hybrid" or head.startswith("hybrid+")):
        return _hybrid(head.partition("+")[2] or "cost", rest, target, suffix)
    if colon and head == "tree":
        return _tree(rest, target)
    name, _, variant = spec.partition("+")
    if name == "suffix":
        return _suffix(variant, suffix)
    if spec in methods.METHODS and not methods.get(spec).trained:
        return methods.get(spec).new(target, **options)
    if Path(spec).is_dir():
        return load_speculators(spec, target) if is_speculators_dir(spec) else load_checkpoint(spec, target)
    raise ConfigError(f"unknown drafter {spec!r}: use one of {methods.names(trained=False)}, suffix+tree, suffix+cold, "
                      "a checkpoint directory, hybrid:DIR or tree:DIR")


def is_drafter_spec(spec: str) -> bool:
    """Whether `spec` names a drafter without loading anything (bench's spec parsing)."""
    head, colon, rest = spec.partition(":")
    if colon and (head == "hybrid" or head.startswith("hybrid+") or head == "tree"):
        return True  # checked when loaded, with the reason
    name, plus, variant = spec.partition("+")
    if name == "suffix":
        return not plus or variant in SUFFIX_VARIANTS
    return spec in methods.names(trained=False) or Path(spec).expanduser().is_dir()


def _suffix(variant: str, config: "SuffixConfig | None"):
    from dataclasses import replace

    from selfdraft.methods.suffix.config import SuffixConfig

    if variant and variant not in SUFFIX_VARIANTS:
        raise ConfigError(f"unknown suffix variant {variant!r}: use suffix, " + ", ".join(f"suffix+{v}" for v in SUFFIX_VARIANTS))
    config = replace(config or SuffixConfig(), **SUFFIX_VARIANTS.get(variant, {}))
    return methods.get("suffix").new(None, config=config)


def _tree(source: str, target: "Target") -> Drafter:
    """`tree:DIR`: DIR's trained drafter drafting a tree each round (EAGLE-3: depth γ unless its config
    sets one; DFlash/DSpark: the block's tree, docs/methods/dflash.md#draft-trees)."""
    if not Path(source).is_dir():
        raise ConfigError(f"tree:{source}: {source} is not a drafter checkpoint directory (e.g. --drafter tree:checkpoints/dspark)")
    d = load_drafter(source, target)
    if not hasattr(d, "set_tree"):
        raise ConfigError(f"tree:{source}: a {d.name} drafter drafts chains only; trees come from dflash, dspark and eagle3 checkpoints")
    d.set_tree()
    return d


def _hybrid(rule: str, source: str, target: "Target", suffix: "SuffixConfig | None") -> Drafter:
    from selfdraft.drafters.hybrid import RULES, HybridDrafter

    if rule not in RULES:
        raise ConfigError(f"hybrid+{rule}: unknown rule; use one of " + ", ".join(f"hybrid+{r}:DIR" for r in RULES))
    if not source:
        raise ConfigError("hybrid: needs a trained drafter after the colon, e.g. --drafter hybrid:checkpoints/dspark")
    if not Path(source).is_dir():
        raise ConfigError(f"hybrid:{source}: {source} is not a drafter checkpoint directory "
                          "(e.g. --drafter hybrid:checkpoints/dspark)")
    neural = load_drafter(source, target)
    return HybridDrafter(neural, _suffix("", suffix), rule, source)
