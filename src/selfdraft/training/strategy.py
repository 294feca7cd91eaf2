"""The contract between the generic training loop and each drafter kind.

A trainable method = one `Strategy` in `STRATEGIES`: it computes the loss on a batch of target
states and prepares data-dependent parts of a fresh module. Building the module and wrapping it as
an inference `Drafter` belong to inference (drafters.base.TRAINED); the strategy forwards to them.
Each method's registry entry there names its strategy ("module:attribute"), which `STRATEGIES`
imports on first use: the drafters never import training code.
The target's embedding and LM head are shared and frozen: drafter modules never register them
as submodules (they receive the `Target` as an argument), so checkpoints hold drafter weights only.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfdraft.config import DrafterConfig
from selfdraft.drafters import TRAINED

if TYPE_CHECKING:
    from selfdraft.drafters.base import Drafter
    from selfdraft.target import Target


@dataclass
class Batch:
    """Target states for a micro-batch of B sequences of length T (right-padded)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool: assistant tokens (predict these)
    attention_mask: torch.Tensor  # [B, T] bool: real (non-pad) tokens
    features: torch.Tensor  # [B, T, n_feat, H] outputs of cfg.feature_layers
    last_hidden: torch.Tensor  # [B, T, H] final hidden state; p_t = target.lm_head(last_hidden)
    lse: torch.Tensor | None = None  # [B, T] float32 log-partition of p_t over the full vocabulary (cached), or None

    def target_lse(self, target: "Target") -> torch.Tensor:
        """[B, T] the cached log-partition of p_t, or computed now (one full LM-head pass, no grad)."""
        if self.lse is None:
            from selfdraft.training.objectives import target_lse

            self.lse = target_lse(target, self.last_hidden)
        return self.lse


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    tokens: int  # supervised (position-weighted) targets in this batch, for tokens/s
    metrics: dict[str, float] = field(default_factory=dict)  # "ce", "tv", "conf", "acc@1".. "acc@γ"


class Strategy:
    """One per method. Subclasses set `method` and implement `loss` (and `prepare` if needed);
    build / default_feature_layers / drafter are the method's inference entry (drafters.base.TRAINED)."""

    method: str = ""

    def build(self, cfg: DrafterConfig, target: "Target") -> torch.nn.Module:
        return TRAINED[self.method].build(cfg, target)

    def default_feature_layers(self, target: "Target") -> tuple[int, ...]:
        """Feature layers when the config gives none (docs/architecture.md#feature-layers)."""
        return TRAINED[self.method].feature_layers(target)

    def prepare(self, model: torch.nn.Module, cfg: DrafterConfig, target: "Target", data_dir: str) -> None:
        """Data-dependent initialisation of a freshly built module (EAGLE-3: the draft vocabulary)."""

    def loss(
        self, model: torch.nn.Module, batch: Batch, target: "Target", cfg: DrafterConfig, generator: torch.Generator
    ) -> LossOutput:
        raise NotImplementedError

    def drafter(self, model: torch.nn.Module, cfg: DrafterConfig, target: "Target") -> "Drafter":
        return TRAINED[self.method].drafter(model, cfg, target)


class StrategyRegistry(Mapping):
    """method -> its training `Strategy`: the object each TRAINED entry names, imported on first use,
    plus strategies registered directly (`register_strategy`, e.g. a test's toy method)."""

    def __init__(self) -> None:
        self._loaded: dict[str, Strategy] = {}

    def _named(self) -> dict[str, str]:
        return {name: m.strategy for name, m in TRAINED.items() if m.strategy}

    def __getitem__(self, method: str) -> Strategy:
        if method not in self._loaded:
            where = self._named().get(method)
            if where is None:
                raise KeyError(method)
            module, _, attr = where.partition(":")
            self._loaded[method] = getattr(importlib.import_module(module), attr)
        return self._loaded[method]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._named()) | set(self._loaded)))

    def __len__(self) -> int:
        return len(set(self._named()) | set(self._loaded))

    def register(self, strategy: Strategy) -> Strategy:
        if strategy.method in self:
            raise ValueError(f"strategy {strategy.method!r} registered twice")
        self._loaded[strategy.method] = strategy
        return strategy

    def __delitem__(self, method: str) -> None:
        del self._loaded[method]


STRATEGIES = StrategyRegistry()


def register_strategy(strategy: Strategy) -> Strategy:
    """Register a strategy directly (a method whose TRAINED entry names no strategy)."""
    return STRATEGIES.register(strategy)
