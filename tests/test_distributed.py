"""Data-parallel training under torchrun (gloo on CPU): a 2-rank run follows the 1-rank trajectory.

`--batch-size` is the global micro-batch; each rank takes half. With equal token counts per rank (all
sequences the same length and mask) the DDP-averaged gradient equals the 1-process full-batch gradient,
so after N steps the parameters agree to float tolerance. MTP is used because its loss is
deterministic (DFlash / DSpark sample anchors, so a 2-rank run draws other anchors than a 1-rank run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import selfdraft
from selfdraft.config import TrainConfig
from selfdraft.methods import drafter_config
from selfdraft.target import Target
from selfdraft.training.checkpointing import STATE_FILE
from selfdraft.training.trainer import train
from tests.helpers import DRAFTER, STEPS, TOL, TRAIN, cli_args, tiny_llama, write_equal_length_dataset  # noqa: F401

SRC = str(Path(selfdraft.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    tiny_llama(peaked=3.0).save_pretrained(root / "target")
    return root, root / "target", write_equal_length_dataset(root / "data")


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", "selfdraft", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def in_process(target_dir, data, out, **train_overrides):
    target = Target.load(str(target_dir), dtype="float32")
    return train(target, drafter_config(DRAFTER), TrainConfig(data=str(data), **{**TRAIN, **train_overrides}), out)


def max_diff(a_dir: Path, b_dir: Path) -> float:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_match_one_and_resume_on_one(setup):
    root, target_dir, data = setup
    single = in_process(target_dir, data, root / "single")
    assert single.steps == STEPS
    # 1. 2 ranks, same global batch: the same parameters after N steps.
    torchrun(2, cli_args(target_dir, data, root / "ddp"))
    diff = max_diff(root / "single", root / "ddp")
    print(f"DDP 2 ranks vs 1 process after {STEPS} steps: max |param diff| = {diff:.3e}")
    assert diff < TOL
    state = torch.load(root / "ddp" / STATE_FILE, weights_only=True)
    assert state["world_size"] == 2 and state["step"] == STEPS and state["tokens"] == single.tokens
    assert (state["epoch"], state["index"]) == (STEPS * 4 // 16, STEPS * 4 % 16)  # the cursor counts global samples
    moved = load_file(root / "single" / "model.safetensors")
    # 2. A 2-rank checkpoint resumes with 1 process (the cursor is global, in samples).
    torchrun(2, cli_args(target_dir, data, root / "half", steps=STEPS // 2))
    resumed = in_process(target_dir, data, root / "half")
    assert resumed.resumed_from == STEPS // 2 and resumed.steps == STEPS and resumed.tokens == single.tokens
    diff_resume = max_diff(root / "single", root / "half")
    print(f"2-rank checkpoint at step {STEPS // 2} resumed on 1 process: max |param diff| = {diff_resume:.3e}")
    assert diff_resume < TOL
    assert any(float(v.abs().sum()) > 0 for v in moved.values())


@pytest.mark.slow
def test_fsdp_on_gloo(setup):
    """--fsdp (FSDP2 fully_shard) on CPU/gloo: the same trajectory as 1 process; the checkpoint is gathered on
    rank 0, and a resumed FSDP run shards the saved optimizer state again."""
    root, target_dir, data = setup
    if not (root / "single" / "model.safetensors").exists():
        in_process(target_dir, data, root / "single")
    torchrun(2, cli_args(target_dir, data, root / "fsdp", fsdp=True, steps=STEPS // 2))
    torchrun(2, cli_args(target_dir, data, root / "fsdp", fsdp=True))  # resumes at step STEPS // 2
    state = torch.load(root / "fsdp" / STATE_FILE, weights_only=True)
    assert state["step"] == STEPS and state["world_size"] == 2
    diff = max_diff(root / "single", root / "fsdp")
    print(f"FSDP 2 ranks (resumed at step {STEPS // 2}) vs 1 process after {STEPS} steps: max |param diff| = {diff:.3e}")
    assert diff < TOL


def test_batch_must_split_over_ranks(setup, monkeypatch):
    from selfdraft.config import ConfigError
    from selfdraft.training.distributed import Distributed

    root, target_dir, data = setup
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="multiple of 3"):
        Distributed.from_env(Target(tiny_llama()), TrainConfig(data=str(data), batch_size=4))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="torchrun"):
        Distributed.from_env(Target(tiny_llama()), TrainConfig(data=str(data), fsdp=True))
