"""Typed configs: the one home of defaults. Unknown keys raise."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value the user must fix (message says how)."""


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass `cls` from `data`; unknown keys raise with the list of valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
    return cls(**data)


EMBEDDED_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class SamplingParams:
    """How both p (target) and q (draft) are processed before verification (DESIGN section 2).

    temperature == 0 means greedy. top_k == 0 and top_p == 1 disable those filters.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    """Limits of one generation; `gamma` is the number of draft tokens proposed per round."""

    max_new_tokens: int = 256
    gamma: int = 7
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma < 0:
            raise ConfigError(f"gamma must be >= 0, got {self.gamma}")
