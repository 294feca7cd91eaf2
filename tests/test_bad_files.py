"""Bad files end in one actionable line (exit 2), never a traceback; files are replaced durably;
a reader never undoes a checkpoint save in progress. Tiny models and toy runs only."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from selfdraft.cli import app as cli_app
from selfdraft.config import ConfigError
from selfdraft.target import Target
from selfdraft.training.checkpointing import STATE_FILE
from selfdraft.training.records import DataError
from tests.test_serve import model_dir  # noqa: F401  (fixture: a tiny chat model saved to disk)
from tests.test_trainer import cfgs, data, tiny_target, toy_method  # noqa: F401  (fixtures)


def serve(target_dir: Path, *args: str):
    return CliRunner().invoke(cli_app, ["serve", "--target", str(target_dir), "--dtype", "float32", "--port", "1", *args])


def one_line_error(res, *words: str) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.strip().startswith("error:"), res.output
    assert all(w in res.output for w in words), res.output


@pytest.fixture
def broken(model_dir, tmp_path):  # noqa: F811
    def copy(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(model_dir, d)
        return d

    return copy


# ---------------------------------------------------------------- a target with a bad file
def test_a_truncated_target_weights_file_is_a_one_line_error(broken):
    d = broken("truncated")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    one_line_error(serve(d), str(d), "truncated or damaged")


@pytest.mark.parametrize("content", ["{}", '{"version": "1.0", "trunc'], ids=["not a tokenizer", "cut JSON"])
def test_a_corrupt_tokenizer_json_is_a_one_line_error(broken, content):
    d = broken("tokenizer")
    (d / "tokenizer.json").write_text(content)
    one_line_error(serve(d), "tokenizer", str(d))


def test_a_bad_log_level_is_refused_before_the_model_loads(tmp_path):
    one_line_error(serve(tmp_path / "no-such-target", "--log-level", "bogus"), "--log-level")  # not the missing target


# ---------------------------------------------------------------- training and data files
def test_a_corrupt_trainer_state_is_a_clear_error(toy_method, tiny_target, data, tmp_path):  # noqa: F811
    from selfdraft.training.trainer import train

    dcfg, tcfg = cfgs(data, steps=5, save_every=5)
    train(tiny_target, dcfg, tcfg, tmp_path / "out")
    state = tmp_path / "out" / STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(ConfigError, match="trainer_state.pt is damaged.*--no-resume"):
        train(tiny_target, dcfg, tcfg, tmp_path / "out")


def test_a_corrupt_regeneration_manifest_names_the_file(tmp_path):
    from selfdraft.training.regenerate import RegenConfig, _open_manifest
    from tests.helpers import tiny_llama

    (tmp_path / "manifest.json").write_text('{"target": {"fingerprint": ')
    with pytest.raises(DataError, match="manifest.json is damaged"):
        _open_manifest(tmp_path, Target(tiny_llama()), RegenConfig(), {})


# ---------------------------------------------------------------- durable replacement
@pytest.fixture
def fs_log(monkeypatch):
    """Every fsync (by path) and rename, in order."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def assert_durable(events: list[tuple], final: Path) -> None:
    """The new file was flushed before its rename onto `final`, and the directory after it."""
    at = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final))
    src = events[at][1]
    assert ("fsync", src) in events[:at], events
    assert ("fsync", str(final.parent)) in events[at + 1:], events


def test_records_manifest_is_replaced_durably(tmp_path, fs_log):
    from selfdraft.training.records import _write_json

    _write_json(tmp_path / "manifest.json", {"a": 1})
    assert_durable(fs_log, tmp_path / "manifest.json")
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"a": 1} and os.listdir(tmp_path) == ["manifest.json"]


def test_feature_shards_and_index_are_replaced_durably(tmp_path, fs_log):
    from selfdraft.training.features import _write_shard, write_index

    buffer = [{"id": "r0", "split": "train", "input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([0, 1], dtype=torch.uint8),
               "features": torch.zeros(2, 2, 4), "last_hidden": torch.zeros(2, 4), "lse": torch.zeros(2)}]
    entry = _write_shard(tmp_path, 0, buffer, {"h": 1})
    assert_durable(fs_log, tmp_path / entry["file"])
    write_index(tmp_path, {"shards": [entry]})
    assert_durable(fs_log, tmp_path / "index.json")  # was rewritten in place: a crash could leave it torn


def test_the_int4_cache_is_replaced_durably(tmp_path, fs_log, monkeypatch):
    from selfdraft.native import gguf

    monkeypatch.setattr(gguf, "_read_exact", lambda *a: {})
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    gguf.exact_int4_weights(src, {}, 2, 1, cache=tmp_path / "native_int4.safetensors")
    assert_durable(fs_log, tmp_path / "native_int4.safetensors")


# ---------------------------------------------------------------- a reader racing a checkpoint save
def test_a_writer_owned_by_another_user_counts_as_alive(tmp_path, monkeypatch):
    """os.kill raises PermissionError for a live process of another user: its .tmp must stay."""
    from selfdraft.checkpoint import _owner, _siblings, recover_interrupted_save

    final = (tmp_path / "ckpt").resolve()
    tmp, _ = _siblings(final)
    _owner(tmp).write_text(f"1 {socket.gethostname()}")
    tmp.mkdir()

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    recover_interrupted_save(final)
    assert tmp.exists()


def test_a_reader_does_not_undo_a_save_between_its_renames(tmp_path):
    """The writer has moved `final` aside (step 3) and is about to rename its .tmp into place (step
    4): a loader must wait for it, not move `.old` back (which made the writer's rename fail)."""
    from selfdraft.checkpoint import _owner, _siblings, recover_interrupted_save

    final = (tmp_path / "ckpt").resolve()
    tmp, old = _siblings(final)
    _owner(tmp).write_text(f"{os.getpid()} {socket.gethostname()}")  # a live writer: a save of this process
    tmp.mkdir()
    (tmp / "v").write_text("new")
    old.mkdir()
    (old / "v").write_text("old")
    errors: list[Exception] = []

    def writer_step_4() -> None:
        time.sleep(0.3)
        try:
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            errors.append(e)

    th = threading.Thread(target=writer_step_4)
    th.start()
    try:
        recover_interrupted_save(final)  # what every loader calls first
    finally:
        th.join()
    assert not errors and (final / "v").read_text() == "new"
