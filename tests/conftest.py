"""Shared fixtures: tiny random Llama targets (fast, float32) and the embedded target (slow)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.target import Target


def tiny_llama(vocab: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0, peaked: float = 0.0,
               max_pos: int = 256, intermediate: int | None = None) -> LlamaForCausalLM:
    """A random Llama small enough for unit tests. `peaked` > 0 scales the output layer so p is far
    from uniform (statistical tests need distributions that differ visibly between models)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=intermediate or 2 * hidden, max_position_embeddings=max_pos,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, peaked / hidden**0.5)
    return model


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (thread sync costs more than their matmuls);
    the embedded 135M target uses both cores."""
    torch.set_num_threads(2 if "embedded_fp32" in request.fixturenames else 1)


@pytest.fixture
def tiny_target() -> Target:
    return Target(tiny_llama())


@pytest.fixture(scope="session")
def embedded_fp32() -> Target:
    return Target.load(dtype="float32")
