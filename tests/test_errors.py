"""Bad input gets a clear, actionable error."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner
from transformers import ViTConfig

from selfdraft.cli import app
from selfdraft.config import ConfigError, DrafterConfig, GenerationConfig, SamplingParams, from_dict
from selfdraft.decode import generate
from selfdraft.drafters import REGISTRY, load_drafter
from selfdraft.target import Target, TargetError
from tests.conftest import tiny_llama


def test_missing_target_path(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        Target.load(str(tmp_path / "nope"))


def test_non_causal_model_dir(tmp_path):
    ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(TargetError, match="causal language model"):
        Target.load(str(tmp_path))


def test_dir_without_config(tmp_path):
    with pytest.raises(TargetError, match="config.json"):
        Target.load(str(tmp_path))


def test_gguf_without_gguf_package(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(TargetError, match="pip install gguf"):
        Target.load(str(f))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k")],
)
def test_impossible_sampling_parameters(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_max_tokens_below_one():
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


def test_prompt_longer_than_context():
    target = Target(tiny_llama(max_pos=32))
    with pytest.raises(TargetError, match="exceeds the target's context of 32"):
        generate(target, REGISTRY["none"](), list(range(30)), config=GenerationConfig(max_new_tokens=8))


def test_unknown_drafter_and_config_keys(tiny_target):
    with pytest.raises(ConfigError, match="unknown drafter"):
        load_drafter("warp-drive", tiny_target)
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(DrafterConfig, {"gama": 7})


@pytest.mark.parametrize(
    "args, match",
    [(["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"), (["-n", "0"], "max_new_tokens"),
     ([], None)],
)
def test_cli_reports_errors_without_traceback(args, match):
    argv = ["generate", *args] + (["-p", "hi"] if match else [])
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    if match:
        assert match in res.output
