"""The one generic training loop, shared by every drafter kind (a `Strategy` supplies the loss).

nanoGPT style: `_train()` is the whole loop on one screen, with numbered steps. The target is
frozen and runs online under no-grad to give each micro-batch its feature-layer and last hidden
states; only the drafter's parameters are optimised (AdamW, linear warmup + cosine from
`optim.py`, gradient clipping, bf16 autocast, gradient accumulation). The run's state is saved
atomically every `save_every` steps (`checkpointing.py`), so `resume=True` continues the exact same
run after a kill; under torchrun the same loop runs data parallel (`distributed.py`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from selfdraft.config import ConfigError, DrafterConfig, TrainConfig
from selfdraft.progress import progress_bar
from selfdraft.target import Target
from selfdraft.training.checkpointing import RunState, StepLog, ValLog, save, start_or_resume
from selfdraft.training.distributed import Distributed
from selfdraft.training.optim import lr_at, start_optimizer
from selfdraft.training.strategy import STRATEGIES, Batch, LossOutput, Strategy

if TYPE_CHECKING:
    from selfdraft.training.features import CachedSequence


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
        if trainable(ids, mask):
            seqs.append(Sequence(ids, mask, cached))
    return seqs


def trainable(ids: list[int], mask: list[int]) -> bool:
    """Whether the trainer keeps a (truncated) record: >= 2 tokens and a supervised token to predict.
    The campaign's ledger replays the trainer's order over exactly these (scripts/campaign/campaign_data.py)."""
    return len(ids) >= 2 and any(mask[1:])



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


def _train(target, drafter_cfg, train_cfg, out_dir, strategy, resume, on_step, dist: Distributed) -> TrainResult:
    t_start, out_dir = time.perf_counter(), Path(out_dir).resolve()
    # 1. Resolve the method, the feature layers and the data.
    plan = _plan(target, drafter_cfg, train_cfg, strategy)
    cfg, seqs, n_train = plan.cfg, plan.train_seqs, len(plan.train_seqs)

    # 2. Set the run up, in order: (a) where it begins: a fresh drafter (float32 master weights; autocast
    #    runs it in bf16), warm-started with init_from, or the saved run restored exactly; (b) data
    #    parallel: the module whose forward(batch, gen) is strategy.loss (DDP / FSDP / plain); (c) AdamW
    #    over the parameters as wrapped (FSDP shards them) and the schedule, a resumed run's state loaded.
    run = start_or_resume(target, plan.strategy, cfg, train_cfg, out_dir, resume, n_train, dist)
    wrapped = dist.wrap(run.model, plan.strategy, target, cfg)
    start_optimizer(run, train_cfg, dist)
    resumed_from, model = run.step, run.model
    autocast = torch.autocast(target.model.device.type, dtype=torch.bfloat16, enabled=train_cfg.bf16)
    bar = _progress_bar(run, train_cfg, cfg.method, dist)
    while not _finished(run, train_cfg):
        # 3. One optimizer step: lr from the schedule, grad_accum micro-batches, clip, update.
        t0 = time.perf_counter()
        lr = lr_at(run.step, run.tokens, train_cfg, run.origin)
        for group in run.opt.param_groups:
            group["lr"] = lr * group["lr_scale"]  # a warm start's new parameters: new_lr on the same schedule
        step_tokens, outs = 0, []
        for micro in range(train_cfg.grad_accum):
            # Every rank advances the same global cursor and keeps its own slice of the global batch.
            idx = dist.shard(run.cursor.take(n_train, train_cfg.batch_size, train_cfg.seed))
            batch = make_batch([seqs[i] for i in idx], target, cfg.feature_layers)  # the frozen target runs here, no grad
            batch.tokens_seen = run.tokens
            sync = dist.no_sync(wrapped) if micro + 1 < train_cfg.grad_accum else nullcontext()  # all-reduce once per step
            with sync:
                with autocast:
                    out = wrapped(batch, run.gen)  # strategy.loss (DDP averages the gradients over ranks)
                (out.loss / train_cfg.grad_accum).backward()
            outs.append(out)
            step_tokens += int(batch.attention_mask.sum())
        grad_norm = dist.clip_grad_norm(model, train_cfg.grad_clip or float("inf"))
        run.opt.step()
        run.opt.zero_grad(set_to_none=True)
        step_tokens = dist.sum_int(step_tokens)  # tokens of the global batch (the token budget is global)
        run.step, run.tokens = run.step + 1, run.tokens + step_tokens

        # 4. Log, validate, checkpoint.
        loss, metrics = _mean_outputs(outs)
        log = StepLog(run.step, lr, dist.mean_float(loss), run.tokens, grad_norm, step_tokens / (time.perf_counter() - t0), metrics)
        run.history.append(log)
        shown = {k: f"{v:.3f}" for k, v in metrics.items() if k in ("acc@1", "acc@2", "acc@3")}
        bar.set_postfix(loss=f"{log.loss:.4f}", **shown, tok_s=f"{log.tokens_per_s:.0f}", lr=f"{lr:.2e}")
        bar.update(step_tokens if train_cfg.token_budget else 1)
        if train_cfg.val_every and run.step % train_cfg.val_every == 0:
            _validate_run(run, plan, wrapped, target, train_cfg, autocast, dist, bar)
        if train_cfg.save_every and run.step % train_cfg.save_every == 0:
            save(run, out_dir, target, cfg, train_cfg, n_train, dist)
        if on_step:
            on_step(log)
    bar.close()

    # 5. Final validation and checkpoint, unless this step already had them (or nothing was trained);
    # a validation added after this step's save is saved again, or the log on disk would lack it.
    if run.step > resumed_from:
        validated_now = not (run.val and run.val[-1].step == run.step)
        if validated_now:
            _validate_run(run, plan, wrapped, target, train_cfg, autocast, dist, bar)
        if validated_now or not (train_cfg.save_every and run.step % train_cfg.save_every == 0):
            save(run, out_dir, target, cfg, train_cfg, n_train, dist)
    return TrainResult(out_dir, run.step, run.tokens, "steps" if run.step >= train_cfg.steps else "token_budget",
                       resumed_from, time.perf_counter() - t_start, run.history, run.val)


def _finished(run: RunState, train_cfg: TrainConfig) -> bool:
    return run.step >= train_cfg.steps or bool(train_cfg.token_budget and run.tokens >= train_cfg.token_budget)


def _progress_bar(run: RunState, train_cfg: TrainConfig, method: str, dist: Distributed):
    """Counts what ends the run: tokens when there is a token budget (it usually stops a run before `steps`)."""
    budget = train_cfg.token_budget
    total, initial, unit = (budget, min(run.tokens, budget), "tok") if budget else (train_cfg.steps, run.step, "step")
    return progress_bar(total=total, initial=initial, unit=unit, desc=f"train {method}", disable=dist.rank != 0)


# ------------------------------------------------------------------ helpers
def strategy_for(method: str) -> Strategy:
    """The registered training strategy of `method`; the error lists the valid ones."""
    if method not in STRATEGIES:
        raise ConfigError(f"unknown training method {method!r}; valid methods: {sorted(STRATEGIES)}")
    return STRATEGIES[method]



def _mean_outputs(outs: list[LossOutput]) -> tuple[float, dict[str, float]]:
    """Mean loss and mean of each metric over micro-batches."""
    loss = sum(float(o.loss.detach()) for o in outs) / len(outs)
    keys = sorted({k for o in outs for k in o.metrics}, key=lambda k: (k.split("@")[0], len(k), k))
    return loss, {k: sum(o.metrics.get(k, 0.0) for o in outs) / len(outs) for k in keys}


@torch.no_grad()
def _validate_run(run: RunState, plan: Plan, wrapped, target: Target, train_cfg: TrainConfig, autocast,
                  dist: Distributed, bar) -> None:
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
