"""The one generic training loop, shared by every drafter kind (a `Strategy` supplies the loss).

nanoGPT style: `train()` is the whole loop on one screen, with numbered steps. The target is
frozen and runs online under no-grad to give each micro-batch its feature-layer and last hidden
states; only the drafter's parameters are optimised (AdamW, linear warmup + cosine, gradient
clipping, bf16 autocast, gradient accumulation). A checkpoint (docs/training.md#checkpoints-and-resuming) plus
`trainer_state.pt` (optimizer, step, tokens, RNG, data position) is written atomically every
`save_every` steps, so `resume=True` continues the exact same run after a kill.

Data parallel: under `torchrun --nproc_per_node N` (WORLD_SIZE, RANK, LOCAL_RANK in the environment)
the loop runs on N processes (gloo on CPU, NCCL on GPU). `batch_size` stays the GLOBAL micro-batch:
every rank advances the same data cursor and takes its own batch_size / N slice, the drafter is
wrapped in DistributedDataParallel (or sharded with FSDP, `TrainConfig.fsdp`), and rank 0 alone writes
checkpoints, logs and the progress bar. So the optimisation trajectory does not depend on N, and a run
resumes under another world size.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

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
from selfdraft.progress import progress_bar
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES, Batch, LossOutput, Strategy

if TYPE_CHECKING:
    from selfdraft.training.features import CachedSequence

STATE_FILE, LOG_FILE = "trainer_state.pt", "train_log.jsonl"
# TrainConfig fields that define the optimisation trajectory: a resumed run must keep them.
# (steps, token_budget, val/save cadence and the data path may change: e.g. to train longer.)
TRAJECTORY_KEYS = (
    "batch_size", "grad_accum", "max_seq_len", "lr", "warmup_steps", "min_lr_ratio",
    "weight_decay", "grad_clip", "bf16", "seed",
)  # fmt: skip


# ------------------------------------------------------------------ results and logs
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
class TrainResult:
    out_dir: Path
    steps: int
    tokens: int
    stopped_by: str  # "steps" | "token_budget"
    resumed_from: int  # step the run resumed at (0 = fresh start)
    elapsed_s: float  # this invocation only
    history: list[StepLog] = field(default_factory=list)  # every step, including those before a resume
    val: list[ValLog] = field(default_factory=list)

    @property
    def final_val(self) -> ValLog | None:
        return self.val[-1] if self.val else None


# ------------------------------------------------------------------ data
@dataclass
class Sequence:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token (supervised)
    cached: "CachedSequence | None" = None  # target states from a feature cache (None = run the target online)


def load_sequences(data_dir: str | Path, split: str, max_seq_len: int, features: str = "online",
                   target: Target | None = None) -> list[Sequence]:
    """The dataset's `split` records, truncated to max_seq_len.

    With `features` a cache directory (`selfdraft data features`), the target's states come from the
    memory-mapped cache instead of the dataset, which saves the target forward in every training run.
    Records with nothing left to supervise after truncation are dropped.
    """
    from selfdraft.training.records import load_records
    from selfdraft.training.features import FeatureCache

    if features == "online":
        pairs = [(rec["input_ids"], rec["loss_mask"], None) for rec in load_records(data_dir, split)]
    else:
        cache = FeatureCache(features, split)
        if target is not None:
            cache.check_target(target)
        # The dataset's record order (the cache stores records sorted by length), so a run visits the
        # same sequences whichever way its features come.
        order = {rec["id"]: i for i, rec in enumerate(load_records(data_dir, split))}
        pairs = []
        for i in sorted(range(len(cache)), key=lambda i: order.get(cache.entries[i][1]["id"], len(order))):
            c = cache[i]
            pairs.append((c.input_ids.tolist(), c.loss_mask.int().tolist(), c))
    seqs = []
    for ids, mask, cached in pairs:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if len(ids) >= 2 and any(mask[1:]):
            seqs.append(Sequence(ids, mask, cached))
    return seqs


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


def make_batch(seqs: list[Sequence], target: Target, feature_layers: tuple[int, ...]) -> Batch:
    """Right-pad B sequences to the longest (T) and run the frozen target on them (no grad).

    Features and last hidden states come back in float32 as ordinary (non-inference) tensors, so
    drafter modules with float32 master weights can use and backpropagate through them.
    """
    device = target.model.device
    T = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)  # [B, T]; pad id 0 is never attended
    loss_mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    attn = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        loss_mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        attn[b, :n] = True
    ids, loss_mask, attn = to_device(ids, device), to_device(loss_mask, device), to_device(attn, device)
    if all(s.cached is not None for s in seqs):
        feats = torch.zeros(len(seqs), T, len(feature_layers), target.hidden_size)  # [B, T, n_feat, H]
        last = torch.zeros(len(seqs), T, target.hidden_size)  # [B, T, H]
        lse = torch.zeros(len(seqs), T) if all(s.cached.lse is not None for s in seqs) else None  # [B, T]
        for b, s in enumerate(seqs):
            n = len(s.input_ids)
            feats[b, :n], last[b, :n] = s.cached.features[:n].float(), s.cached.last_hidden[:n].float()
            if lse is not None:
                lse[b, :n] = s.cached.lse[:n]
    else:
        lse = None  # computed by the loss when it needs it (Batch.target_lse)
        step = target.forward(ids, None, feature_layers, attention_mask=attn.long(), last_only=True)
        last = step.last_hidden.to(torch.float32, copy=True)
        no_feats = last.new_zeros(*last.shape[:2], 0, last.shape[-1])  # [B, T, 0, H]: no feature layers (MTP)
        feats = step.features.to(torch.float32, copy=True) if feature_layers else no_feats
    return Batch(
        input_ids=ids,
        loss_mask=loss_mask & attn,
        attention_mask=attn,
        features=to_device(feats, device),  # [B, T, n_feat, H]
        last_hidden=to_device(last, device),  # [B, T, H]
        lse=None if lse is None else to_device(lse, device),  # [B, T]
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor on `device`: to a GPU through pinned memory, asynchronously (the copy
    overlaps the work already queued; the source is never written again); unchanged when it is there."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ------------------------------------------------------------------ schedule
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


# ------------------------------------------------------------------ the loop
def train(
    target: Target,
    drafter_cfg: DrafterConfig,
    train_cfg: TrainConfig,
    out_dir: str | Path,
    strategy: Strategy | None = None,
    resume: bool = True,
    on_step: Callable[[StepLog], None] | None = None,
) -> TrainResult:
    """Train a drafter of kind `drafter_cfg.method` on `train_cfg.data`; the checkpoint goes to `out_dir`.

    `strategy` defaults to STRATEGIES[drafter_cfg.method] and must be that registered object, since
    loading and resuming rebuild the module from the registry. `on_step` is called after every optimizer
    step (and after that step's checkpoint, if any): for logging, or to stop a run in tests.
    """
    dist = Distributed.from_env(target, train_cfg)
    try:
        return _train(target, drafter_cfg, train_cfg, out_dir, strategy, resume, on_step, dist)
    finally:
        dist.close()


@dataclass
class Plan:
    """What a run trains on, resolved before any module exists: the method's strategy, the drafter
    config with its feature layers filled in, and the train / validation sequences."""

    strategy: Strategy
    cfg: DrafterConfig
    train_seqs: list[Sequence]
    val_seqs: list[Sequence]


def _plan(target: Target, drafter_cfg: DrafterConfig, train_cfg: TrainConfig, strategy: Strategy | None) -> Plan:
    strategy = strategy or strategy_for(drafter_cfg.method)
    if STRATEGIES.get(drafter_cfg.method) is not strategy:
        raise ConfigError(
            f"strategy {strategy.method!r} is not the one registered for drafter_cfg.method {drafter_cfg.method!r}: "
            "name it in the method's selfdraft.methods.Method (its `strategy`)"
        )
    if target.model.dtype != torch.float32 and not train_cfg.bf16:
        raise ConfigError(f"a {target.model.dtype} target needs bf16 autocast: enable bf16, or load the target in float32")
    cfg = replace(drafter_cfg, feature_layers=drafter_cfg.feature_layers or drafter_cfg.default_feature_layers(target))
    if train_cfg.features != "online":
        from selfdraft.training.features import FeatureCache

        cached_layers = FeatureCache(train_cfg.features).feature_layers
        if cached_layers != tuple(cfg.feature_layers):
            raise ConfigError(f"feature cache {train_cfg.features} holds layers {cached_layers}, the drafter reads "
                              f"{cfg.feature_layers}: pass --feature-layers {','.join(map(str, cached_layers))} or rebuild the cache")
    train_seqs = load_sequences(train_cfg.data, "train", train_cfg.max_seq_len, train_cfg.features, target)
    val_seqs = load_sequences(train_cfg.data, "val", train_cfg.max_seq_len, train_cfg.features, target)[: train_cfg.val_batches * train_cfg.batch_size]
    if not train_seqs:
        raise ConfigError(f"{train_cfg.data} has no usable train records (need >= 2 tokens and a supervised token)")
    return Plan(strategy, cfg, train_seqs, val_seqs)


def _train(target, drafter_cfg, train_cfg, out_dir, strategy, resume, on_step, dist: "Distributed") -> TrainResult:
    t_start = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    # 1. Resolve the method, the feature layers and the data.
    plan = _plan(target, drafter_cfg, train_cfg, strategy)
    strategy, cfg, train_seqs = plan.strategy, plan.cfg, plan.train_seqs

    # 2. Build the drafter (float32 master weights; autocast runs it in bf16) and AdamW, or resume both.
    run = _start_or_resume(target, strategy, cfg, train_cfg, out_dir, resume, len(train_seqs), dist)
    resumed_from = run.step
    autocast = torch.autocast(target.model.device.type, dtype=torch.bfloat16, enabled=train_cfg.bf16)
    gen, model, opt, cursor = run.gen, run.model, run.opt, run.cursor
    wrapped = dist.wrap(model, strategy, target, cfg)  # the module whose forward computes the loss (DDP / FSDP / plain)
    if dist.fsdp:  # fully_shard replaced the parameters (DTensors): the optimizer must hold the new ones
        run.opt = opt = _optimizer(model, train_cfg)
    if run.opt_state is not None:  # resumed: the optimizer state, loaded after a possible FSDP sharding
        dist.load_optimizer_state(model, opt, run.opt_state)

    by_tokens = bool(train_cfg.token_budget)  # the budget usually ends a run before `steps`: count what ends it
    bar = progress_bar(total=train_cfg.token_budget if by_tokens else train_cfg.steps,
                       initial=min(run.tokens, train_cfg.token_budget) if by_tokens else run.step,
                       unit="tok" if by_tokens else "step", desc=f"train {cfg.method}", disable=dist.rank != 0)
    while run.step < train_cfg.steps and not (train_cfg.token_budget and run.tokens >= train_cfg.token_budget):
        # 3. One optimizer step: lr from the schedule, grad_accum micro-batches, clip, update.
        t0 = time.perf_counter()
        lr = lr_at(run.step, run.tokens, train_cfg, run.origin)
        for group in opt.param_groups:
            group["lr"] = lr
        step_tokens, outs = 0, []
        for micro in range(train_cfg.grad_accum):
            # Every rank advances the same global cursor and keeps its own slice of the global batch.
            idx = dist.shard(cursor.take(len(train_seqs), train_cfg.batch_size, train_cfg.seed))
            batch = make_batch([train_seqs[i] for i in idx], target, cfg.feature_layers)  # the frozen target runs here, no grad
            sync = dist.no_sync(wrapped) if micro + 1 < train_cfg.grad_accum else nullcontext()  # all-reduce once per step
            with sync:
                with autocast:
                    out = wrapped(batch, gen)  # strategy.loss (DDP averages the gradients over ranks)
                (out.loss / train_cfg.grad_accum).backward()
            outs.append(out)
            step_tokens += int(batch.attention_mask.sum())
        grad_norm = dist.clip_grad_norm(model, train_cfg.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_tokens = dist.sum_int(step_tokens)  # tokens of the global batch (the token budget is global)
        run.step, run.tokens = run.step + 1, run.tokens + step_tokens

        # 4. Log, validate, checkpoint.
        loss, metrics = _mean_outputs(outs)
        loss = dist.mean_float(loss)
        log = StepLog(run.step, lr, loss, run.tokens, float(grad_norm), step_tokens / (time.perf_counter() - t0), metrics)
        run.history.append(log)
        shown = {k: f"{v:.3f}" for k, v in metrics.items() if k in ("acc@1", "acc@2", "acc@3")}
        bar.set_postfix(loss=f"{loss:.4f}", **shown, tok_s=f"{log.tokens_per_s:.0f}", lr=f"{lr:.2e}")
        bar.update(step_tokens if by_tokens else 1)
        if train_cfg.val_every and run.step % train_cfg.val_every == 0:
            _validate_run(run, plan, wrapped, target, train_cfg, autocast, dist, bar)
        if train_cfg.save_every and run.step % train_cfg.save_every == 0:
            _save(run, out_dir, target, cfg, train_cfg, len(train_seqs), dist)
        if on_step:
            on_step(log)
    bar.close()

    # 5. Final validation and checkpoint, unless this step already had them (or nothing was trained).
    if run.step > resumed_from:
        if not (run.val and run.val[-1].step == run.step):
            _validate_run(run, plan, wrapped, target, train_cfg, autocast, dist, bar)
        if not (train_cfg.save_every and run.step % train_cfg.save_every == 0):
            _save(run, out_dir, target, cfg, train_cfg, len(train_seqs), dist)
    return TrainResult(
        out_dir=out_dir,
        steps=run.step,
        tokens=run.tokens,
        stopped_by="steps" if run.step >= train_cfg.steps else "token_budget",
        resumed_from=resumed_from,
        elapsed_s=time.perf_counter() - t_start,
        history=run.history,
        val=run.val,
    )


# ------------------------------------------------------------------ run state: start, resume, save
@dataclass
class RunState:
    """Everything a run changes as it goes; `_save` writes all of it, `_start_or_resume` restores it."""

    model: torch.nn.Module
    opt: torch.optim.AdamW
    gen: torch.Generator  # the strategy's sampling (anchors, ...)
    cursor: DataCursor
    step: int = 0
    tokens: int = 0
    history: list[StepLog] = field(default_factory=list)
    val: list[ValLog] = field(default_factory=list)
    opt_state: dict | None = None  # a resumed run's saved optimizer state (loaded once the module is wrapped)
    origin: ScheduleOrigin = ScheduleOrigin()  # the learning-rate schedule's current segment


def _start_or_resume(
    target: Target, strategy: Strategy, cfg: DrafterConfig, train_cfg: TrainConfig, out_dir: Path, resume: bool, n_train: int,
    dist: "Distributed | None" = None,
) -> RunState:
    """A fresh run seeded by train_cfg.seed, or the run saved in out_dir restored exactly (on every rank)."""
    dist = dist or Distributed()
    torch.manual_seed(train_cfg.seed)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    if dist.rank == 0:
        recover_interrupted_save(out_dir)
    dist.barrier()
    if not (resume and (out_dir / CONFIG_FILE).exists()):
        model = strategy.build(cfg, target).to(device=target.model.device, dtype=torch.float32).train()
        strategy.prepare(model, cfg, target, train_cfg.data)  # data-dependent init (EAGLE-3 draft vocab)
        if train_cfg.init_from:
            _warm_start(model, cfg, target, train_cfg.init_from)
        return RunState(model, _optimizer(model, train_cfg), gen, DataCursor())
    state = _check_resumable(out_dir, target, cfg, train_cfg, n_train)
    model = load_module(out_dir, target, dtype=torch.float32).model.to(target.model.device).train()  # with the target, as a fresh run's
    opt = _optimizer(model, train_cfg)
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    history, val = _read_log(out_dir / LOG_FILE, state["step"])
    cursor = DataCursor(state["epoch"], state["index"])
    origin = ScheduleOrigin(*state.get("schedule_origin", (0, 0, 0.0)))
    saved_cfg = replace(train_cfg, steps=state["train"]["steps"], token_budget=state["train"]["token_budget"])
    if (saved_cfg.steps, saved_cfg.token_budget) != (train_cfg.steps, train_cfg.token_budget):
        # a longer (or shorter) run: the cosine goes on from the progress reached, over what is left
        p = schedule_progress(state["step"], state["tokens"], saved_cfg, origin) if state["step"] >= train_cfg.warmup_steps else 0.0
        origin = ScheduleOrigin(state["step"], state["tokens"], min(1.0, p))
    return RunState(model, opt, gen, cursor, state["step"], state["tokens"], history, val, opt_state=state["optimizer"],
                    origin=origin)


# Buffers a warm start keeps from `prepare` (the new data's draft vocabulary), not from the checkpoint.
DATA_BUFFERS = ("draft_ids",)


def _warm_start(model: torch.nn.Module, cfg: DrafterConfig, target: Target, src: str) -> None:
    """Copy the trained weights of checkpoint `src` into the fresh `model` (same method, same shapes)."""
    saved = load_module(src, target, dtype=torch.float32)
    if saved.cfg.method != cfg.method:
        raise ConfigError(f"--init-from {src}: a {saved.cfg.method} drafter cannot start a {cfg.method} run")
    mine = model.state_dict()
    theirs = {k: v for k, v in saved.model.state_dict().items() if k.split(".")[-1] not in DATA_BUFFERS}
    bad = sorted(k for k in mine if k.split(".")[-1] not in DATA_BUFFERS and (k not in theirs or theirs[k].shape != mine[k].shape))
    if bad or set(theirs) - set(mine):
        raise ConfigError(f"--init-from {src}: its weights do not fit this drafter config (missing or reshaped: "
                          f"{bad[:5]}; extra: {sorted(set(theirs) - set(mine))[:5]}); train with its config.json's drafter settings")
    model.load_state_dict(theirs, strict=False)
    print(f"warm start: drafter weights from {src} ({sum(v.numel() for v in theirs.values()) / 1e6:.1f}M values)", file=sys.stderr)


def _save(run: RunState, out_dir: Path, target: Target, cfg: DrafterConfig, train_cfg: TrainConfig, n_train: int,
          dist: "Distributed | None" = None) -> None:  # fmt: skip
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
        }  # fmt: skip
        with atomic_dir(out_dir) as tmp:
            prov = provenance(train_cfg.data, run.step, run.tokens, train=asdict(train_cfg), world_size=dist.world)
            write_checkpoint_files(tmp, _StateView(run.model, model_state), cfg, target, prov)
            torch.save(state, tmp / STATE_FILE)
            _write_log(tmp / LOG_FILE, run.history, run.val)
    dist.barrier()


# ------------------------------------------------------------------ helpers
def strategy_for(method: str) -> Strategy:
    """The registered training strategy of `method`; the error lists the valid ones."""
    if method not in STRATEGIES:
        raise ConfigError(f"unknown training method {method!r}; valid methods: {sorted(STRATEGIES)}")
    return STRATEGIES[method]


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable parameters only (the target is frozen and not a submodule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the drafter module has no trainable parameters")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def _mean_outputs(outs: list[LossOutput]) -> tuple[float, dict[str, float]]:
    """Mean loss and mean of each metric over micro-batches."""
    loss = sum(float(o.loss.detach()) for o in outs) / len(outs)
    keys = sorted({k for o in outs for k in o.metrics}, key=lambda k: (k.split("@")[0], len(k), k))
    return loss, {k: sum(o.metrics.get(k, 0.0) for o in outs) / len(outs) for k in keys}


@torch.no_grad()
def _validate_run(run: "RunState", plan: Plan, wrapped, target: Target, train_cfg: TrainConfig, autocast,
                  dist: "Distributed", bar) -> None:
    """Validate the run's model now and append to run.val. Rank 0 alone on the plain model; with FSDP
    the shards live on every rank, so all validate through the wrapper (its forward gathers them)."""
    if not plan.val_seqs or (dist.rank and not dist.fsdp):
        return
    if dist.fsdp:
        v = _validate(wrapped, wrapped, target, plan.cfg, train_cfg, plan.val_seqs, autocast, run.step)
    else:
        loss_fn = lambda b, g: plan.strategy.loss(run.model, b, target, plan.cfg, g)  # noqa: E731
        v = _validate(run.model, loss_fn, target, plan.cfg, train_cfg, plan.val_seqs, autocast, run.step)
    run.val.append(v)
    if dist.rank == 0:
        bar.write(f"step {v.step}: val loss {v.loss:.4f} " + " ".join(f"{k} {x:.3f}" for k, x in v.metrics.items()))


def _validate(module, loss_fn, target, cfg, train_cfg, val_seqs, autocast, step) -> ValLog:
    """Mean loss and metrics on the fixed validation sequences, with a fixed sampling seed.

    loss_fn(batch, gen) -> LossOutput; `module` is put in eval mode meanwhile. A separate generator
    keeps validation from changing the training run's random stream.
    """
    module.eval()
    gen = torch.Generator().manual_seed(train_cfg.seed + 1)
    outs = []
    for i in range(0, len(val_seqs), train_cfg.batch_size):
        batch = make_batch(val_seqs[i : i + train_cfg.batch_size], target, cfg.feature_layers)
        with autocast:
            outs.append(loss_fn(batch, gen))
    module.train()
    loss, metrics = _mean_outputs(outs)
    return ValLog(step, loss, metrics)


def _check_resumable(out_dir: Path, target: Target, cfg: DrafterConfig, train_cfg: TrainConfig, n_train: int) -> dict:
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
    state = torch.load(out_dir / STATE_FILE, weights_only=True, map_location="cpu")
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


# ------------------------------------------------------------------ data parallel (torchrun)
def bind_local_gpu() -> int:
    """Under torchrun on a GPU machine: make cuda:LOCAL_RANK this process's current device (before the
    target is loaded, so `--device cuda` puts it there) -> LOCAL_RANK."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s): "
                          "use --nproc_per_node <= its GPU count (one GPU per rank)")
    torch.cuda.set_device(local)
    return local


class _LossModule(torch.nn.Module):
    """forward(batch, gen) = strategy.loss(model, ...): the one call DDP / FSDP hook into.

    Strategies call the drafter's own methods (context, backbone, step, ...), not its forward, so the
    wrapper's forward is where DDP prepares its gradient all-reduce and FSDP gathers the shards. The
    target is held in a plain tuple: never a submodule, never broadcast, never sharded.
    """

    def __init__(self, model: torch.nn.Module, strategy: Strategy, target: Target, cfg: DrafterConfig) -> None:
        super().__init__()
        self.model = model
        self._ctx = (strategy, target, cfg)

    def forward(self, batch: Batch, gen: torch.Generator) -> LossOutput:
        strategy, target, cfg = self._ctx
        return strategy.loss(self.model, batch, target, cfg, gen)


class _StateView:
    """Hands write_checkpoint_files a gathered state dict (FSDP) in place of the module."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


@dataclass
class Distributed:
    """The process group of a torchrun launch (world 1 = the ordinary single-process run: every method is a no-op)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: bool = False
    owns_group: bool = False  # this run initialised the group (and destroys it at the end)
    cuda: bool = False

    @classmethod
    def from_env(cls, target: Target, train_cfg: TrainConfig) -> "Distributed":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            if train_cfg.fsdp:
                raise ConfigError("--fsdp shards the drafter over ranks: launch with torchrun --nproc_per_node N (N >= 2)")
            return cls()
        import torch.distributed as td

        if train_cfg.batch_size % world:
            raise ConfigError(
                f"--batch-size {train_cfg.batch_size} is the global micro-batch, split over the {world} ranks: "
                f"make it a multiple of {world}"
            )
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        cuda = target.model.device.type == "cuda"
        if cuda:  # one GPU per rank: the target (and with it the drafter) lives on cuda:LOCAL_RANK
            gpu = torch.device("cuda", bind_local_gpu())
            if target.model.device != gpu:
                if target.native is not None:  # its own copies of the weights stay where they were built
                    raise ConfigError(f"rank {rank}: the target is on {target.model.device}, this rank's GPU is {gpu}; "
                                      "load it after torch.cuda.set_device(LOCAL_RANK) (selfdraft train does)")
                target.model.to(gpu)
        owns = not td.is_initialized()
        if owns and cuda:  # NCCL bound to this rank's GPU up front (its communicators are created for it)
            td.init_process_group("nccl", device_id=torch.device("cuda", local))
        elif owns:
            td.init_process_group("gloo")
        return cls(rank, world, local, train_cfg.fsdp, owns, cuda)

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as td

            td.barrier()
            td.destroy_process_group()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            td.barrier()

    def shard(self, idx: list[int]) -> list[int]:
        """This rank's contiguous slice of a global batch."""
        b = len(idx) // self.world
        return idx[self.rank * b : (self.rank + 1) * b]

    def wrap(self, model: torch.nn.Module, strategy: Strategy, target: Target, cfg: DrafterConfig) -> torch.nn.Module:
        module = _LossModule(model, strategy, target, cfg)
        if self.world == 1:
            return module
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # fully_shard's default mesh is on the accelerator whatever the batches: name the device the drafter is on
            mesh = init_device_mesh("cuda" if self.cuda else "cpu", (self.world,))
            fully_shard(module, mesh=mesh)  # one unit: parameters, gradients and optimizer state sharded over the ranks
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[self.local_rank] if self.cuda else None, broadcast_buffers=False,
                   find_unused_parameters=True)  # fmt: skip

    def no_sync(self, wrapped: torch.nn.Module):
        """Skip the gradient all-reduce of a micro-batch that is not the step's last (DDP)."""
        return wrapped.no_sync() if hasattr(wrapped, "no_sync") and not self.fsdp else nullcontext()

    def _reduce(self, value: float, dtype: torch.dtype) -> float:
        import torch.distributed as td

        t = torch.tensor([value], dtype=dtype, device=f"cuda:{self.local_rank}" if self.cuda else "cpu")
        td.all_reduce(t)
        return t.item()

    def sum_int(self, value: int) -> int:
        return value if self.world == 1 else int(self._reduce(value, torch.int64))

    def mean_float(self, value: float) -> float:
        return value if self.world == 1 else self._reduce(value, torch.float64) / self.world

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if self.fsdp and hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def full_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Model and optimizer state with every FSDP shard gathered (a collective: all ranks call it)."""
        if not self.fsdp:
            return model.state_dict(), opt.state_dict()
        from torch.distributed.tensor import DTensor

        full = lambda t: t.full_tensor().cpu() if isinstance(t, DTensor) else t  # noqa: E731
        model_state = {k: full(v) for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        osd = {**osd, "state": {i: {k: full(v) for k, v in st.items()} for i, st in osd["state"].items()}}
        return model_state, osd

    def load_optimizer_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict) -> None:
        """Load a full (unsharded) optimizer state; under FSDP each state tensor is sharded like its parameter."""
        if self.fsdp:
            from torch.distributed.tensor import DTensor, distribute_tensor

            params = [p for p in model.parameters() if p.requires_grad]  # the order _optimizer registered them in
            state = {}
            for i, st in saved["state"].items():
                p = params[int(i)]
                state[i] = {
                    k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) and v.shape == p.shape else v
                    for k, v in st.items()
                }  # fmt: skip
            saved = {**saved, "state": state}
        opt.load_state_dict(saved)
