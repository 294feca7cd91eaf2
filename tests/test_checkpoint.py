"""Drafter checkpoint directories: round trip, atomic saves, corrupt files, wrong targets."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import selfdraft.checkpoint as ckpt
from selfdraft.checkpoint import CheckpointError, load_checkpoint, load_module, provenance, save_checkpoint
from selfdraft.config import ConfigError, DrafterConfig, SamplingParams, from_dict
from selfdraft.loader import load_drafter
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from tests.helpers import tiny_llama
from tests.toy_training import TOY, ToyConfig, single_thread, toy_method  # noqa: F401  (fixtures)

CFG = ToyConfig(feature_layers=(1, 2))


def toy_model(target: Target, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return STRATEGIES[TOY].build(CFG, target)


def save(dir, model, target):
    return save_checkpoint(dir, model, CFG, target, provenance("toy-data", steps=3, tokens=100))


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_round_trip_same_weights_and_drafts(toy_method, tiny_target, tmp_path):
    model = toy_model(tiny_target)
    save(tmp_path / "d", model, tiny_target)
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    assert meta["format"] == "selfdraft-drafter" and meta["version"] == 1 and meta["method"] == TOY
    assert meta["target"] == tiny_target.identity() and meta["feature_layers"] == [1, 2]
    assert meta["provenance"]["steps"] == 3 and "command" in meta["provenance"] and "git_commit" in meta["provenance"]
    loaded, cfg = load_module(tmp_path / "d", tiny_target)
    assert cfg == CFG and same_weights(model, loaded)

    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    step = tiny_target.forward(ids, None, CFG.feature_layers)
    fresh, reloaded = STRATEGIES[TOY].drafter(model, CFG, tiny_target), load_drafter(str(tmp_path / "d"), tiny_target)
    for d in (fresh, reloaded):
        d.begin(ids[0].tolist(), step)
    p1 = fresh.propose(ids[0].tolist(), 1, SamplingParams(), None)
    p2 = reloaded.propose(ids[0].tolist(), 1, SamplingParams(), None)
    assert torch.equal(p1.tokens, p2.tokens)


def test_loads_in_the_targets_dtype(toy_method, tiny_target, tmp_path):
    save(tmp_path / "d", toy_model(tiny_target), tiny_target)
    bf16 = Target(tiny_llama().to(torch.bfloat16))  # same weights: same fingerprint
    model, _ = load_module(tmp_path / "d", bf16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_mismatched_target_names_both(toy_method, tiny_target, tmp_path):
    tiny_target.name = "tiny-a"
    save(tmp_path / "d", toy_model(tiny_target), tiny_target)
    other = Target(tiny_llama(seed=1), name="tiny-b")
    with pytest.raises(CheckpointError, match="tiny-a.*tiny-b") as e:
        load_checkpoint(tmp_path / "d", other)
    assert "fingerprint" in str(e.value)
    wider = Target(tiny_llama(hidden=64), name="tiny-wide")
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_checkpoint(tmp_path / "d", wider)


def test_corrupt_files_raise_checkpoint_error(toy_method, tiny_target, tmp_path):
    d = save(tmp_path / "d", toy_model(tiny_target), tiny_target)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a truncated copy
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt or truncated"):
        load_checkpoint(d, tiny_target)
    weights.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(d, tiny_target)
    weights.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(d, tiny_target)
    (d / "config.json").write_text('{"format": "selfdraft-drafter", "vers')
    with pytest.raises(CheckpointError, match="config.json is corrupt"):
        load_checkpoint(d, tiny_target)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", tiny_target)


def test_unknown_keys_and_methods_raise(toy_method, tiny_target, tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(DrafterConfig, {"gamma": 4, "gama": 4})
    d = save(tmp_path / "d", toy_model(tiny_target), tiny_target)
    meta = json.loads((d / "config.json").read_text())
    meta["drafter"]["not_a_field"] = 1
    (d / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not_a_field"):
        load_checkpoint(d, tiny_target)
    meta["drafter"].pop("not_a_field")
    meta["method"] = "mystery"
    (d / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="known methods"):
        load_checkpoint(d, tiny_target)


def test_kill_during_save_keeps_the_previous_checkpoint(toy_method, tiny_target, tmp_path, monkeypatch):
    first, second = toy_model(tiny_target, seed=0), toy_model(tiny_target, seed=1)
    d = save(tmp_path / "d", first, tiny_target)

    # A failure while writing the new files: the old directory is untouched.
    def broken_save_file(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_file", broken_save_file)
        with pytest.raises(OSError, match="disk full"):
            save(d, second, tiny_target)
    assert same_weights(load_module(d, tiny_target).model, first)

    # A kill between moving the old directory aside and moving the new one in (commit steps 3-4).
    real_replace = ckpt.os.replace

    def replace_then_die(src, dst):
        if str(src).endswith(".tmp"):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(ckpt.os, "replace", replace_then_die)
        with pytest.raises(KeyboardInterrupt):
            save(d, second, tiny_target)
    assert not d.exists()  # the window the recovery exists for
    assert same_weights(load_module(d, tiny_target).model, first)  # the previous checkpoint is back
    save(d, second, tiny_target)  # and the next save succeeds, leaving no temp dirs behind
    assert same_weights(load_module(d, tiny_target).model, second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_target_weights_are_never_saved(tiny_target, tmp_path):
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.head = tiny_target.model.get_output_embeddings()  # registers the target's LM head

    with pytest.raises(CheckpointError, match="head.weight"):
        save_checkpoint(tmp_path / "d", Leaky(), CFG, tiny_target, {})
    assert not (tmp_path / "d").exists()


def test_temp_dir_of_a_killed_save_is_removed_at_the_next_load(toy_method, tiny_target, tmp_path):
    """A process killed while writing `.d.tmp` (the owner pid is gone) leaves it behind; the next
    loader removes it. A `.tmp` whose writer still runs is left alone."""
    import subprocess
    import sys

    d = save(tmp_path / "d", toy_model(tiny_target), tiny_target)
    code = ("import os, signal, sys; from selfdraft.checkpoint import atomic_dir\n"
            "with atomic_dir(sys.argv[1]) as tmp:\n"
            "    (tmp / 'model.safetensors').write_bytes(b'x' * 100000)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True)
    assert proc.returncode == -9
    tmp, owner = tmp_path / ".d.tmp", tmp_path / ".d.tmp.owner"
    assert tmp.is_dir() and owner.exists()
    load_module(d, tiny_target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]

    tmp.mkdir()  # a writer that is alive (this process): its temp dir stays
    owner.write_text(f"{ckpt.os.getpid()} {ckpt.socket.gethostname()}")
    load_module(d, tiny_target)
    assert tmp.is_dir()


def test_config_whose_method_fields_disagree_or_are_unknown_is_refused(toy_method, tiny_target, tmp_path):
    d = save(tmp_path / "d", toy_model(tiny_target), tiny_target)
    meta = json.loads((d / "config.json").read_text())
    for drafter_method, match in (("bogus", "disagree"), ("dflash", "disagree")):
        (d / "config.json").write_text(json.dumps({**meta, "drafter": {**meta["drafter"], "method": drafter_method}}))
        with pytest.raises(CheckpointError, match=match) as e:
            load_checkpoint(d, tiny_target)
        assert str(d / "config.json") in str(e.value)
