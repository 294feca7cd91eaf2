"""speculators / vLLM export and import (selfdraft.export): faithful round trips, refusals, target checks,
config validation, and drafts / load reports through speculators' own model classes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfdraft.checkpoint import DRAFT_VOCAB_FILE, CheckpointError, atomic_dir, write_checkpoint_files
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.export import export_speculators, exportable, is_speculators_dir, method_map
from selfdraft.loader import load_drafter
from selfdraft.methods import drafter_config
from selfdraft.target import Target, TargetStep
from selfdraft.training.strategy import STRATEGIES
from selfdraft.vocab import DraftVocab
from tests.helpers import CONFIGS, DRAFT_VOCAB, VLLM_BLOCK, V, _randomise, make_checkpoint, tiny_llama  # noqa: F401

@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(peaked=3.0))


def _prefill(target: Target, drafter, prompt: list[int]) -> int:
    """Begin the drafter on prompt[:n] (features / last hidden of those positions); the anchor is prompt[n]."""
    layers = drafter.feature_layers
    full = target.forward(torch.tensor([prompt]), None, layers)
    n = len(prompt) - 1
    drafter.begin(prompt[:n], TargetStep(None, full.features[:, :n] if layers else None, full.last_hidden[:, :n]))
    return n


def _propose(target: Target, drafter, prompt: list[int], params: SamplingParams):
    n = _prefill(target, drafter, prompt)
    return drafter.propose(prompt[: n + 1], drafter.cfg.gamma, params, torch.Generator().manual_seed(0))


def assert_same_proposal(a, b, exact: bool = True) -> None:
    """Equal tokens; q and confidences equal (bitwise, or to float32 rounding across implementations)."""
    assert torch.equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    for x, y in ((a.q, b.q), (a.confidences, b.confidences)):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y) if exact else torch.allclose(x, y, atol=2e-5, rtol=1e-4), (x - y).abs().max()


PROMPT = [int(x) for x in torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_gives_identical_drafts(target, name, tmp_path):
    src = make_checkpoint(target, name, tmp_path / "ours")
    out = export_speculators(src, tmp_path / "spec", target).path
    assert is_speculators_dir(out) and not is_speculators_dir(src)
    spec = json.loads((out / "config.json").read_text())
    method = CONFIGS[name]["method"]
    assert spec["speculators_model_type"] == method
    weights = load_file(out / "model.safetensors")
    assert not {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "mask_embedding"} & weights.keys()
    if method == "eagle3":
        assert {"fc.weight", "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight"} <= weights.keys()
        reduced = spec["draft_vocab_size"] < V
        assert ({"d2t", "t2d"} <= weights.keys()) == reduced and ({"d2t", "t2d"} & weights.keys() == set()) != reduced
        if reduced:
            assert weights["t2d"].dtype == torch.bool and weights["d2t"].dtype == torch.int64
        assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    if method in ("dflash", "dspark"):
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= weights.keys()
        assert spec["mask_token_id"] == CONFIGS[name]["mask_token_id"]
        n = DRAFT_VOCAB.get(name)
        assert spec["draft_vocab_size"] == (n or V)
        # a reduced vocabulary ships its LM-head rows (the format requires them) and d2t / t2d; a full one nothing
        assert ({"lm_head.weight", "d2t", "t2d"} <= weights.keys()) == bool(n)
        if n:
            ids = DraftVocab.load(Path(src) / DRAFT_VOCAB_FILE).target_ids
            assert torch.equal(weights["lm_head.weight"], target.model.lm_head.weight[ids])  # the verifier's rows, unrounded
            assert torch.equal(weights["d2t"] + torch.arange(n), ids) and torch.equal(weights["t2d"].nonzero().flatten(), ids)
    if method == "dspark":
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"} <= weights.keys()
        assert weights["markov_head.markov_w2.weight"].shape[0] == spec["draft_vocab_size"]
        temps = torch.linspace(0.8, 1.6, spec["block_size"]).to(torch.bfloat16 if name.endswith("-bf16") else torch.float32)
        assert spec["selfdraft"]["confidence_temperatures"] == pytest.approx(temps.float().tolist())
    if method == "mtp":
        assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.token_layernorm.weight", "mtp_layers.0.self_attn.q_norm.weight"} <= weights.keys()

    original, imported = load_drafter(src, target), load_drafter(str(out), target)
    assert type(imported) is type(original)
    if getattr(original.cfg, "loss_vocab_size", 0) and name in DRAFT_VOCAB:  # the module's vocabulary is the drafted one
        assert imported.cfg.loss_vocab_size == DRAFT_VOCAB[name] != original.cfg.loss_vocab_size
        imported.cfg = dataclasses.replace(imported.cfg, loss_vocab_size=original.cfg.loss_vocab_size)
    assert imported.cfg == original.cfg
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        assert_same_proposal(_propose(target, original, PROMPT, params), _propose(target, imported, PROMPT, params))
    # End to end through the decoding loop (sampled): same tokens, same accepted lengths.
    cfg = GenerationConfig(max_new_tokens=24, gamma=4)
    ra = generate(target, load_drafter(src, target), PROMPT, SamplingParams(temperature=1.0, seed=3), cfg)
    rb = generate(target, load_drafter(str(out), target), PROMPT, SamplingParams(temperature=1.0, seed=3), cfg)
    assert ra.token_ids == rb.token_ids and ra.accepted_lengths == rb.accepted_lengths


def test_mask_token_id_uses_the_targets_frozen_embedding_row(target):
    """mask_token_id >= 0: the mask slots are the target's embedding row (no parameter, nothing saved), i.e. the
    same function as a learned mask vector equal to that row; vLLM builds exactly this."""
    torch.manual_seed(0)
    row_model = STRATEGIES["dspark"].build(drafter_config(CONFIGS["dspark"]), target).float()
    assert "mask_embedding" not in row_model.state_dict()
    assert "mask_embedding" not in dict(row_model.named_parameters())
    assert torch.equal(row_model.mask_embedding, target.embed(torch.tensor(7)))
    learned = STRATEGIES["dspark"].build(drafter_config({**CONFIGS["dspark"], "mask_token_id": -1}), target).float()
    learned.load_state_dict({**row_model.state_dict(), "mask_embedding": target.embed(torch.tensor(7)).detach()})
    T, pos = 10, torch.tensor([[4, 8]])
    feats = torch.randn(1, T, len(row_model.fc.weight[0]) // target.hidden_size, target.hidden_size)
    from selfdraft.drafters.blocks import block_attention_mask

    def h(m):
        ctx = m.context_kv(m.context(feats), torch.arange(T)[None])
        return m.backbone(ctx, target.embed(torch.tensor([[3, 5]])), pos, block_attention_mask(pos, T, m.block_len))

    assert torch.equal(h(row_model), h(learned))
    learned.mask_embedding.data.add_(0.1)  # a different mask vector changes the drafts: the row is really used
    assert not torch.allclose(h(row_model), h(learned))


REFUSED = {  # drafters vLLM would not run as trained -> the config values the message must ask for
    "dspark-old": (dict(method="dspark", gamma=4, markov_rank=8, **VLLM_BLOCK), {"qk_norm": True, "mask_token_id": V - 1}),
    "dspark-default": (dict(method="dspark", gamma=4, markov_rank=8, qk_norm=True, mask_token_id=V - 1),
                       {"context_next_token": False, "dense_first": False, "context_residual": False}),
    "dflash-learned-mask": (dict(method="dflash", gamma=4, anchor_as_first=False, qk_norm=True), {"mask_token_id": V - 1}),
    "mtp-deepseek": (dict(method="mtp", gamma=3, mtp_modules=2, qk_norm=True), {"mtp_modules": 1, "mtp_normed_handoff": True}),
    "mtp-no-qk": (dict(method="mtp", gamma=1), {"qk_norm": True}),
    "dspark-context-residual": (dict(method="dspark", gamma=4, markov_rank=8, qk_norm=True, mask_token_id=V - 1,
                                     **{**VLLM_BLOCK, "context_residual": True, "context_next_token": True}),
                                {"context_next_token": False, "context_residual": False}),
    "dspark-dense-first": (dict(method="dspark", gamma=4, markov_rank=8, qk_norm=True, mask_token_id=V - 1,
                                **{**VLLM_BLOCK, "dense_first": True}),
                           {"dense_first": False}),
    "eagle3-two-layers": (dict(method="eagle3", gamma=3, feature_layers=(0, 2)), {"feature_layers": [0, 1, 2]}),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_export_refuses_what_vllm_cannot_run_and_says_what_to_retrain(target, name, tmp_path):
    """No warning-and-export: the message names the --config to retrain with, and `train` accepts it."""
    config, fixes = REFUSED[name]
    src = make_checkpoint(target, name, tmp_path / "ours", config)
    with pytest.raises(CheckpointError, match="Retrain it in vLLM's layout") as e:
        export_speculators(src, tmp_path / "spec", target)
    assert not (tmp_path / "spec").exists()
    inline = str(e.value).split("--config '")[1].split("'")[0]
    assert json.loads(inline) == {"drafter": fixes}
    from selfdraft.cli.train import train_configs as _train_configs

    dcfg, _ = _train_configs(inline, {"method": config["method"]}, {"data": "d"})  # what `train --config` does with it
    retrained = make_checkpoint(target, name, tmp_path / "retrained", {**config, **{k: getattr(dcfg, k) for k in fixes}})
    export_speculators(retrained, tmp_path / "spec", target)  # the retrained layout exports


def test_train_config_takes_a_path_or_inline_json(tmp_path):
    from selfdraft.cli.train import train_configs as _train_configs
    from selfdraft.config import ConfigError

    body = {"drafter": {"qk_norm": True, "mask_token_id": 5}, "train": {"steps": 3}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(body))
    for arg in (str(path), json.dumps(body), "  " + json.dumps(body)):
        dcfg, tcfg = _train_configs(arg, {"gamma": 2}, {"data": "d"})
        assert (dcfg.qk_norm, dcfg.mask_token_id, dcfg.gamma, tcfg.steps) == (True, 5, 2, 3)
    for bad, msg in (('{"drafter": {', "invalid JSON"), (str(tmp_path / "nope.json"), "cannot read it"),
                     ('{"optim": {}}', "'drafter' and/or 'train'"), ('{"drafter": {"qk_nrom": 1}}', "unknown key")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            _train_configs(bad, {}, {"data": "d"})


def test_verifier_names_a_hub_id_or_a_local_directory(target, tmp_path):
    from selfdraft.config import ConfigError

    src = make_checkpoint(target, "dspark", tmp_path / "ours")
    rep = export_speculators(src, tmp_path / "a", target, verifier="org/tiny-llama")
    assert json.loads((rep.path / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    local = tmp_path / "verifier"
    target.model.save_pretrained(local)
    rep = export_speculators(src, tmp_path / "b", target, verifier=str(local))
    assert rep.verifier == str(local.resolve())
    other = tmp_path / "other"
    tiny_llama(hidden=64).save_pretrained(other)
    with pytest.raises(ConfigError, match="hidden/vocab sizes"):
        export_speculators(src, tmp_path / "c", target, verifier=str(other))
    with pytest.raises(ConfigError, match="no such directory"):
        export_speculators(src, tmp_path / "c", target, verifier=str(tmp_path / "missing"))


def test_export_command_prints_the_serve_line_or_refuses(target, tmp_path):
    from typer.testing import CliRunner

    from selfdraft.cli import app

    local = tmp_path / "verifier"
    target.model.save_pretrained(local)
    ok = make_checkpoint(target, "dspark", tmp_path / "ok")
    res = CliRunner().invoke(app, ["export", ok, str(tmp_path / "out"), "--target", str(local), "--verifier", str(local),
                                   "--dtype", "float32"])  # fmt: skip
    assert res.exit_code == 0 and "copy bias" not in res.output, res.output
    meta = json.loads((Path(ok) / "config.json").read_text())
    meta["drafter"]["copy_bias"] = 8.0  # inference only: exported without it, and the user is told
    (Path(ok) / "config.json").write_text(json.dumps(meta))
    told = CliRunner().invoke(app, ["export", ok, str(tmp_path / "out3"), "--target", str(local), "--verifier", str(local),
                                    "--dtype", "float32"])  # fmt: skip
    assert told.exit_code == 0 and "copy_bias 8) is an option of selfdraft's engine" in told.output, told.output
    out = (tmp_path / "out").resolve()
    assert (f"vllm serve {local.resolve()} --speculative-config '{{\"model\": \"{out}\", \"method\": \"dspark\", "
            f"\"num_speculative_tokens\": 4}}'") in res.output  # fmt: skip
    bad = make_checkpoint(target, "old", tmp_path / "old", REFUSED["dspark-old"][0])
    res = CliRunner().invoke(app, ["export", bad, str(tmp_path / "out2"), "--target", str(local), "--dtype", "float32"])
    assert res.exit_code == 2 and "Retrain it in vLLM's layout" in res.output and not (tmp_path / "out2").exists()


def test_import_refuses_another_target(target, tmp_path):
    src = make_checkpoint(target, "dspark", tmp_path / "ours")
    out = export_speculators(src, tmp_path / "spec", target).path
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
    """Checkpoints as others write them still map onto our modules with identical drafts: no selfdraft block,
    EAGLE-3 `midlayer.` names, a DFlash with a learned `mask_embedding` tensor (as vLLM's DFlash accepts)."""
    for name in ("dspark", "eagle3"):
        src = make_checkpoint(target, name, tmp_path / f"ours-{name}")
        out = export_speculators(src, tmp_path / f"spec-{name}", target).path
        spec = json.loads((out / "config.json").read_text())
        del spec["selfdraft"]
        (out / "config.json").write_text(json.dumps(spec))
        w = load_file(out / "model.safetensors")
        save_file({k.replace("layers.0.", "midlayer.") if name == "eagle3" else k: v for k, v in w.items()}, str(out / "model.safetensors"))
        a = _propose(target, load_drafter(src, target), PROMPT, SamplingParams(temperature=1.0))
        b = _propose(target, load_drafter(str(out), target), PROMPT, SamplingParams(temperature=1.0))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)
    # learned mask vector, shipped as `mask_embedding` (what our older exports and some public DFlash drafters hold)
    src = make_checkpoint(target, "learned", tmp_path / "ours-learned", REFUSED["dflash-learned-mask"][0])
    mine = load_drafter(src, target)
    from selfdraft.export import name_map, speculators_config

    out = tmp_path / "spec-learned"
    out.mkdir()
    state = mine.model.state_dict()
    save_file({t: state[k].contiguous() for k, t in name_map("dflash", mine.model).items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(speculators_config(mine.cfg, target, {"mask_token_id": 3})))
    imported = load_drafter(str(out), target)
    assert imported.cfg.mask_token_id == -1
    assert_same_proposal(_propose(target, mine, PROMPT, SamplingParams(temperature=1.0)),
                         _propose(target, imported, PROMPT, SamplingParams(temperature=1.0)))  # fmt: skip


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


def _export_all(target, tmp_path, verifier: str | None = None) -> dict:
    return {name: export_speculators(make_checkpoint(target, name, tmp_path / f"ours-{name}"), tmp_path / f"spec-{name}",
                                     target, verifier=verifier).path for name in CONFIGS}  # fmt: skip


def test_config_matches_schema(target, tmp_path):
    for out in _export_all(target, tmp_path).values():
        check_schema(json.loads((out / "config.json").read_text()))


# ------------------------------------------------------------------ speculators' own classes
REFERENCE = Path(__file__).with_name("speculators_reference.py")


def speculators_python() -> str | None:
    """An interpreter with `speculators`: this one, or SELFDRAFT_SPECULATORS_PYTHON (speculators 0.9.0 pins
    transformers <= 5.19, selfdraft 5.24, so it usually lives in its own virtual environment)."""
    if os.environ.get("SELFDRAFT_SPECULATORS_PYTHON"):
        return os.environ["SELFDRAFT_SPECULATORS_PYTHON"]
    return sys.executable if importlib.util.find_spec("speculators") else None


needs_speculators = pytest.mark.skipif(
    speculators_python() is None,
    reason="speculators is not installed: it pins transformers<=5.19 (selfdraft: 5.24), so install it in its own venv "
    "(python -m venv /tmp/spec && /tmp/spec/bin/pip install torch==2.13.0 speculators==0.9.0) and set "
    "SELFDRAFT_SPECULATORS_PYTHON=/tmp/spec/bin/python",
)


@needs_speculators
def test_speculators_loads_every_export_cleanly_and_drafts_like_us(target, tmp_path):
    """For every method: speculators' own loader reports 0 missing / 0 unexpected / 0 mismatched tensors, no
    weight left at its NaN sentinel and no module tensor that is neither shipped nor the verifier's
    (embedding, verifier head / norm), and drafts computed by
    speculators' own modules from the exported files equal ours from the original checkpoint: greedy tokens
    exactly, and q (temperature 1, along our sampled chain) and confidences to float32 rounding."""
    verifier = tmp_path / "verifier"
    target.model.save_pretrained(verifier)  # the verifier as a local directory (this machine is offline)
    outs = _export_all(target, tmp_path, verifier=str(verifier))
    cases, expected = [], []
    for name, out in outs.items():
        ours = load_drafter(make_checkpoint(target, name, tmp_path / f"ours-{name}"), target)
        n = len(PROMPT) - 1
        full = target.forward(torch.tensor([PROMPT]), None, ours.feature_layers)
        inputs = {"ids": torch.tensor(PROMPT), "last_hidden": full.last_hidden[0, :n].contiguous()}
        if ours.feature_layers:
            inputs["features"] = full.features[0, :n].flatten(1).contiguous()  # [n, n_feat * H], speculators' order
        for params in (SamplingParams(), SamplingParams(temperature=1.0)):
            p = _propose(target, ours, PROMPT, params)
            file = tmp_path / f"in-{name}-{params.temperature}.safetensors"
            save_file({**inputs, **({} if params.greedy else {"forced": p.tokens})}, str(file))
            cases.append({"dir": str(out), "inputs": str(file)})
            expected.append((name, params, p))
    # Control: the defects of the old export (a learned mask vector shipped, no q/k norms) must show in the report.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((outs["dspark"] / "config.json").read_text())
    w = load_file(outs["dspark"] / "model.safetensors")
    w["mask_embedding"] = torch.zeros(target.hidden_size)
    del w["layers.0.self_attn.q_norm.weight"]
    save_file(w, str(broken / "model.safetensors"))
    cases.append({"dir": str(broken), "report_only": True})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    res = subprocess.run([speculators_python(), str(REFERENCE), str(tmp_path / "cases.json"), str(tmp_path / "ref.safetensors")],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    reports = json.loads(res.stdout.strip().splitlines()[-1])
    control = reports.pop()
    assert control["missing_keys"] == control["not_shipped"] == ["layers.0.self_attn.q_norm.weight"]
    assert control["unexpected_keys"] == ["mask_embedding"]
    ref = load_file(tmp_path / "ref.safetensors")
    for i, ((name, params, p), report) in enumerate(zip(expected, reports)):
        assert report == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "nan": [], "not_shipped": []}, (name, report)
        assert torch.equal(ref[f"{i}.tokens"], p.tokens), (name, params, ref[f"{i}.tokens"], p.tokens)
        if not params.greedy:
            q = torch.softmax(ref[f"{i}.logits"], -1)
            assert torch.allclose(q, p.q, atol=2e-5, rtol=1e-4), (name, (q - p.q).abs().max())
        if p.confidences is not None:
            assert torch.allclose(ref[f"{i}.conf"], p.confidences.float(), atol=2e-5), (name, ref[f"{i}.conf"], p.confidences)
        else:
            assert ref[f"{i}.conf"].numel() == 0


VALIDATE = textwrap.dedent("""
    import json, sys
    from speculators import SpeculatorModelConfig
    for path in sys.argv[1:]:
        d = json.load(open(path))
        cfg = SpeculatorModelConfig.from_dict(d)
        assert type(cfg).__name__ == {"eagle3": "Eagle3SpeculatorConfig", "dflash": "DFlashSpeculatorConfig",
                                       "dspark": "DSparkSpeculatorConfig", "mtp": "MTPSpeculatorConfig"}[d["speculators_model_type"]]
        assert cfg.speculators_config.verifier.name_or_path == d["speculators_config"]["verifier"]["name_or_path"]
        assert cfg.transformer_layer_config.hidden_size == d["transformer_layer_config"]["hidden_size"]
        print(d["speculators_model_type"], type(cfg).__name__, "ok")
""")


@needs_speculators
def test_config_validates_with_speculators_classes(target, tmp_path):
    outs = _export_all(target, tmp_path)
    res = subprocess.run([speculators_python(), "-c", VALIDATE, *[str(o / "config.json") for o in outs.values()]],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count(" ok") == len(outs), res.stdout


def test_methods_table_covers_every_exported_method():
    """Every trained method has a speculators map (in its package's export.py), named like the method."""
    assert set(exportable()) == {"eagle3", "dflash", "dspark", "mtp"}
    assert all(method_map(name).method == name for name in exportable())
