"""Calibration: ECE / ROC-AUC against direct formulas, STS fixes a synthetic overconfident head, and
`calibrate_checkpoint` stores T_k in a real (tiny) DSpark checkpoint that then drafts with σ(z/T)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from selfdraft.checkpoint import load_checkpoint, save_checkpoint
from selfdraft.config import SamplingParams
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.target import Target
from selfdraft.training.calibrate import (
    HeldOutRounds,
    calibrate_checkpoint,
    ece,
    report,
    roc_auc,
    sequential_temperature_scaling,
)
from selfdraft.training.strategy import STRATEGIES
from tests.helpers import tiny_llama


def test_ece_and_auc_match_direct_definitions():
    g = torch.Generator().manual_seed(0)
    conf, label = torch.rand(300, generator=g), (torch.rand(300, generator=g) < 0.4).float()
    conf[:20] = 0.5  # ties
    bins = [[i for i in range(300) if min(int(conf[i] * 15), 14) == b] for b in range(15)]
    direct = sum(len(ix) / 300 * abs(sum(conf[i] for i in ix) / len(ix) - sum(label[i] for i in ix) / len(ix))
                 for ix in bins if ix)
    assert abs(ece(conf, label) - float(direct)) < 1e-6
    pos, neg = conf[label == 1], conf[label == 0]
    pairs = sum(float((p > n).float() + 0.5 * (p == n).float()) for p in pos for n in neg)
    assert abs(roc_auc(conf, label) - pairs / (len(pos) * len(neg))) < 1e-9


def test_sts_fixes_an_overconfident_head():
    g = torch.Generator().manual_seed(1)
    N, gamma = 6000, 4
    true_logit = torch.randn(N, gamma, generator=g) * 1.5 + 0.8  # P(accept k | 1..k-1) = σ(true_logit)
    accepted = torch.rand(N, gamma, generator=g) < torch.sigmoid(true_logit)
    rounds = HeldOutRounds(z=3.0 * true_logit, accepted=accepted)  # z/T with T = 3 is exact
    temps = sequential_temperature_scaling(rounds)
    rep = report(rounds, temps)
    for r in rep:
        assert 2.2 < r.temperature < 4.0
        assert r.ece_after < 0.5 * r.ece_before and r.ece_after < 0.03
    assert abs(rep[0].auc_after - rep[0].auc_before) < 1e-12  # position 1: a monotone rescaling


def test_calibrate_checkpoint_end_to_end(tmp_path):
    target = Target(tiny_llama(vocab=48, hidden=32, layers=4, seed=0, peaked=3.0))
    torch.manual_seed(2)
    cfg = DSparkConfig(feature_layers=(1, 2), gamma=3, markov_rank=8)
    model = STRATEGIES["dspark"].build(cfg, target)
    with torch.no_grad():
        model.confidence.weight.mul_(20.0)  # a sharp, overconfident head
    ckpt = save_checkpoint(tmp_path / "d", model, cfg, target, {"note": "test"})
    prompts = [[i, i + 1, 7, 3] for i in range(6)]
    rep = calibrate_checkpoint(ckpt, target, prompts, SamplingParams(temperature=1.0), max_new_tokens=24)
    temps = load_file(str(ckpt / "model.safetensors"))["conf_temperature"].tolist()
    assert [round(t, 4) for t in temps] == [round(r.temperature, 4) for r in rep]
    body = json.loads((ckpt / "calibration.json").read_text())
    assert body["rounds"] > 10 and len(body["positions"]) == 3
    assert all((ckpt / "calibration" / f"reliability_k{k}.png").stat().st_size > 1000 for k in (1, 2, 3))
    assert json.loads((ckpt / "config.json").read_text())["provenance"] == {"note": "test"}
    assert sum(r.ece_after for r in rep) <= sum(r.ece_before for r in rep)
    # the reloaded drafter's confidences are σ(z_k / T_k)
    drafter = load_checkpoint(ckpt, target)
    assert torch.allclose(drafter.model.conf_temperature, torch.tensor(temps))


def test_calibrate_cli_needs_one_prompt_source(tmp_path):
    from typer.testing import CliRunner

    from selfdraft.cli import app

    res = CliRunner().invoke(app, ["calibrate", "--drafter", str(tmp_path)])
    assert res.exit_code == 2 and "exactly one of --data" in res.output


def test_positions_without_evidence_keep_the_previous_temperature():
    """No held-out round reaches k = 3 here: T_3, T_4 must not jump to a degenerate grid extreme."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(500, 4, generator=g) * 2.0
    accepted = torch.rand(500, 4, generator=g) < 0.5
    accepted[:, 1] = False  # nobody survives past draft 2
    temps = sequential_temperature_scaling(HeldOutRounds(z=z, accepted=accepted))
    assert temps[2] == temps[3] == temps[1]
