"""Drafter checkpoint directories (docs/architecture.md#checkpoints-and-export): save, validate, load.

A checkpoint is a directory holding
  config.json        {"format": "selfdraft-drafter", "version": 1, "method", "drafter": the method's config,
                      "target": Target.identity(), "feature_layers", "provenance"}
  model.safetensors  the drafter's own weights only (never the target's shared embedding / LM head)
and, when written by the trainer, trainer_state.pt (optimizer, schedule, RNG, data position) and
train_log.jsonl. Directories are written atomically (`atomic_dir`): a kill at any moment leaves
either the previous complete checkpoint or the new complete one, never a mix.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import time
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from selfdraft import methods
from selfdraft.config import ConfigError, DrafterConfig

if TYPE_CHECKING:
    from selfdraft.drafters.base import Drafter
    from selfdraft.target import Target

FORMAT, VERSION = "selfdraft-drafter", 1
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # optional: DraftVocab (d2t, t2d) the drafter drafts among


class CheckpointError(ConfigError):
    """A checkpoint directory is missing, corrupt or made for another target; the message says what to do."""


class DrafterModule(NamedTuple):
    """A trainable drafter module rebuilt from a checkpoint, with the config it was built from."""

    model: torch.nn.Module
    cfg: DrafterConfig


# ------------------------------------------------------------------ atomic directory writes
def _siblings(final: Path) -> tuple[Path, Path]:
    """(tmp, old): hidden siblings used while a new version of `final` is being committed."""
    return final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")


def _owner(tmp: Path) -> Path:
    """`.NAME.tmp.owner`: "pid host" of the process writing `.NAME.tmp` (written before it exists)."""
    return tmp.with_name(tmp.name + ".owner")


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that is writing `tmp` still runs (on this host); no owner file = dead."""
    try:
        pid, host = _owner(tmp).read_text().split()
        if host != socket.gethostname():
            return True  # another machine's process (shared disk): not ours to judge
        os.kill(int(pid), 0)
    except PermissionError:  # the process exists, owned by another user: alive
        return True
    except (OSError, ValueError):  # no/odd owner file, or no such process
        return False
    return True


def recover_interrupted_save(final: str | Path) -> None:
    """Finish or undo a commit that a kill interrupted (see `atomic_dir`'s steps).

    After step 3 but before step 4, `final` is missing and `.old` holds the last complete checkpoint:
    move it back. After step 4, `.old` is a leftover: delete it. A `.tmp` whose writer is gone (a
    kill during step 1, possibly hundreds of MB) is deleted; one still being written is left alone.
    """
    final = Path(final).resolve()
    tmp, old = _siblings(final)
    if tmp.exists():
        if _writer_alive(tmp):  # a save in progress: its steps 3-5 are its own, a reader must not undo them
            _wait_for_commit(final, old)
            return
        shutil.rmtree(tmp, ignore_errors=True)
        _owner(tmp).unlink(missing_ok=True)
    if old.exists():
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)  # its writer may be deleting it at the same moment
        else:
            os.replace(old, final)


def _wait_for_commit(final: Path, old: Path, timeout_s: float = 10.0) -> None:
    """A live writer between its steps 3 and 4 (`final` moved aside): wait for its rename."""
    deadline = time.monotonic() + timeout_s
    while old.exists() and not final.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield an empty temp dir to write into; on a clean exit it replaces `final` atomically.

    POSIX cannot rename onto a non-empty directory, so the commit is:
    1. write everything into `.NAME.tmp`; 2. fsync it (nothing of `final` has changed so far);
    3. rename `final` -> `.NAME.old`; 4. rename `.NAME.tmp` -> `final`; 5. delete `.NAME.old`.
    A kill between 3 and 4 leaves `final` missing and `.old` complete; `recover_interrupted_save`
    (called by every loader and by the trainer) puts it back. An exception inside the block leaves
    `final` untouched.
    """
    final = Path(final).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(final)
    tmp, old = _siblings(final)
    if tmp.exists():  # a save that was killed half-way
        shutil.rmtree(tmp)
    _owner(tmp).write_text(f"{os.getpid()} {socket.gethostname()}")
    tmp.mkdir()
    try:
        yield tmp  # 1.
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing of `final` changed; leave no half-written copy
        _owner(tmp).unlink(missing_ok=True)
        raise
    try:
        for path in [*sorted(tmp.rglob("*")), tmp]:
            _fsync(path)  # 2.
        if final.exists():
            os.replace(final, old)  # 3.
        os.replace(tmp, final)  # 4.
    except BaseException:
        _owner(tmp).unlink(missing_ok=True)  # no longer written: the next loader may finish or undo the commit
        raise
    _owner(tmp).unlink(missing_ok=True)
    _fsync(final.parent)  # make both renames durable
    shutil.rmtree(old, ignore_errors=True)  # 5. (a reader may have removed it already)


# ------------------------------------------------------------------ save
def git_commit() -> str | None:
    """The source tree's commit (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def provenance(data: str, steps: int, tokens: int, **extra) -> dict:
    """Where a checkpoint came from: command line, data, amount of training, code version, time."""
    return {
        "command": list(sys.argv),
        "data": data,
        "steps": steps,
        "tokens": tokens,
        "git_commit": git_commit(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def _check_no_target_weights(state: dict[str, torch.Tensor], target: "Target") -> None:
    """The shared embedding / LM head (any target parameter) must never end up in a checkpoint.

    Drafters receive the Target as an argument instead of registering its modules; a module that
    registers one anyway shows up here as a state tensor sharing storage with a target parameter.
    """
    target_storages = {p.untyped_storage().data_ptr() for p in target.model.parameters()}
    leaked = [k for k, t in state.items() if t.untyped_storage().data_ptr() in target_storages]
    if leaked:
        raise CheckpointError(
            f"drafter state holds target weights {leaked}: pass the Target to the module's forward "
            "instead of registering its embedding / LM head as a submodule"
        )


def write_checkpoint_files(
    dir: Path, model: torch.nn.Module, cfg: DrafterConfig, target: "Target", provenance: dict
) -> None:
    """Write config.json and model.safetensors into `dir` (not atomic by itself: see `atomic_dir`)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    _check_no_target_weights(state, target)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "method": cfg.method,
        "drafter": asdict(cfg),
        "target": target.identity(),
        "feature_layers": list(cfg.feature_layers),
        "provenance": provenance,
    }
    (dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.cpu() for k, v in state.items()}, str(dir / WEIGHTS_FILE), metadata={"format": FORMAT})


def save_checkpoint(dir: str | Path, model: torch.nn.Module, cfg: DrafterConfig, target: "Target", provenance: dict) -> Path:
    """Atomically write (or replace) the drafter checkpoint directory `dir`; returns its path."""
    if not cfg.feature_layers:
        raise CheckpointError("save a drafter config with explicit feature_layers (the trainer resolves the default)")
    with atomic_dir(dir) as tmp:
        write_checkpoint_files(tmp, model, cfg, target, provenance)
    return Path(dir).resolve()


# ------------------------------------------------------------------ load
def read_config(dir: str | Path) -> dict:
    """Parse and validate a checkpoint's config.json (after finishing any interrupted save)."""
    dir = Path(dir)
    recover_interrupted_save(dir)
    path = dir / CONFIG_FILE
    if not dir.is_dir():
        raise CheckpointError(f"{dir} is not a drafter checkpoint directory (it does not exist)")
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {dir} is not a selfdraft drafter checkpoint (train one with `selfdraft train`)")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}): retrain, or restore the directory from a copy") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} config (format={meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has version {meta.get('version')!r}; this selfdraft reads version {VERSION}")
    missing = [k for k in ("method", "drafter", "target") if k not in meta]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: the file is incomplete; retrain or restore it")
    return meta


def _describe(identity: dict) -> str:
    return (
        f"{identity.get('name')} (hidden {identity.get('hidden_size')}, vocab {identity.get('vocab_size')}, "
        f"{identity.get('num_layers')} layers, fingerprint {identity.get('fingerprint')})"
    )


def check_target(meta: dict, target: "Target", dir: str | Path) -> None:
    """Refuse a target other than the one the drafter was trained on; name both."""
    trained, given = meta["target"], target.identity()
    keys = ("hidden_size", "vocab_size", "num_layers", "fingerprint")
    diff = [k for k in keys if trained.get(k) != given[k]]
    if diff:
        raise CheckpointError(
            f"drafter {dir} was trained for target {_describe(trained)}, but the given target is "
            f"{_describe(given)} (differs in {', '.join(diff)}): load the target it was trained on, "
            "or train a drafter for this target with `selfdraft train`"
        )
    if trained.get("weights") and trained["weights"] != given.get("weights"):  # same model, other format
        print(f"note: drafter {dir} was trained on this target with {trained['weights']} weights; running it with "
              f"{given.get('weights')} weights (still lossless; acceptance may differ slightly)", file=sys.stderr)


def load_module(dir: str | Path, target: "Target", dtype: torch.dtype | None = None) -> DrafterModule:
    """Rebuild the trainable module of a checkpoint (for calibration, export, resuming training).

    The weights are cast to `dtype` (default: the target's dtype); the module is in eval mode.
    """
    dir = Path(dir)
    meta = read_config(dir)
    check_target(meta, target, dir)
    trained = methods.names(trained=True)
    if meta["method"] not in trained:
        raise CheckpointError(
            f"{dir / CONFIG_FILE}: a {meta['method']!r} drafter, which this selfdraft does not know; "
            f"known methods: {sorted(trained)}"
        )
    block = meta["drafter"] if isinstance(meta["drafter"], dict) else {}
    if block.get("method", meta["method"]) != meta["method"]:  # a hand-edited or mixed-up file: which would the weights fit?
        raise CheckpointError(f"{dir / CONFIG_FILE}: its method {meta['method']!r} and its drafter block's method "
                              f"{block['method']!r} disagree; fix the file or retrain")
    try:  # `legacy`: checkpoints written before each method had its own config hold every method's fields
        cfg = methods.drafter_config({**meta["drafter"], "method": meta["method"]}, legacy=True)
    except (ConfigError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{dir / CONFIG_FILE}: invalid drafter config: {e}") from e
    weights = dir / WEIGHTS_FILE
    if not weights.exists():
        raise CheckpointError(f"{weights} is missing: the checkpoint is incomplete; retrain or restore it")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{weights} is corrupt or truncated ({e}): retrain, or restore it from a copy") from e
    model = methods.get(cfg.method).build(cfg, target)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{weights} does not match the {cfg.method} module its config.json describes: {e}") from e
    model = model.to(dtype or target.model.dtype).eval()
    return DrafterModule(model, cfg)


def load_checkpoint(dir: str | Path, target: "Target") -> "Drafter":
    """A trained drafter directory (this format) -> an inference `Drafter` for `target` (which must be
    its target). `selfdraft.loader.load_drafter` also takes registry names and speculators directories."""
    from selfdraft.vocab import DraftVocab

    model, cfg = load_module(dir, target)
    drafter = methods.get(cfg.method).wrap(model, cfg, target)
    vocab = Path(dir) / DRAFT_VOCAB_FILE
    if vocab.exists():  # optional: draft among the most frequent answer tokens only (DFlash / DSpark)
        try:
            drafter.restrict_vocab(DraftVocab.load(vocab).target_ids)
        except (SafetensorError, OSError, KeyError, ConfigError) as e:
            raise CheckpointError(f"{vocab}: unusable draft vocabulary ({e}); delete it to draft over the full vocabulary") from e
    return drafter
