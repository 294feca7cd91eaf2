"""DSpark's config: DFlash's plus the Markov head, the confidence head and the loss weights (docs/methods/dspark.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from selfdraft.config import ConfigError, knob, redefault
from selfdraft.methods.dflash.config import DFlashConfig


@dataclass
class DSparkConfig(DFlashConfig):
    method: str = "dspark"
    ABSENT_MEANS: ClassVar[dict] = {**DFlashConfig.ABSENT_MEANS, "kl_to_tv_tokens": 0, "copy_bias": 0.0,
                                  "copy_context": 1}
    # The first-draft recipe is DSpark's default (docs/bench/first-draft-recipe: from random init it lifts acc@1
    # 0.217 -> 0.240 and τ on every bundled set at 150k tokens). The vLLM and llama.cpp exports refuse these
    # three inputs: --no-dense-first --no-context-residual --no-context-next-token trains the exportable layout.
    context_residual: bool = redefault(DFlashConfig, "context_residual", True)
    context_next_token: bool = redefault(DFlashConfig, "context_next_token", True)
    dense_first: bool = redefault(DFlashConfig, "dense_first", True)
    markov_rank: int = knob(64, "Markov head rank r (paper 256; 0 = no Markov head)")
    markov_head: str = knob("vanilla", "Markov head: vanilla | gated | rnn")
    confidence_head: bool = knob(True, "train the confidence head c_k (the scheduler reads it)")
    w_ce: float = knob(0.1, "cross-entropy loss weight")
    w_tv: float = knob(0.9, "total-variation loss weight")
    # Soft CE against p_t (forward KL up to a constant), as EAGLE-3 and speculators train: unlike TV its
    # gradient does not vanish on tokens q still gives little mass (∂|q_v - p_v|/∂z_v carries q_v).
    w_kl: float = knob(0.0, "soft cross-entropy (KL(p_t || q)) loss weight")
    w_conf: float = knob(1.0, "confidence (BCE) loss weight")
    # A TV-heavy loss learns slowly from random init (|q_v - p_v| has no gradient toward a token q barely
    # proposes); the soft CE does not. Over the first N training tokens w_tv's share moves linearly from
    # the soft CE to TV (r = seen / N: r·w_tv on TV, (1 - r)·w_tv more on the soft CE). 0 = TV from the start.
    kl_to_tv_tokens: int = knob(100_000, "anneal from soft CE to the TV mix over the first N training tokens (0 = off)")
    # Inference only: the target copies pairs it has seen in the context (induction heads), one draft layer over fused
    # features does not (docs/bench/first-draft-recipe#how-predictable-the-target-is). A count-based copy path adds
    # β·log(1 + n) to the logit of every token that followed the last copy_context tokens (.., x_{k-1}) n times in the
    # request's committed tokens; q_k stays exactly what x_k is drawn from. Fit β on held-out positions (scripts/first_draft_gauge.py).
    copy_bias: float = knob(0.0, "inference: + β·log(1 + n) on each token that followed the last copy_context tokens n times in the context (0 = off)")
    # A match of two tokens (x_{k-2} x_{k-1}) is more precise than one: on held-out positions it lifts the first
    # draft from 0.440 (one token, β 8) to 0.495 (two, β 16) (docs/methods/dspark.md#the-copy-bias).
    copy_context: int = knob(1, "inference: tokens the copy bias matches before x_k (1: x_{k-1}; 2: x_{k-2} x_{k-1}; ..)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_head not in ("vanilla", "gated", "rnn"):
            raise ConfigError(f"markov_head must be vanilla, gated or rnn, got {self.markov_head!r}")
        if self.kl_to_tv_tokens < 0:
            raise ConfigError(f"kl_to_tv_tokens must be >= 0 (0 = off), got {self.kl_to_tv_tokens}")
        if self.copy_bias < 0:
            raise ConfigError(f"copy_bias must be >= 0 (0 = off), got {self.copy_bias}")
        if self.copy_context < 1:
            raise ConfigError(f"copy_context must be >= 1 (the tokens a copy matches), got {self.copy_context}")
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank must be >= 0 (0 = no Markov head), got {self.markov_rank}")
