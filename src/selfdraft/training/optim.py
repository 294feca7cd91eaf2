"""The optimizer and its schedule: AdamW over the drafter's parameters, linear warmup, then a cosine.

The learning rate is a pure function of (step, tokens) and the segment's origin, so a resumed run
needs no scheduler state beyond the origin that trainer_state.pt keeps
(docs/training.md#checkpoints-and-resuming). `start_optimizer` is the run's setup step between the
distributed wrap and the loop: AdamW over the parameters the run trains, a resumed run's state loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from selfdraft.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from selfdraft.training.checkpointing import RunState
    from selfdraft.training.distributed import Distributed


@dataclass(frozen=True)
class ScheduleOrigin:
    """Where the cosine's current segment starts: (step, tokens) and the progress reached there. A run
    starts at (0, 0, 0); resuming with another `steps` or `token_budget` starts a new segment at the
    resume point, so the learning rate goes on from where it was instead of jumping."""

    step: int = 0
    tokens: int = 0
    progress: float = 0.0


def schedule_progress(step: int, tokens: int, cfg: TrainConfig, origin: ScheduleOrigin = ScheduleOrigin()) -> float:
    """The cosine's progress after warmup: the larger of the step and token fractions of the current
    segment, mapped onto what was left of the schedule at its origin (>= 1: done)."""
    s0 = max(origin.step, cfg.warmup_steps)
    frac = (step - s0) / max(1, cfg.steps - s0)
    if cfg.token_budget:
        frac = max(frac, (tokens - origin.tokens) / max(1, cfg.token_budget - origin.tokens))
    return origin.progress + (1.0 - origin.progress) * max(0.0, frac)


def lr_at(step: int, tokens: int, cfg: TrainConfig, origin: ScheduleOrigin = ScheduleOrigin()) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine down to min_lr_ratio.

    The cosine follows the run's progress, the larger of step/steps and tokens/token_budget, so it
    ends where training stops whichever limit is hit first. A pure function of (step, tokens) and the
    segment's origin, which trainer_state.pt keeps: resuming needs no other scheduler state.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, schedule_progress(step, tokens, cfg, origin))))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, new_params: list[str] = ()) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable parameters only (the target is frozen and not a submodule):
    one group at lr, and, when a warm start added parameters and cfg.new_lr is set, a second group of
    those at new_lr (each group's `lr_scale` is its rate over the schedule's lr)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("the drafter module has no trainable parameters")
    new = set(new_params) if cfg.new_lr else set()
    groups = [{"params": [p for n, p in named if n not in new], "lr_scale": 1.0}]
    if new:
        groups.append({"params": [p for n, p in named if n in new], "lr_scale": cfg.new_lr / cfg.lr})
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def resumed_origin(saved: dict, cfg: TrainConfig) -> ScheduleOrigin:
    """The schedule segment a resumed run goes on with (saved: its trainer_state.pt): the saved one, or,
    for a longer (or shorter) run, a new one at the resume point that continues the cosine from the
    progress reached, over what is left."""
    origin = ScheduleOrigin(*saved.get("schedule_origin", (0, 0, 0.0)))
    saved_cfg = replace(cfg, steps=saved["train"]["steps"], token_budget=saved["train"]["token_budget"])
    if (saved_cfg.steps, saved_cfg.token_budget) == (cfg.steps, cfg.token_budget):
        return origin
    p = schedule_progress(saved["step"], saved["tokens"], saved_cfg, origin) if saved["step"] >= cfg.warmup_steps else 0.0
    return ScheduleOrigin(saved["step"], saved["tokens"], min(1.0, p))


def start_optimizer(run: "RunState", cfg: TrainConfig, dist: "Distributed") -> None:
    """Give `run` its AdamW and schedule segment: fresh, or a resumed run's saved ones. Called once the
    module is wrapped (`Distributed.wrap`): FSDP replaces the parameters with shards, which the optimizer
    must hold, and the saved (full) optimizer state is sharded like them."""
    run.opt = make_optimizer(run.model, cfg, run.new_params)
    if run.saved is not None:
        dist.load_optimizer_state(run.model, run.opt, run.saved["optimizer"])
        run.origin = resumed_origin(run.saved, cfg)
