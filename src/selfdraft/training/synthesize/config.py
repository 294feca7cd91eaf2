"""The settings of synthesis (one source of defaults: the CLI shows these). No torch here, so the
CLI can read them without loading it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from selfdraft.config import ConfigError
from selfdraft.training.synthesize.domains import DOMAINS, Domain

LANGUAGES = ("en", "any")


@dataclass(frozen=True)
class GateConfig:
    """The gates' thresholds (one source of defaults: the CLI shows these)."""

    min_prompt_tokens: int = 4  # content tokens of a prompt
    language: str = "en"  # en | any (no language gate)
    near_dup: float = 0.7  # word 3-gram Jaccard at or above this is a near-duplicate
    ngram: int = 3
    max_symbol_share: float = 0.1  # characters that are neither letters, digits (any script) nor ASCII punctuation
    min_letter_share: float = 0.25  # letters among non-space characters (code and math prompts hold symbols)
    max_repeated_ngrams: float = 0.3  # share of word 3-grams that repeat an earlier one of the prompt

    def __post_init__(self) -> None:
        if self.language not in LANGUAGES:
            raise ConfigError(f"--language must be one of {', '.join(LANGUAGES)}, got {self.language!r}")
        if not 0.0 < self.near_dup <= 1.0:
            raise ConfigError(f"--near-dup must be in (0, 1], got {self.near_dup}")
        if self.min_prompt_tokens < 1 or self.ngram < 1:
            raise ConfigError("min_prompt_tokens and ngram must be >= 1")


@dataclass(frozen=True)
class SynthConfig:
    """How prompts are written and gated (the answers: RegenConfig, as for `data regenerate`)."""

    domains: tuple[Domain, ...] = (DOMAINS["chat"],)
    # Magpie samples prompts at T = 1, top-p = 1. On the embedded 135M target T = 1 drifts off domain (at
    # top-p 1 into mixed scripts too) and leaves 6 of 32 chat and math prompts unfinished at 96 tokens;
    # 0.8 / 0.95 stays closer to the domain with none unfinished (code: 8 of 16 vs 6; docs/data.md).
    prompt_temperature: float = 0.8
    prompt_top_p: float = 0.95
    max_prompt_new_tokens: int = 128  # a prompt without end of turn by then is removed (gate `cut`)
    val_fraction: float = 0.02
    gates: GateConfig = field(default_factory=GateConfig)
    max_attempts: int = 20  # give up after sampling this many prompt slots per conversation asked for
    extend: str | None = None  # a dataset directory whose conversations get new turns instead of new prompts

    def __post_init__(self) -> None:
        if self.prompt_temperature < 0 or not 0 < self.prompt_top_p <= 1:
            raise ConfigError("need --prompt-temperature >= 0 and --prompt-top-p in (0, 1]")
        if self.max_prompt_new_tokens < 1 or self.max_attempts < 1:
            raise ConfigError("--max-prompt-new-tokens and max_attempts must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")

    def identity(self) -> dict:
        """What a resumed run must share with the first: everything that changes which prompts come out."""
        return asdict(self)


