"""A toy training method and dataset for testing the generic loop and checkpoints without real drafters.

`toy-test`: fuse the feature layers (RMSNorm + one linear layer) and predict the next token through the
target's frozen LM head, with cross-entropy on a random 80% of the supervised positions (so the
strategy's generator matters, as anchor sampling does for DFlash/DSpark). This module is the method's
package (it defines METHOD); the `toy_method` fixture registers it through the public path
(selfdraft.methods.register) and removes it again afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from selfdraft import methods
from selfdraft.config import DrafterConfig
from selfdraft.drafters.base import Drafter, Proposal
from selfdraft.methods import Method
from selfdraft.training.strategy import STRATEGIES, Batch, LossOutput, Strategy

TOY = "toy-test"


@dataclass
class ToyConfig(DrafterConfig):
    method: str = TOY


class ToyHead(nn.Module):
    def __init__(self, n_feat: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(n_feat * hidden)
        self.fc = nn.Linear(n_feat * hidden, hidden, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n_feat, H] -> [..., H]"""
        return self.fc(self.norm(features.flatten(-2)))


class ToyDrafter(Drafter):
    """Proposes one token: the head's argmax on the features of the last committed position."""

    name = TOY

    def __init__(self, model: ToyHead, cfg, target) -> None:
        self.model, self.target, self.feature_layers = model, target, cfg.feature_layers
        self.last: torch.Tensor | None = None  # [n_feat, H]

    def begin(self, prompt_ids, step) -> None:
        self.last = step.features[0, -1]

    def observe(self, verification, step) -> None:
        self.last = step.features[0, -1]

    @torch.no_grad()
    def propose(self, tokens, gamma, params, generator) -> Proposal:
        if gamma == 0:
            return Proposal.empty()
        h = self.model(self.last.to(self.model.fc.weight.dtype))
        return Proposal(tokens=self.target.lm_head(h.to(self.target.model.dtype)).argmax(-1).view(1))


def build_toy(cfg, target) -> ToyHead:
    return ToyHead(len(cfg.feature_layers), target.hidden_size)


class ToyStrategy(Strategy):
    method = TOY

    def loss(self, model, batch: Batch, target, cfg, generator) -> LossOutput:
        keep = batch.loss_mask[:, 1:] & (torch.rand(batch.loss_mask[:, 1:].shape, generator=generator) < 0.8)
        logits = target.lm_head(model(batch.features[:, :-1][keep]))  # [N, V]
        labels = batch.input_ids[:, 1:][keep]  # [N]
        loss = nn.functional.cross_entropy(logits.float(), labels)
        acc = (logits.argmax(-1) == labels).float().mean()
        return LossOutput(loss=loss, tokens=int(keep.sum()), metrics={"ce": float(loss.detach()), "acc@1": float(acc)})


TOY_STRATEGY = ToyStrategy()
METHOD = Method(name=TOY, config=ToyConfig, model="tests.toy_training:build_toy", drafter="tests.toy_training:ToyDrafter",
                strategy="tests.toy_training:TOY_STRATEGY")


@pytest.fixture
def toy_method():
    """Registers the toy method (this module) for one test and removes it afterwards."""
    methods.register(TOY, __name__)
    try:
        yield STRATEGIES[TOY]
    finally:
        methods.unregister(TOY)


def write_dataset(data_dir: Path, n_train: int = 24, n_val: int = 4, vocab: int = 96, seed: int = 0) -> Path:
    """A tiny dataset in the JSONL record contract of selfdraft.training.records.

    Each sequence counts up by 3 modulo the vocabulary from a random start, so the next token is
    learnable from the current position's features; the first 4 tokens play the prompt (mask 0).
    """
    g = torch.Generator().manual_seed(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n_train + n_val):
        n = int(torch.randint(12, 40, (1,), generator=g))
        start = int(torch.randint(vocab, (1,), generator=g))
        ids = [(start + 3 * t) % vocab for t in range(n)]
        rec = {"id": f"r{i}", "split": "train" if i < n_train else "val", "source": "toy",
               "messages": [{"role": "user", "content": f"count from {start}"}], "input_ids": ids, "loss_mask": [0] * 4 + [1] * (n - 4)}
        lines.append(json.dumps(rec))
    (data_dir / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    return data_dir


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models run fastest on one thread; on a shared 2-core machine, 2 threads can be 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
