"""The contract between the generic training loop and each drafter kind.

A trainable method = one `Strategy` (its package's train.py): it computes the loss on a batch of
target states and prepares data-dependent parts of a fresh module. Building the module and wrapping
it as an inference `Drafter` belong to inference (the method's `selfdraft.methods.Method`); the
strategy forwards to them. Each method names its strategy ("module:attribute"), which `STRATEGIES`
imports on first use: inference modules never import training code.
The target's embedding and LM head are shared and frozen: drafter modules never register them
as submodules (they receive the `Target` as an argument), so checkpoints hold drafter weights only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfdraft import methods
from selfdraft.config import DrafterConfig

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
    argmax: torch.Tensor | None = None  # [B, T] int64 argmax of p_t, computed on first use
    # Training tokens seen before this batch (the trainer sets it; loss schedules such as DSpark's
    # kl_to_tv_tokens read it). None = the schedule's end: validation and direct calls.
    tokens_seen: int | None = None

    def target_lse(self, target: "Target") -> torch.Tensor:
        """[B, T] the cached log-partition of p_t, or computed now (one full LM-head pass, no grad)."""
        if self.lse is None:
            self._lm_head_pass(target)
        return self.lse

    def target_argmax(self, target: "Target") -> torch.Tensor:
        """[B, T] argmax of p_t at every position (the target's greedy next token), computed once."""
        if self.argmax is None:
            self._lm_head_pass(target)
        return self.argmax

    def _lm_head_pass(self, target: "Target") -> None:
        """One LM-head pass fills both statistics (a cached lse from the feature cache is kept)."""
        from selfdraft.training.objectives import target_stats

        stats = target_stats(target, self.last_hidden)
        self.lse = stats.lse if self.lse is None else self.lse
        self.argmax = stats.argmax


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    tokens: int  # supervised (position-weighted) targets in this batch, for tokens/s
    metrics: dict[str, float] = field(default_factory=dict)  # "ce", "tv", "conf", "acc@1".. "acc@γ"


class Strategy:
    """One per method. Subclasses set `method` and implement `loss` (and `prepare` if needed);
    build / drafter are the method's inference entry (selfdraft.methods.get(method))."""

    method: str = ""

    def build(self, cfg: DrafterConfig, target: "Target") -> torch.nn.Module:
        return methods.get(self.method).build(cfg, target)

    def prepare(self, model: torch.nn.Module, cfg: DrafterConfig, target: "Target", data_dir: str) -> None:
        """Data-dependent initialisation of a freshly built module (EAGLE-3: the draft vocabulary)."""

    def loss(
        self, model: torch.nn.Module, batch: Batch, target: "Target", cfg: DrafterConfig, generator: torch.Generator
    ) -> LossOutput:
        raise NotImplementedError

    def drafter(self, model: torch.nn.Module, cfg: DrafterConfig, target: "Target") -> "Drafter":
        return methods.get(self.method).wrap(model, cfg, target)


class StrategyRegistry(Mapping):
    """method -> its training `Strategy`: the object its `selfdraft.methods.Method` names, imported on use."""

    def _named(self) -> dict[str, str]:
        return {name: methods.get(name).strategy for name in methods.names(trained=True) if methods.get(name).strategy}

    def __getitem__(self, method: str) -> Strategy:
        if method not in self._named():
            raise KeyError(method)
        m = methods.get(method)
        return m.part(m.strategy)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._named()))

    def __len__(self) -> int:
        return len(self._named())


STRATEGIES = StrategyRegistry()
