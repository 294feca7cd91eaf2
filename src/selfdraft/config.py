"""Typed configs: the one home of defaults. Unknown keys raise."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from selfdraft.errors import SelfdraftError

if TYPE_CHECKING:
    from selfdraft.target import Target

T = TypeVar("T")


class ConfigError(SelfdraftError):
    """A configuration value the user must fix (message says how)."""


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass `cls` from `data`; unknown keys raise with the list of valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
    return cls(**data)


EMBEDDED_TARGET = "smollm2-135m-instruct"
# γ: drafts per round at inference (GenerationConfig) and the block size a drafter is trained for
# (DrafterConfig): the one γ default; the CLI, the benchmark and the loaders read it from here.
DEFAULT_GAMMA = 7
# torch CPU threads of every command (--threads). 1, measured: plain decoding on a shared 2-core CPU
# (bf16, 1 and 2 threads interleaved, load average 11-12) ran at 11.6 and 1.3 tok/s with 1 thread and at
# 0.1 tok/s with 2, whose threads wait on each other when a core is taken. An idle machine may gain
# from --threads <its cores>; a busy one loses 10-100x with more threads than free cores.
DEFAULT_THREADS = 1
# Prompt tokens per row in one prefill forward of the batched engine (`--prefill-chunk`): the
# requests joining at a step are prefilled together, longer prompts chunk by chunk (docs/engine.md).
DEFAULT_PREFILL_CHUNK = 512


# Temperatures below float32's smallest normal number cannot take part in float32 arithmetic (they
# round towards 0 and 0 / 0 is NaN): they are greedy, the T -> 0 limit of sampling.
MIN_SAMPLING_TEMPERATURE = 1.1754943508222875e-38
MAX_PENALTY = 2.0  # presence / frequency penalty range [-2, 2] (OpenAI's)
MAX_LOGIT_BIAS = 100.0  # logit_bias values in [-100, 100] (OpenAI's)


@dataclass(frozen=True)
class SamplingParams:
    """How both p (target) and q (draft) are processed before verification (docs/verification.md#sampling-transforms).

    temperature == 0 means greedy. top_k == 0 and top_p == 1 disable those filters.
    presence_penalty / frequency_penalty / logit_bias are logits processors (OpenAI's definitions):
    logit[j] += logit_bias[j] - frequency_penalty * c[j] - presence_penalty * (c[j] > 0), where c[j]
    counts token j among the tokens generated before the position (the prompt does not count).
    They apply to p and q alike, at every verified position with that position's own context.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids unique

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ConfigError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ConfigError("logit_bias takes each token id (>= 0) at most once")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ConfigError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def has_processors(self) -> bool:
        """Whether logits depend on more than the model (bias or penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class GenerationConfig:
    """Limits of one generation; `gamma` is the number of draft tokens proposed per round."""

    max_new_tokens: int = 256
    gamma: int = DEFAULT_GAMMA
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma < 0:
            raise ConfigError(f"gamma must be >= 0, got {self.gamma}")


def knob(default: Any, help: str, *flags: str) -> Any:
    """A drafter config field with the help of its `selfdraft train` option (and the option's spelling
    when it is not `--field-name`): the CLI generates one option per field from these."""
    return dataclasses.field(default=default, metadata={"help": help, "flags": flags})


def redefault(parent: type, name: str, default: Any) -> Any:
    """A parent config's knob with another default (a method that shares the field but not its default):
    the help and the option's spelling stay the parent's, written once."""
    return dataclasses.field(default=default, metadata=parent.__dataclass_fields__[name].metadata)


@dataclass
class DrafterConfig:
    """What every trained drafter's config holds. Each method's config (selfdraft/methods/NAME/config.py)
    subclasses it with the method's own fields; `selfdraft.methods.drafter_config` builds the right one
    from a dict. Stored verbatim in the checkpoint's config.json, so a drafter rebuilds from its directory.
    """

    method: str = knob("dspark", "the drafting method (selfdraft.methods)", "--method", "-m")  # base default: `train`'s
    gamma: int = knob(DEFAULT_GAMMA, "block size γ (draft tokens per round)")
    feature_layers: tuple[int, ...] = knob((), "target layers, e.g. 1,8,14,20,27 (default: the method's)")
    qk_norm: bool = knob(False, "per-head q/k RMSNorm (Qwen3 style: the layer vLLM's DFlash/DSpark/MTP loaders build)")

    def __post_init__(self) -> None:
        self.feature_layers = tuple(self.feature_layers)
        own = type(self).__dataclass_fields__["method"].default
        if type(self) is not DrafterConfig and self.method != own:
            raise ConfigError(f"{type(self).__name__} configures {own!r} drafters, not {self.method!r}")
        if self.gamma < 1:
            raise ConfigError(f"gamma must be >= 1, got {self.gamma}")

    def default_feature_layers(self, target: "Target") -> tuple[int, ...]:
        """The target layers read when `feature_layers` is empty (docs/architecture.md#feature-layers):
        five spread over the target; a method overrides it."""
        return target.default_feature_layers()


@dataclass
class TrainConfig:
    """The generic training loop's knobs (shared by every drafter kind)."""

    data: str = ""  # regenerated dataset directory (see selfdraft.training.records)
    features: str = "online"  # "online" (target runs during training) or a feature-cache directory
    steps: int = 1000  # optimizer steps (the schedule's length)
    token_budget: int = 0  # stop after this many training tokens (0 = no limit); fair comparisons fix it
    batch_size: int = 4  # sequences per micro-batch, over all ranks together (torchrun: split across them)
    grad_accum: int = 1
    max_seq_len: int = 512
    lr: float = 6e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # bf16 autocast. Off by default: on CPUs without bf16 instructions a bf16 matmul runs ~5x slower
    # than fp32 (measured: 61 vs 292 GFLOP/s on the reference Xeon); turn it on for GPUs.
    bf16: bool = False
    val_every: int = 100
    val_batches: int = 8
    save_every: int = 100
    seed: int = 0
    fsdp: bool = False  # under torchrun: shard the drafter (FSDP2 fully_shard) instead of replicating it (DDP)
    # warm start: a fresh run begins from this checkpoint's drafter weights (same method and shapes);
    # the schedule, optimizer and data cursor start anew, and a loss draft vocabulary comes from `data`
    init_from: str = ""
    # The parameters a warm start adds (a grown layer, W_s, W_e) start at zero output; at the campaign's lr 1e-4 a
    # grown layer barely moved in a 152k-token segment (docs/bench/campaign). They train at new_lr (0 = lr).
    new_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("steps, batch_size and grad_accum must be >= 1")
        if self.lr <= 0 or self.new_lr < 0:
            raise ConfigError(f"lr must be > 0 and new_lr >= 0 (0 = lr), got {self.lr} and {self.new_lr}")
