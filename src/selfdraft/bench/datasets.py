"""Benchmark prompt sets: bundled names (`mt-bench`, `humaneval`, `gsm8k`, ...) or JSONL paths.

Every line is `{"turns": ["first user turn", ...]}`; the benchmark uses the first turn (single-turn
generation, like the papers' τ tables). Malformed lines are skipped and counted rather than
fatal, so one bad record in a user's file does not cost a whole run, but the count is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from selfdraft.config import ConfigError

if TYPE_CHECKING:
    from selfdraft.target import Target


class DatasetError(ConfigError):
    """A prompt set could not be found or holds no usable prompt; the message says what to do."""


def bundled_dir() -> Path:
    return Path(str(resources.files("selfdraft.bench") / "prompts"))


def bundled_names() -> list[str]:
    """Names accepted by `--datasets` without a path (the files under selfdraft/bench/prompts)."""
    return sorted(p.stem for p in bundled_dir().glob("*.jsonl"))


@dataclass
class PromptSet:
    """The prompts of one dataset, as text (from a file) and/or token ids (tokenizer-less targets)."""

    name: str
    source: str  # bundled file path or the user's JSONL path; "token ids" when built from ids
    texts: list[str] = field(default_factory=list)  # first user turns
    malformed: int = 0  # lines skipped: not JSON, no "turns" list, or an empty first turn
    token_ids: list[list[int]] | None = None  # chat-templated prompts; filled by encode()

    @classmethod
    def from_token_ids(cls, name: str, token_ids: list[list[int]]) -> "PromptSet":
        """Pre-tokenized prompts: benchmarks on targets without a tokenizer (tests, raw models)."""
        if not token_ids or any(len(p) == 0 for p in token_ids):
            raise DatasetError(f"prompt set {name!r} needs at least one non-empty token id list")
        return cls(name=name, source="token ids", token_ids=[list(p) for p in token_ids])

    def __len__(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else len(self.texts)

    def encode(self, target: "Target") -> list[list[int]]:
        """Token ids of every prompt through the target's chat template (cached)."""
        if self.token_ids is None:
            self.token_ids = [target.encode_prompt(t) for t in self.texts]
        return self.token_ids

    def info(self) -> dict:
        return {"name": self.name, "source": self.source, "num_prompts": len(self), "malformed_lines": self.malformed}


def load_prompt_set(spec: str, num_prompts: int | None = None) -> PromptSet:
    """A bundled name or a JSONL path -> its first `num_prompts` usable prompts (file order).

    First-N (rather than a random sample) keeps runs comparable across machines and versions.
    """
    if num_prompts is not None and num_prompts < 1:
        raise DatasetError(f"num_prompts must be >= 1, got {num_prompts}")
    path = Path(spec).expanduser()
    if spec in bundled_names():
        name, path = spec, bundled_dir() / f"{spec}.jsonl"
    elif path.suffix == ".jsonl" or path.exists():
        if not path.is_file():
            raise DatasetError(f"prompt file {spec!r} does not exist")
        name = path.stem
    else:
        raise DatasetError(
            f"unknown dataset {spec!r}: use a bundled name ({', '.join(bundled_names())}) "
            f'or a path to a JSONL file of {{"turns": [...]}} lines'
        )
    texts, malformed = [], 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            text = _first_turn(line)
            if text is None:
                malformed += 1
                continue
            if num_prompts is None or len(texts) < num_prompts:
                texts.append(text)
    if not texts:
        raise DatasetError(f"{path} holds no usable prompt ({malformed} malformed lines); expected "
                           f'{{"turns": ["..."]}} per line')
    source = f"selfdraft/bench/prompts/{spec}.jsonl" if spec in bundled_names() else str(path)  # no machine paths
    return PromptSet(name=name, source=source, texts=texts, malformed=malformed)


def _first_turn(line: str) -> str | None:
    """The first user turn of one JSONL line, or None when the line is malformed."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    turns = rec.get("turns") if isinstance(rec, dict) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        return None
    return turns[0]
