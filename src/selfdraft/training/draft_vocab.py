"""The draft vocabulary of a dataset: its most frequent assistant tokens (docs/data.md#draft-vocabulary),
stored beside the records as DIR/draft_vocab_N.safetensors (a `vocab.DraftVocab`)."""

from __future__ import annotations

from pathlib import Path

import torch

from selfdraft.config import ConfigError
from selfdraft.training.records import DataError, iter_records
from selfdraft.vocab import DraftVocab


def draft_vocab_of(data_dir: str | Path, size: int, vocab_size: int) -> DraftVocab:
    """The dataset's draft vocabulary of `size` tokens: DIR/draft_vocab_{size}.safetensors if built, else built now."""
    path = Path(data_dir) / f"draft_vocab_{size}.safetensors"
    return DraftVocab.load(path) if path.exists() else build_draft_vocab(data_dir, size, vocab_size)


def build_draft_vocab(data_dir: str | Path, size: int, vocab_size: int, split: str | None = "train") -> DraftVocab:
    """The `size` most frequent assistant tokens (ties: lower id) of the dataset, saved to
    DIR/draft_vocab_{size}.safetensors. Only supervised (assistant) tokens are counted: those are
    the tokens the drafter must predict. Validation records are excluded by default."""
    if not 0 < size <= vocab_size:
        raise ConfigError(f"draft vocab size must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for rec in iter_records(data_dir, split):
        ids = torch.tensor(rec["input_ids"])[torch.tensor(rec["loss_mask"], dtype=torch.bool)]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise DataError(f"record {rec['id']} has token id {int(ids.max())} >= vocab size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    if counts.sum() == 0:
        raise DataError(f"{data_dir} has no assistant tokens to count")
    order = torch.sort(counts, descending=True, stable=True).indices[:size]  # ties: lower id first
    target_ids = order.sort().values  # [size] ascending target ids
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    vocab = DraftVocab(target_ids - torch.arange(size), t2d, float(counts[t2d].sum() / counts.sum()))
    vocab.save(Path(data_dir) / f"draft_vocab_{size}.safetensors")
    return vocab
