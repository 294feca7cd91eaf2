"""speculators / vLLM export and import (selfdraft.export): round trips, target checks, config validation."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from selfdraft.checkpoint import CheckpointError, atomic_dir, write_checkpoint_files
from selfdraft.config import DrafterConfig, GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters import load_drafter
from selfdraft.export import METHODS, export_speculators, is_speculators_dir
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from tests.conftest import tiny_llama

CONFIGS = {  # one per exported method; small but with every head switched on
    "eagle3": dict(method="eagle3", gamma=4, draft_vocab_size=64),
    "dflash": dict(method="dflash", gamma=4, num_layers=2, anchor_as_first=False, qk_norm=True),
    "dspark": dict(method="dspark", gamma=4, markov_rank=8, markov_head="rnn", qk_norm=True),
    "dspark-plain": dict(method="dspark", gamma=4, markov_rank=8, markov_head="gated", qk_norm=False),
    "mtp": dict(method="mtp", gamma=3, qk_norm=True),
}


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(peaked=3.0))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (DSpark's W2 starts at zero, norms at one): the round trip must move them all."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
        if hasattr(model, "d2t"):  # a draft vocabulary that is not a prefix of the target's
            ids = torch.randperm(model.t2d.numel(), generator=g)[: model.d2t.numel()].sort().values
            model.d2t.copy_(ids - torch.arange(ids.numel()))
            model.t2d.zero_()
            model.t2d[ids] = True
        if hasattr(model, "conf_temperature"):
            model.conf_temperature.copy_(torch.linspace(0.8, 1.6, model.conf_temperature.numel()))


def make_checkpoint(target: Target, name: str, dir) -> str:
    cfg = DrafterConfig(**CONFIGS[name])
    strategy = STRATEGIES[cfg.method]
    if not cfg.feature_layers:
        cfg.feature_layers = strategy.default_feature_layers(target)
    model = strategy.build(cfg, target).float()
    _randomise(model, seed=len(name))
    with atomic_dir(dir) as tmp:  # (save_checkpoint refuses MTP's empty feature_layers; the trainer writes it this way)
        write_checkpoint_files(tmp, model, cfg, target, {"test": name})
    return str(dir)


def _proposals(target: Target, drafter, prompt: list[int], params: SamplingParams) -> list:
    """Tokens, q and confidences the drafter proposes after a prefill, for two successive anchors."""
    layers = drafter.feature_layers
    full = target.forward(torch.tensor([prompt]), None, layers)
    from selfdraft.target import TargetStep

    n = len(prompt) - 2
    drafter.begin(prompt[:n], TargetStep(None, full.features[:, :n] if layers else None, full.last_hidden[:, :n]))
    out = []
    gen = torch.Generator().manual_seed(0)
    p = drafter.propose(prompt[: n + 1], 4, params, gen)
    out.append(p)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_gives_identical_drafts(target, name, tmp_path):
    src = make_checkpoint(target, name, tmp_path / "ours")
    out = export_speculators(src, tmp_path / "spec", target)
    assert is_speculators_dir(out) and not is_speculators_dir(src)
    spec = json.loads((out / "config.json").read_text())
    assert spec["speculators_model_type"] == CONFIGS[name]["method"]
    weights = load_file(out / "model.safetensors")
    method = CONFIGS[name]["method"]
    if method == "eagle3":
        assert {"fc.weight", "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= weights.keys()
        assert weights["t2d"].dtype == torch.bool and weights["d2t"].dtype == torch.int64
        assert spec["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in STRATEGIES["eagle3"].default_feature_layers(target)]
    if method in ("dflash", "dspark"):
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight"} <= weights.keys()
        assert torch.equal(weights["embed_tokens.weight"][spec["mask_token_id"]], weights["mask_embedding"])
    if method == "dspark":
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"} <= weights.keys()
    if method == "mtp":
        assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.token_layernorm.weight", "mtp_layers.0.self_attn.q_norm.weight"} <= weights.keys()

    original, imported = load_drafter(src, target), load_drafter(str(out), target)
    assert type(imported) is type(original) and imported.cfg == original.cfg
    prompt = [int(x) for x in torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(1))]
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        a, b = _proposals(target, original, prompt, params), _proposals(target, imported, prompt, params)
        for pa, pb in zip(a, b):
            assert torch.equal(pa.tokens, pb.tokens)
            assert (pa.q is None) == (pb.q is None) and (pa.q is None or torch.equal(pa.q, pb.q))
            assert (pa.confidences is None) == (pb.confidences is None)
            assert pa.confidences is None or torch.equal(pa.confidences, pb.confidences)
    # End to end through the decoding loop (sampled): same tokens, same accepted lengths.
    cfg = GenerationConfig(max_new_tokens=24, gamma=4)
    ra = generate(target, load_drafter(src, target), prompt, SamplingParams(temperature=1.0, seed=3), cfg)
    rb = generate(target, load_drafter(str(out), target), prompt, SamplingParams(temperature=1.0, seed=3), cfg)
    assert ra.token_ids == rb.token_ids and ra.accepted_lengths == rb.accepted_lengths


def test_import_refuses_another_target(target, tmp_path):
    src = make_checkpoint(target, "dspark", tmp_path / "ours")
    out = export_speculators(src, tmp_path / "spec", target)
    other = Target(tiny_llama(peaked=3.0, seed=1))  # same shapes, other weights
    with pytest.raises(CheckpointError, match="trained for target"):
        load_drafter(str(out), other)
    # A foreign checkpoint (no selfdraft block): the verifier's shapes / architecture are checked.
    spec = json.loads((out / "config.json").read_text())
    del spec["selfdraft"]
    spec["transformer_layer_config"]["vocab_size"] = 1000
    (out / "config.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match="trained for verifier .* vocab 1000.*differs in vocab_size"):
        load_drafter(str(out), target)


def test_foreign_checkpoint_without_selfdraft_fields(target, tmp_path):
    """A checkpoint as speculators writes it (no selfdraft block, no mask_embedding tensor, midlayer names
    for EAGLE-3) still maps onto our modules with identical drafts."""
    for name in ("dflash", "eagle3"):
        src = make_checkpoint(target, name, tmp_path / f"ours-{name}")
        out = export_speculators(src, tmp_path / f"spec-{name}", target)
        spec = json.loads((out / "config.json").read_text())
        del spec["selfdraft"]
        (out / "config.json").write_text(json.dumps(spec))
        w = load_file(out / "model.safetensors")
        w.pop("mask_embedding", None)
        w = {k.replace("layers.0.", "midlayer.") if name == "eagle3" else k: v for k, v in w.items()}
        from safetensors.torch import save_file

        save_file(w, str(out / "model.safetensors"))
        prompt = list(range(3, 15))
        a = _proposals(target, load_drafter(src, target), prompt, SamplingParams(temperature=1.0))[0]
        b = _proposals(target, load_drafter(str(out), target), prompt, SamplingParams(temperature=1.0))[0]
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)


# ------------------------------------------------------------------ config validation
# The speculators fields (docs/architecture.md#checkpoints-and-export, speculators 0.9.0's config classes): always checked.
SCHEMA = {
    "common": {"architectures": list, "speculators_model_type": str, "speculators_version": str,
               "speculators_config": dict, "transformer_layer_config": dict},
    "eagle3": {"draft_vocab_size": int, "target_hidden_size": int, "eagle_aux_hidden_state_layer_ids": list,
               "norm_before_residual": bool},
    "dflash": {"draft_vocab_size": int, "block_size": int, "aux_hidden_state_layer_ids": list, "mask_token_id": int,
               "sample_from_anchor": bool, "target_hidden_size": int},
    "mtp": {"num_nextn_predict_layers": int},
}  # fmt: skip
SCHEMA["dspark"] = {**SCHEMA["dflash"], "markov_rank": int, "markov_head_type": str, "enable_confidence_head": bool,
                    "confidence_head_with_markov": bool}  # fmt: skip
LAYER_KEYS = {"model_type": str, "vocab_size": int, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
              "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "rms_norm_eps": float}  # fmt: skip


def check_schema(spec: dict) -> None:
    method = spec["speculators_model_type"]
    for key, typ in {**SCHEMA["common"], **SCHEMA[method]}.items():
        assert isinstance(spec.get(key), typ), f"{key}: {spec.get(key)!r} is not {typ.__name__}"
    for key, typ in LAYER_KEYS.items():
        assert isinstance(spec["transformer_layer_config"].get(key), typ), f"transformer_layer_config.{key}"
    sc = spec["speculators_config"]
    assert sc["algorithm"] == method and sc["default_proposal_method"] in [p["proposal_type"] for p in sc["proposal_methods"]]
    p = sc["proposal_methods"][0]
    assert p["proposal_type"] == "greedy" and p["speculative_tokens"] >= 1
    assert p["verifier_accept_k"] == 1 and p["accept_tolerance"] == 0
    assert isinstance(sc["verifier"]["name_or_path"], str) and isinstance(sc["verifier"]["architectures"], list)
    if method in ("dflash", "dspark"):
        assert p["speculative_tokens"] == spec["block_size"] - (0 if spec["sample_from_anchor"] else 1)


def _export_all(target, tmp_path) -> list:
    outs = []
    for name in CONFIGS:
        src = make_checkpoint(target, name, tmp_path / f"ours-{name}")
        outs.append(export_speculators(src, tmp_path / f"spec-{name}", target))
    return outs


def test_config_matches_schema(target, tmp_path):
    for out in _export_all(target, tmp_path):
        check_schema(json.loads((out / "config.json").read_text()))


VALIDATE = textwrap.dedent("""
    import importlib.util, json, sys
    from unittest import mock
    # speculators imports its training stack (datasets, hs_connectors, ...) at package import; the
    # config classes do not use them, so absent ones are stubbed in this throw-away process.
    for name in ["datasets", "hs_connectors", "loguru", "pydantic_settings"]:
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = mock.MagicMock(name=name)
    import speculators
    from speculators import SpeculatorModelConfig
    for path in sys.argv[1:]:
        d = json.load(open(path))
        cfg = SpeculatorModelConfig.from_dict(d)
        assert type(cfg).__name__ == {"eagle3": "Eagle3SpeculatorConfig", "dflash": "DFlashSpeculatorConfig",
                                       "dspark": "DSparkSpeculatorConfig", "mtp": "MTPSpeculatorConfig"}[d["speculators_model_type"]]
        assert cfg.speculators_config.verifier.name_or_path == d["speculators_config"]["verifier"]["name_or_path"]
        assert cfg.transformer_layer_config.hidden_size == d["transformer_layer_config"]["hidden_size"]
        print(d["speculators_model_type"], type(cfg).__name__, "ok")
    print("speculators", speculators.config.version("speculators"))
""")


def test_config_validates_with_speculators_classes(target, tmp_path):
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("speculators not installed (pip install --no-deps speculators)")
    outs = _export_all(target, tmp_path)
    res = subprocess.run([sys.executable, "-c", VALIDATE, *[str(o / "config.json") for o in outs]],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count(" ok") == len(outs), res.stdout


def test_methods_table_covers_every_exported_method():
    assert set(METHODS) == {"eagle3", "dflash", "dspark", "mtp"}
