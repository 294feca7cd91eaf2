"""Typed configs: the one home of defaults. Unknown keys raise."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, TypeVar

from selfdraft.errors import SelfdraftError

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


@dataclass
class DrafterConfig:
    """Hyperparameters of a trained drafter (DFlash / DSpark / EAGLE-3 / MTP; each reads its own fields).

    Stored verbatim in the checkpoint's config.json, so a drafter rebuilds from its directory.
    """

    method: str = "dspark"  # registry name: dflash | dspark | eagle3 | mtp
    gamma: int = DEFAULT_GAMMA  # block size γ: draft logits per round
    num_layers: int = 1  # draft decoder layers (as wide as the target)
    feature_layers: tuple[int, ...] = ()  # 0-based target layers; () = target.default_feature_layers()
    qk_norm: bool = False  # per-head RMSNorm on q/k (Qwen3 style): the layer vLLM's DFlash/DSpark/MTP loaders build
    anchor_as_first: bool = True  # DSpark layout (γ inputs -> γ drafts); False = DFlash (anchor + γ masks)
    loss_decay: float = 4.0  # position weight w_k = exp(-(k-1)/loss_decay)
    anchors_per_seq: int = 32  # training blocks sampled per sequence (DeepSpec: 512 on long data)
    init_from_target: bool = False  # DFlash/DSpark: start draft layers from the target's last layers
    # DFlash/DSpark: the mask slots' input. -1 = a learned vector; >= 0 = the target's (frozen) embedding
    # row of this token id, as vLLM's DFlash/DSpark build it (embed_tokens[mask_token_id]).
    mask_token_id: int = -1
    # DFlash/DSpark: train (and draft) over the N most frequent answer tokens of the training data; the
    # losses compare against p_t restricted to them plus one bucket for the rest (still a true distance).
    # 0 = the full vocabulary.
    loss_vocab_size: int = 0
    # DSpark heads (ignored by dflash)
    markov_rank: int = 64  # r of the Markov head (paper 256; 0 disables the head)
    markov_head: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = True
    w_ce: float = 0.1
    w_tv: float = 0.9
    w_conf: float = 1.0
    # EAGLE-3 (docs/methods/eagle3.md)
    draft_vocab_size: int = 8192  # own LM head over the most frequent training tokens; 0 or >= target vocab = all
    ttt_decay: float = 0.8  # training-time test: step j (0-based) weighs ttt_decay^j
    tree_depth: int = 0  # EAGLE-2 dynamic draft tree of this depth at inference; 0 = chain of γ drafts
    tree_top_k: int = 10  # children expanded per frontier node, and frontier nodes kept per depth
    tree_total_tokens: int = 60  # tree nodes verified per round, anchor included
    # MTP (docs/methods/mtp.md)
    mtp_modules: int = 1  # D stacked DeepSeek-V3 modules
    mtp_recursive: bool = True  # also draft depths D+1..γ by reusing the last module (False: D drafts)
    mtp_normed_handoff: bool = False  # depth d+1 reads RMSNorm_d(h^d) (speculators' MTP) instead of h^d (DeepSeek-V3)
    mtp_decay: float = 0.6  # depth d weighs mtp_decay^(d-1) (normalised)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(self.feature_layers)
        if self.gamma < 1 or self.num_layers < 1:
            raise ConfigError(f"gamma and num_layers must be >= 1 (got {self.gamma}, {self.num_layers})")
        if self.markov_head not in ("vanilla", "gated", "rnn"):
            raise ConfigError(f"markov_head must be vanilla, gated or rnn, got {self.markov_head!r}")
        if self.mask_token_id < -1 or self.loss_vocab_size < 0:
            raise ConfigError(f"mask_token_id >= -1 and loss_vocab_size >= 0 are required "
                              f"(got {self.mask_token_id}, {self.loss_vocab_size})")
        if self.markov_rank < 0 or self.loss_decay <= 0 or self.anchors_per_seq < 1:
            raise ConfigError("markov_rank >= 0, loss_decay > 0 and anchors_per_seq >= 1 are required")
        if self.draft_vocab_size < 0 or not (self.ttt_decay > 0 and self.mtp_decay > 0):
            raise ConfigError("draft_vocab_size >= 0 (0 = full vocab), ttt_decay > 0 and mtp_decay > 0 are required")
        if self.tree_depth < 0 or self.tree_top_k < 1 or self.tree_total_tokens < 2 or self.mtp_modules < 1:
            raise ConfigError(
                f"tree_depth >= 0 (0 = chain), tree_top_k >= 1, tree_total_tokens >= 2 and mtp_modules >= 1 are "
                f"required (got {self.tree_depth}, {self.tree_top_k}, {self.tree_total_tokens}, {self.mtp_modules})"
            )


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

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("steps, batch_size and grad_accum must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
