"""A training run's state on disk: start a run, resume it exactly, warm-start it, save it atomically.

The checkpoint directory holds the drafter (docs/training.md#checkpoints-and-resuming) plus
`trainer_state.pt` (optimizer, step, tokens, RNG, data cursor, schedule origin; tensors and primitives
only, loaded with weights_only) and `train_log.jsonl` (every step and validation). `save` writes all of
it into a temporary directory and swaps it in, so a kill -9 at any moment leaves the last complete save.
"""

from __future__ import annotations

import json
import pickle
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from selfdraft.checkpoint import (
    CONFIG_FILE,
    atomic_dir,
    check_target,
    load_module,
    provenance,
    read_config,
    recover_interrupted_save,
    write_checkpoint_files,
)
from selfdraft.config import ConfigError, DrafterConfig, TrainConfig
from selfdraft.methods import drafter_config
from selfdraft.target import Target
from selfdraft.training.distributed import Distributed
from selfdraft.training.optim import ScheduleOrigin
from selfdraft.training.strategy import Strategy

STATE_FILE, LOG_FILE = "trainer_state.pt", "train_log.jsonl"
# Optional DFlash/DSpark inputs a warm start may add to a drafter trained without them (context_residual,
# context_next_token): zero, so the drafter drafts what the checkpoint drafted until training moves them.
NEW_AT_ZERO = ("slot_context.", "next_token.")
# TrainConfig fields that define the optimisation trajectory: a resumed run must keep them.
# (steps, token_budget, val/save cadence and the data path may change: e.g. to train longer.)
TRAJECTORY_KEYS = (
    "batch_size", "grad_accum", "max_seq_len", "lr", "warmup_steps", "min_lr_ratio",
    "weight_decay", "grad_clip", "bf16", "seed",
)  # fmt: skip


@dataclass
class StepLog:
    step: int  # optimizer steps done, counting this one
    lr: float
    loss: float  # mean over the step's micro-batches
    tokens: int  # sequence tokens consumed so far (the token budget counts these)
    grad_norm: float
    tokens_per_s: float
    metrics: dict[str, float] = field(default_factory=dict)  # the strategy's: "ce", "acc@1", ...


@dataclass
class ValLog:
    step: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class DataCursor:
    """Position in the training stream: epoch e visits the sequences in a permutation seeded by (seed, e)."""

    epoch: int = 0
    index: int = 0  # next position within the epoch's permutation

    def take(self, n_items: int, count: int, seed: int) -> list[int]:
        """Indices of the next `count` sequences; advances the cursor across epoch boundaries."""
        out: list[int] = []
        while len(out) < count:
            perm = torch.randperm(n_items, generator=torch.Generator().manual_seed(seed * 1_000_003 + self.epoch))
            take = perm[self.index : self.index + count - len(out)].tolist()
            out += take
            self.index += len(take)
            if self.index >= n_items:
                self.epoch, self.index = self.epoch + 1, 0
        return out


@dataclass
class RunState:
    """Everything a run changes as it goes; `save` writes all of it. `start_or_resume` gives the run's
    start, `optim.start_optimizer` its optimizer and schedule segment."""

    model: torch.nn.Module
    gen: torch.Generator  # the strategy's sampling (anchors, ...)
    cursor: DataCursor
    step: int = 0
    tokens: int = 0
    history: list[StepLog] = field(default_factory=list)
    val: list[ValLog] = field(default_factory=list)
    saved: dict | None = None  # a resumed run's trainer_state.pt (its optimizer state and schedule origin)
    opt: torch.optim.AdamW | None = None  # built once the module is wrapped (FSDP replaces the parameters)
    origin: ScheduleOrigin = ScheduleOrigin()  # the learning-rate schedule's current segment
    new_params: list[str] = field(default_factory=list)  # what a warm start added: they train at new_lr


def start_or_resume(
    target: Target, strategy: Strategy, cfg: DrafterConfig, train_cfg: TrainConfig, out_dir: Path, resume: bool, n_train: int,
    dist: Distributed | None = None,
) -> RunState:
    """Where the run begins: a fresh drafter seeded by train_cfg.seed (float32 master weights; autocast
    runs it in bf16), warm-started from train_cfg.init_from, or the run saved in out_dir restored
    exactly (on every rank). The optimizer comes later (`optim.start_optimizer`), over the wrapped module."""
    dist = dist or Distributed()
    torch.manual_seed(train_cfg.seed)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    if dist.rank == 0:
        recover_interrupted_save(out_dir)
    dist.barrier()
    if not (resume and (out_dir / CONFIG_FILE).exists()):
        model = strategy.build(cfg, target).to(device=target.model.device, dtype=torch.float32).train()
        strategy.prepare(model, cfg, target, train_cfg.data)  # data-dependent init (EAGLE-3 draft vocab)
        new = warm_start(model, cfg, target, train_cfg.init_from) if train_cfg.init_from else []
        return RunState(model, gen, DataCursor(), new_params=new)
    state = check_resumable(out_dir, target, cfg, train_cfg, n_train)
    model = load_module(out_dir, target, dtype=torch.float32).model.to(target.model.device).train()  # with the target, as a fresh run's
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    history, val = _read_log(out_dir / LOG_FILE, state["step"])
    cursor = DataCursor(state["epoch"], state["index"])
    return RunState(model, gen, cursor, state["step"], state["tokens"], history, val, saved=state,
                    new_params=state.get("new_params", []))


# Buffers a warm start keeps from `prepare` (the new data's draft vocabulary), not from the checkpoint.
DATA_BUFFERS = ("draft_ids",)


def warm_start(model: torch.nn.Module, cfg: DrafterConfig, target: Target, src: str) -> list[str]:
    """Copy the trained weights of checkpoint `src` into the fresh `model` (same method, same shapes)
    -> the names of the parameters it added (they train at TrainConfig.new_lr).

    A DFlash or DSpark model with more decoder layers than `src` grows: the saved layers keep their
    places and each new one `layers.i` (i >= the saved count) starts as the identity of its pre-norm
    residual block (o_proj and down_proj zero), so the grown drafter drafts what `src` drafts at step 0.
    Likewise a DFlash or DSpark run that adds `context_residual` or `context_next_token` to a drafter
    trained without them: W_s / W_e start at zero.
    """
    saved = load_module(src, target, dtype=torch.float32)
    if saved.cfg.method != cfg.method:
        raise ConfigError(f"--init-from {src}: a {saved.cfg.method} drafter cannot start a {cfg.method} run")
    mine = model.state_dict()
    theirs = {k: v for k, v in saved.model.state_dict().items() if k.split(".")[-1] not in DATA_BUFFERS}
    # only a residual stack of decoder layers (num_layers: DFlash, DSpark) grows; MTP's layers are separate depths
    n_saved = getattr(saved.cfg, "num_layers", 0)
    grows = getattr(cfg, "num_layers", 0) > n_saved > 0
    grown = sorted(k for k in mine if grows and k.startswith("layers.") and int(k.split(".")[1]) >= n_saved)
    grown += [k for k in mine if k.startswith(NEW_AT_ZERO) and k not in theirs]  # W_s / W_e, new: start at zero
    bad = sorted(k for k in mine if k.split(".")[-1] not in DATA_BUFFERS and k not in grown
                 and (k not in theirs or theirs[k].shape != mine[k].shape))
    if bad or set(theirs) - set(mine):
        raise ConfigError(f"--init-from {src}: its weights do not fit this drafter config (missing or reshaped: "
                          f"{bad[:5]}; extra: {sorted(set(theirs) - set(mine))[:5]}); train with its config.json's drafter settings")
    model.load_state_dict(theirs, strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grown and (name.rsplit(".", 2)[-2] in ("o_proj", "down_proj") or name.startswith(NEW_AT_ZERO)):
                p.zero_()  # the residual block (or W_s) adds nothing until training moves it
    new = sorted({int(k.split(".")[1]) for k in grown if k.startswith("layers.")})
    print(f"warm start: drafter weights from {src} ({sum(v.numel() for v in theirs.values()) / 1e6:.1f}M values)"
          + (f"; new layers {new} start as the identity" if new else "")
          + ("; " + ", ".join(sorted({k.split(".")[0] for k in grown if k.startswith(NEW_AT_ZERO)})) + " start at zero"
             if any(k.startswith(NEW_AT_ZERO) for k in grown) else ""),
          file=sys.stderr)
    return [name for name, _ in model.named_parameters() if name in grown]


def save(run: RunState, out_dir: Path, target: Target, cfg: DrafterConfig, train_cfg: TrainConfig, n_train: int,
          dist: Distributed | None = None) -> None:  # fmt: skip
    """Atomically write the drafter checkpoint plus trainer_state.pt (tensors and primitives only) and the log.

    Distributed: every rank takes part in gathering the full state (FSDP shards it), rank 0 alone
    writes, and all ranks wait until the directory is complete.
    """
    dist = dist or Distributed()
    model_state, opt_state = dist.full_state(run.model, run.opt)
    if dist.rank == 0:
        state = {
            "step": run.step, "tokens": run.tokens, "epoch": run.cursor.epoch, "index": run.cursor.index,
            "n_train": n_train, "train": asdict(train_cfg), "optimizer": opt_state,
            "generator": run.gen.get_state(), "torch_rng": torch.get_rng_state(), "world_size": dist.world,
            "schedule_origin": [run.origin.step, run.origin.tokens, run.origin.progress],
            "new_params": run.new_params,
        }  # fmt: skip
        with atomic_dir(out_dir) as tmp:
            prov = provenance(train_cfg.data, run.step, run.tokens, train=asdict(train_cfg), world_size=dist.world)
            write_checkpoint_files(tmp, _StateView(run.model, model_state), cfg, target, prov)
            torch.save(state, tmp / STATE_FILE)
            _write_log(tmp / LOG_FILE, run.history, run.val)
    dist.barrier()


def check_resumable(out_dir: Path, target: Target, cfg: DrafterConfig, train_cfg: TrainConfig, n_train: int) -> dict:
    """Load trainer_state.pt after checking the checkpoint continues *this* run; say how to proceed if not."""
    meta = read_config(out_dir)
    check_target(meta, target, out_dir)
    if not (out_dir / STATE_FILE).exists():
        raise ConfigError(f"{out_dir} holds a drafter without {STATE_FILE}: it cannot be resumed; pass --no-resume to overwrite it")
    saved = drafter_config({**meta["drafter"], "method": meta["method"]}, legacy=True)
    if saved != cfg:
        diff = {k: (v, getattr(cfg, k)) for k, v in asdict(saved).items() if v != getattr(cfg, k)}
        raise ConfigError(f"{out_dir} was trained with another drafter config (saved, now): {diff}; use the same settings, or --no-resume")
    # map_location: a GPU run's optimizer state loads anywhere (the optimizer moves it to its parameters' device)
    try:
        state = torch.load(out_dir / STATE_FILE, weights_only=True, map_location="cpu")
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # a truncated or damaged file
        raise ConfigError(f"{out_dir / STATE_FILE} is damaged and cannot be read ({str(e).splitlines()[0]}); "
                          "pass --no-resume to train afresh") from e
    diff = {k: (state["train"][k], getattr(train_cfg, k)) for k in TRAJECTORY_KEYS if state["train"][k] != getattr(train_cfg, k)}
    if diff:
        raise ConfigError(f"resuming {out_dir} with other training settings (saved, now): {diff}; use the saved ones, or --no-resume")
    if state["n_train"] != n_train:
        raise ConfigError(f"the training data changed since {out_dir} was saved ({state['n_train']} -> {n_train} sequences); use --no-resume")
    return state


def _write_log(path: Path, history: list[StepLog], val: list[ValLog]) -> None:
    lines = [json.dumps({"kind": "train", **asdict(h)}) for h in history]
    lines += [json.dumps({"kind": "val", **asdict(v)}) for v in val]
    path.write_text("".join(line + "\n" for line in lines))


def _read_log(path: Path, upto: int) -> tuple[list[StepLog], list[ValLog]]:
    """The history of the run being resumed, up to its saved step."""
    history, val = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            kind = rec.pop("kind")
            if rec["step"] <= upto and kind == "train":
                history.append(StepLog(**rec))
            elif rec["step"] <= upto:
                val.append(ValLog(**rec))
    return history, val


class _StateView:
    """Hands write_checkpoint_files a gathered state dict (FSDP) in place of the module."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state
