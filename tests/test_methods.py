"""The one method registry (selfdraft.methods) and the per-method configs: a fifth method is one new
package plus one registry line; old flat checkpoint configs still load; options of another method raise."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from selfdraft import methods
from selfdraft.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from selfdraft.config import ConfigError, GenerationConfig, TrainConfig
from selfdraft.decode import generate
from selfdraft.loader import load_drafter
from selfdraft.methods import drafter_config
from selfdraft.methods.dflash.config import DFlashConfig
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.methods.eagle3.config import Eagle3Config
from selfdraft.methods.mtp.config import MTPConfig
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.training.trainer import train
from tests.toy_training import single_thread, write_dataset  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- a fifth method
FIFTH = {  # one package, as a method in selfdraft/methods/ would be (no other project file changes)
    "__init__.py": """
        from selfdraft.methods import Method
        from fifth_method.config import FifthConfig

        METHOD = Method(name="fifth", config=FifthConfig, model="fifth_method.model:build",
                        drafter="fifth_method.drafter:FifthDrafter", strategy="fifth_method.train:STRATEGY")
        """,
    "config.py": """
        from dataclasses import dataclass

        from selfdraft.config import ConfigError, DrafterConfig, knob


        @dataclass
        class FifthConfig(DrafterConfig):
            method: str = "fifth"
            temperature_init: float = knob(1.0, "scale of the head's output")

            def __post_init__(self):
                super().__post_init__()
                if self.temperature_init <= 0:
                    raise ConfigError("temperature_init must be > 0")

            def default_feature_layers(self, target):
                return (target.num_layers - 2,)  # the method's own default
        """,
    "model.py": """
        import torch
        from torch import nn


        class Head(nn.Module):
            def __init__(self, n_feat, hidden, scale):
                super().__init__()
                self.fc = nn.Linear(n_feat * hidden, hidden, bias=False)
                self.scale = scale

            @property
            def dtype(self):  # TrainedDrafter runs the module in the target's dtype
                return self.fc.weight.dtype

            def forward(self, features):  # [..., n_feat, H] -> [..., H]
                return self.fc(features.flatten(-2)) * self.scale


        def build(cfg, target):
            return Head(len(cfg.feature_layers), target.hidden_size, cfg.temperature_init)
        """,
    "drafter.py": """
        import torch

        from selfdraft.drafters.base import Proposal, TrainedDrafter


        class FifthDrafter(TrainedDrafter):
            def begin(self, prompt_ids, step):
                self.last = step.features[0, -1]

            def observe(self, verification, step):
                self.last = step.features[0, -1]

            @torch.no_grad()
            def propose(self, tokens, gamma, params, generator):
                if gamma == 0:
                    return Proposal.empty()
                h = self.model(self.last.to(self.model.fc.weight.dtype))
                return Proposal(tokens=self.target.lm_head(h.to(self.target.model.dtype)).argmax(-1).view(1))
        """,
    "train.py": """
        import torch

        from selfdraft.training.strategy import LossOutput, Strategy


        class FifthStrategy(Strategy):
            method = "fifth"

            def loss(self, model, batch, target, cfg, generator):
                keep = batch.loss_mask[:, 1:]
                logits = target.lm_head(model(batch.features[:, :-1][keep])).float()
                loss = torch.nn.functional.cross_entropy(logits, batch.input_ids[:, 1:][keep])
                return LossOutput(loss=loss, tokens=int(keep.sum()), metrics={"ce": float(loss.detach())})


        STRATEGY = FifthStrategy()
        """,
}


@pytest.fixture
def fifth_method(tmp_path, monkeypatch):
    pkg = tmp_path / "plugins" / "fifth_method"
    pkg.mkdir(parents=True)
    for name, text in FIFTH.items():
        (pkg / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(pkg.parent))
    methods.register("fifth", "fifth_method")  # the registry line
    try:
        yield pkg
    finally:
        methods.unregister("fifth")
        for mod in [m for m in sys.modules if m == "fifth_method" or m.startswith("fifth_method.")]:
            del sys.modules[mod]


def test_a_fifth_method_is_one_package_and_one_registry_line(fifth_method, tiny_target, tmp_path):
    """Registered through the public path, the new method gets its typed config, is built, saved, loaded
    by `load_drafter` (without importing its train.py), trained by the generic loop and decodes losslessly."""
    assert "fifth" in methods.names(trained=True) and "fifth" not in methods.names(trained=False)
    cfg = drafter_config({"method": "fifth", "temperature_init": 0.5})
    assert type(cfg).__name__ == "FifthConfig" and cfg.temperature_init == 0.5
    with pytest.raises(ConfigError, match=r"markov_rank \(a dspark option\)"):
        drafter_config({"method": "fifth", "markov_rank": 8})
    with pytest.raises(ConfigError, match=r"temperature_init \(a fifth option\)"):
        drafter_config({"method": "dspark", "temperature_init": 1.0})  # its field is foreign to the others too

    model = methods.get("fifth").build(cfg, tiny_target)
    assert cfg.feature_layers == (tiny_target.num_layers - 2,)  # the method's own default, recorded
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg, tiny_target, {})
    drafter = load_drafter(str(ckpt), tiny_target)
    assert type(drafter).__name__ == "FifthDrafter" and "fifth_method.train" not in sys.modules

    data = write_dataset(tmp_path / "data")
    res = train(tiny_target, drafter_config({"method": "fifth"}), TrainConfig(data=str(data), steps=4, batch_size=4, val_every=0,
                                                                   save_every=0, warmup_steps=0), tmp_path / "trained")
    assert res.steps == 4 and res.history[-1].loss < res.history[0].loss
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["drafter"] == {
        "method": "fifth", "gamma": 7, "feature_layers": [tiny_target.num_layers - 2], "qk_norm": False,
        "temperature_init": 1.0}
    prompt, n = [3, 17, 42, 5], 12
    plain = generate(tiny_target, NoDrafter(), prompt, config=GenerationConfig(max_new_tokens=n))
    spec = generate(tiny_target, load_drafter(str(tmp_path / "trained"), tiny_target), prompt,
                    config=GenerationConfig(max_new_tokens=n))
    assert spec.token_ids == plain.token_ids and len(spec.accepted_lengths) > 0


# ----------------------------------------------------------------------------- per-method configs
# The drafter block of checkpoints/dflash/config.json as written before each method had its own config:
# every method's fields, the other methods' at their defaults.
OLD_FLAT_DFLASH = {
    "method": "dflash", "gamma": 7, "num_layers": 1, "feature_layers": [1, 2], "qk_norm": True,
    "anchor_as_first": False, "loss_decay": 4.0, "anchors_per_seq": 32, "init_from_target": False,
    "mask_token_id": 16, "loss_vocab_size": 0, "markov_rank": 64, "markov_head": "vanilla",
    "confidence_head": True, "w_ce": 0.1, "w_tv": 0.9, "w_conf": 1.0, "draft_vocab_size": 8192, "ttt_decay": 0.8,
    "tree_depth": 0, "tree_top_k": 10, "tree_total_tokens": 60, "mtp_modules": 1, "mtp_recursive": True,
    "mtp_decay": 0.6,
}


def test_each_method_has_its_own_config_with_only_its_fields():
    fields = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    shared = {"method", "gamma", "feature_layers", "qk_norm"}
    assert fields(DFlashConfig) - shared == {"num_layers", "anchor_as_first", "loss_decay", "anchors_per_seq",
                                             "init_from_target", "mask_token_id", "loss_vocab_size", "ce_label",
                                             "tree", "tree_top_k", "tree_total_tokens", "context_residual",
                                             "context_next_token", "dense_first"}
    assert fields(DSparkConfig) - fields(DFlashConfig) == {"markov_rank", "markov_head", "confidence_head",
                                                           "w_ce", "w_tv", "w_kl", "w_conf",
                                                           "kl_to_tv_tokens", "copy_bias", "copy_context"}  # DSpark extends DFlash
    assert fields(Eagle3Config) - shared == {"draft_vocab_size", "ttt_decay", "tree_depth", "tree_top_k", "tree_total_tokens"}
    assert fields(MTPConfig) - shared == {"mtp_modules", "mtp_recursive", "mtp_normed_handoff", "mtp_decay"}
    for cls in (DFlashConfig, DSparkConfig, Eagle3Config, MTPConfig):
        assert methods.get(cls().method).config is cls
    with pytest.raises(ConfigError, match="configures 'dflash' drafters, not 'dspark'"):
        DFlashConfig(method="dspark")
    with pytest.raises(ConfigError, match="markov_head"):
        DSparkConfig(markov_head="lstm")
    with pytest.raises(ConfigError, match="ce_label"):
        DSparkConfig(ce_label="sampled")
    with pytest.raises(ConfigError, match="tree_depth"):
        Eagle3Config(tree_depth=-1)
    with pytest.raises(ConfigError, match="tree_total_tokens"):
        DSparkConfig(tree_total_tokens=1)
    with pytest.raises(ConfigError, match="unknown key"):
        drafter_config({"method": "mtp", "mtp_modulez": 2})
    with pytest.raises(ConfigError, match="valid methods"):
        drafter_config({"method": "ngram"})  # training-free: no config


def test_old_flat_config_loads_and_a_foreign_non_default_value_raises():
    assert drafter_config(OLD_FLAT_DFLASH, legacy=True) == DFlashConfig(
        feature_layers=(1, 2), qk_norm=True, anchor_as_first=False, mask_token_id=16)
    with pytest.raises(ConfigError, match=r"markov_rank \(a dspark option\)"):
        drafter_config(OLD_FLAT_DFLASH)  # not a checkpoint: every foreign key is refused
    for key, value in (("markov_rank", 8), ("tree_depth", 2), ("mtp_recursive", False)):
        with pytest.raises(ConfigError, match=rf"^{key} \(a \w+ option\) set for a dflash drafter"):
            drafter_config({**OLD_FLAT_DFLASH, key: value}, legacy=True)


def test_old_flat_checkpoint_still_loads(tiny_target, tmp_path):
    """A checkpoint whose config.json holds the old flat config loads to the same drafter; a foreign
    field with a non-default value is a CheckpointError naming it."""
    cfg = DFlashConfig(feature_layers=(1, 2), gamma=3, mask_token_id=5, anchor_as_first=False)
    d = save_checkpoint(tmp_path / "d", methods.get("dflash").build(cfg, tiny_target), cfg, tiny_target, {})
    new = load_checkpoint(d, tiny_target)
    meta = json.loads((d / "config.json").read_text())
    assert set(meta["drafter"]) == {f.name for f in dataclasses.fields(DFlashConfig)}
    flat = {**OLD_FLAT_DFLASH, **meta["drafter"]}
    (d / "config.json").write_text(json.dumps({**meta, "drafter": flat}))
    old = load_checkpoint(d, tiny_target)
    assert old.cfg == new.cfg and all(a.equal(b) for a, b in zip(old.model.state_dict().values(), new.model.state_dict().values()))
    prompt = [3, 17, 42, 5]
    gen = GenerationConfig(max_new_tokens=8)
    assert generate(tiny_target, old, prompt, config=gen).accepted_lengths == generate(tiny_target, new, prompt, config=gen).accepted_lengths
    (d / "config.json").write_text(json.dumps({**meta, "drafter": {**flat, "w_tv": 0.5}}))
    with pytest.raises(CheckpointError, match=r"w_tv \(a dspark option\)"):
        load_checkpoint(d, tiny_target)


SHIPPED = {"dflash": DFlashConfig, "dspark": DSparkConfig, "eagle3": Eagle3Config, "mtp": MTPConfig}


def test_every_family_is_shipped_within_the_size_budget():
    """checkpoints/ holds one drafter per trained family, drafter weights only, <= 80 MB in all."""
    assert sorted(p.name for p in (ROOT / "checkpoints").iterdir() if p.is_dir()) == sorted(SHIPPED)
    assert sum(f.stat().st_size for f in (ROOT / "checkpoints").rglob("*") if f.is_file()) <= 80e6


@pytest.mark.parametrize("name,cls", SHIPPED.items())
def test_shipped_checkpoints_hold_their_methods_config(name, cls):
    """The committed checkpoints' config.json are in the per-method format (strictly valid)."""
    meta = json.loads((ROOT / "checkpoints" / name / "config.json").read_text())
    cfg = drafter_config(meta["drafter"])
    assert type(cfg) is cls and meta["method"] == name
    if name in ("dflash", "dspark"):  # the block drafters read five target layers (docs/methods/dflash.md)
        assert cfg.feature_layers == (1, 8, 14, 20, 27)


def test_inference_does_not_import_a_methods_training_part():
    """Loading every method's inference parts (config, model, drafter, export map) imports no training module."""
    code = textwrap.dedent("""
        import sys
        from selfdraft import methods
        for name in methods.names():
            m = methods.get(name)
            for part in (m.drafter, m.model, m.export):
                if part:
                    m.part(part)
        print(sorted(k for k in sys.modules if k.startswith("selfdraft.training") or k.endswith(".train")))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoints_load_and_decode_losslessly(embedded_fp32, name):
    ids = embedded_fp32.encode_prompt("Write a haiku about CPUs.")
    gen = GenerationConfig(max_new_tokens=24)
    drafter = load_drafter(str(ROOT / "checkpoints" / name), embedded_fp32)
    assert generate(embedded_fp32, drafter, ids, config=gen).token_ids == generate(embedded_fp32, NoDrafter(), ids, config=gen).token_ids


def test_a_checkpoint_without_a_newer_option_loads_with_it_off(monkeypatch):
    """A config.json written before an option existed was trained without it: loading (legacy) fills the
    option's ABSENT_MEANS value, not today's default; a fresh config keeps the default."""
    from selfdraft.methods.dspark.config import DSparkConfig

    monkeypatch.setattr(DSparkConfig, "ABSENT_MEANS", {**DSparkConfig.ABSENT_MEANS, "markov_rank": 7})  # a planted value
    assert methods.drafter_config({"method": "dspark"}, legacy=True).markov_rank == 7
    assert methods.drafter_config({"method": "dspark", "markov_rank": 9}, legacy=True).markov_rank == 9  # saved wins
    assert methods.drafter_config({"method": "dspark"}).markov_rank == DSparkConfig().markov_rank
    old = methods.drafter_config({"method": "dspark"}, legacy=True)
    assert not (old.dense_first or old.context_residual or old.context_next_token) and old.kl_to_tv_tokens == 0
