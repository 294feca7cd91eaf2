"""Slow: the embedded SmolLM2-135M target, float32. Speculative greedy output == the target's own."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from selfdraft.cli import app
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.loader import load_drafter
from tests.helpers import EMBEDDED_PROMPTS as PROMPTS

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("prompt", PROMPTS)
def test_embedded_greedy_equals_hf_generate(embedded_fp32, prompt):
    ids = embedded_fp32.encode_prompt(prompt)
    n = 48
    hf = embedded_fp32.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    for name in ["none", "ngram"]:
        res = generate(embedded_fp32, load_drafter(name, embedded_fp32), ids, SamplingParams(), GenerationConfig(max_new_tokens=n))
        assert res.token_ids == hf, name


def test_embedded_target_contract(embedded_fp32):
    t = embedded_fp32
    assert (t.hidden_size, t.vocab_size, t.num_layers) == (576, 49152, 30)
    assert t.default_feature_layers() == (1, 8, 14, 20, 27)
    ids = torch.tensor([t.encode_prompt("Hello")])
    cache = t.new_cache()
    step = t.forward(ids, cache, feature_layers=(1, 27))
    assert step.features.shape == (1, ids.shape[1], 2, 576) and step.last_hidden.shape == (1, ids.shape[1], 576)
    ref = t.model(ids, output_hidden_states=True)
    torch.testing.assert_close(step.features[:, :, 1], ref.hidden_states[28])
    torch.testing.assert_close(step.logits, ref.logits)
    # rollback: verifying 3 extra tokens then cropping equals never having seen them
    extra = torch.tensor([[11, 12, 13]])
    t.forward(extra, cache)
    t.rollback(cache, ids.shape[1])
    nxt = t.forward(torch.tensor([[42]]), cache).logits
    fresh = t.model(torch.cat([ids, torch.tensor([[42]])], 1)).logits[:, -1:]
    torch.testing.assert_close(nxt, fresh, atol=1e-4, rtol=1e-4)


def test_cli_generate_json(embedded_fp32):
    res = CliRunner().invoke(app, ["generate", "-p", PROMPTS[0], "-n", "24", "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ["text", "token_ids", "prompt_token_ids", "num_rounds", "accepted_lengths", "tau", "elapsed_s", "tokens_per_s"]:
        assert key in out
    assert len(out["token_ids"]) <= 24 and sum(out["accepted_lengths"]) == len(out["token_ids"]) - 1
    assert out["token_ids"] == generate(embedded_fp32, load_drafter("none", embedded_fp32),
                                        out["prompt_token_ids"], config=GenerationConfig(max_new_tokens=24)).token_ids


def test_shipped_dspark_drafter_is_lossless(embedded_fp32):
    """The committed checkpoint loads onto the embedded target and its greedy output is the target's."""
    from selfdraft.cli.common import SHIPPED

    drafter = load_drafter(str(SHIPPED / "dspark"), embedded_fp32)
    ids = embedded_fp32.encode_prompt(PROMPTS[1])
    cfg = GenerationConfig(max_new_tokens=40)
    spec = generate(embedded_fp32, drafter, ids, SamplingParams(), cfg)
    assert spec.token_ids == generate(embedded_fp32, load_drafter("none", embedded_fp32), ids, SamplingParams(), cfg).token_ids
    assert spec.tau > 1.0 and all(r.proposed <= 7 for r in spec.rounds)
