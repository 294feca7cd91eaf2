"""A reduced draft vocabulary: the tokens a drafter drafts among (speculators convention).

Built from training data (training/draft_vocab.py `build_draft_vocab`), stored beside a dataset or in a
checkpoint (checkpoint.DRAFT_VOCAB_FILE), read at inference and by the speculators export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def draft_columns(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids: [V'] target ids of a draft vocabulary -> [vocab_size] int64: each target id's column among them,
    -1 for ids outside it (on ids' device)."""
    cols = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    cols[ids] = torch.arange(ids.numel(), device=ids.device)
    return cols


@dataclass
class DraftVocab:
    """A reduced draft vocabulary (speculators convention, docs/data.md#draft-vocabulary)."""

    d2t: torch.Tensor  # [size] int64 offsets: target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor  # [vocab_size] bool: target token is in the draft vocab
    coverage: float = 0.0  # fraction of the counted assistant tokens inside the draft vocab

    @property
    def target_ids(self) -> torch.Tensor:
        """[size] the target id of each draft id (ascending)."""
        return torch.arange(len(self.d2t)) + self.d2t

    def save(self, path: str | Path) -> None:
        save_file({"d2t": self.d2t, "t2d": self.t2d}, str(path), metadata={"coverage": f"{self.coverage:.6f}"})

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        with safe_open(str(path), "pt") as f:
            coverage = float((f.metadata() or {}).get("coverage", 0.0))
        t = load_file(str(path))
        return cls(t["d2t"], t["t2d"], coverage)
