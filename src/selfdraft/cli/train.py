"""`selfdraft train`: the generic training loop (docs/training.md).

Its options are generated from the fields of `DrafterConfig` and `TrainConfig`: a new config field is
a new option, with the config's default shown, and no value is copied by hand between the two. The
tables below only name the options whose spelling is not `--field-name` and give their help.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import ComputeDtypeOpt, TargetOpt, ThreadsOpt, command, int_list, set_threads, warn
from selfdraft.config import ConfigError, DrafterConfig, TrainConfig, from_dict

# field -> (option declarations or None for `--field-name`, help). Fields without an entry get both by default.
DRAFTER_OPTIONS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "method": (("--method", "-m"), "dflash | dspark | eagle3 | mtp"),
    "gamma": (None, "block size γ (draft tokens per round)"),
    "num_layers": (("--layers",), "draft decoder layers"),
    "feature_layers": (None, "target layers, e.g. 1,8,14,20,27 (default: the method's)"),
    "qk_norm": (None, "per-head q/k RMSNorm (the layout vLLM builds)"),
    "anchor_as_first": (("--anchor-as-first/--anchor-plus-masks",), "DSpark / DFlash block layout"),
    "loss_decay": (None, "position weight exp(-(k-1)/decay)"),
    "init_from_target": (("--init-from-target/--random-init",), "DFlash/DSpark: start from the target's last layers"),
    "mask_token_id": (None, "DFlash/DSpark: mask slots use this target embedding row (-1 = learned)"),
    "loss_vocab_size": (None, "DFlash/DSpark: train and draft over the N most frequent answer tokens (0 = all)"),
    "markov_rank": (None, "Markov head rank r (0 = off)"),
    "markov_head": (None, "vanilla | gated | rnn"),
    "w_ce": (None, "cross-entropy loss weight"),
    "w_tv": (None, "total-variation loss weight"),
    "w_conf": (None, "confidence (BCE) loss weight"),
    "draft_vocab_size": (None, "EAGLE-3 draft vocab (0 = full)"),
    "ttt_decay": (None, "EAGLE-3: training-time-test step j weighs ttt_decay^j"),
    "tree_depth": (None, "EAGLE-3: dynamic draft tree depth at inference (0 = chain)"),
    "tree_top_k": (None, "EAGLE-3 tree: children per frontier node"),
    "tree_total_tokens": (None, "EAGLE-3 tree: nodes verified per round, anchor included"),
    "mtp_modules": (None, "MTP: D stacked modules"),
    "mtp_recursive": (("--mtp-recursive/--mtp-stacked",), "MTP: reuse the last module up to γ"),
    "mtp_normed_handoff": (None, "MTP: depth d+1 reads the final-normed h^d (speculators' layout)"),
    "mtp_decay": (None, "MTP: depth d weighs mtp_decay^(d-1)"),
}
TRAIN_OPTIONS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "data": (None, "regenerated dataset directory"),
    "features": (None, "online (target runs during training) or a feature-cache directory"),
    "steps": (None, "optimizer steps (the schedule's length)"),
    "token_budget": (None, "stop after N sequence tokens (0 = off)"),
    "batch_size": (("--batch-size", "-b"), "sequences per micro-batch, all ranks together (torchrun splits it)"),
    "grad_clip": (None, "0 = off"),
    "bf16": (None, "bf16 autocast (default off: fp32 is faster on CPUs without bf16 units)"),
    "val_every": (None, "0 = only at the end"),
    "save_every": (None, "0 = only at the end"),
    "fsdp": (("--fsdp/--ddp",), "under torchrun: shard the drafter (FSDP) or replicate it (DDP, default)"),
}
# TYPES maps a field's annotation (a string: config.py uses postponed annotations) to the option's type;
# tuples of ints are given as comma lists.
TYPES = {"int": int, "float": float, "bool": bool, "str": str, "tuple[int, ...]": str}


def config_options(cls: type, table: dict) -> list[inspect.Parameter]:
    """One keyword parameter per field of `cls`, defaulting to None (= not given: the config's default)."""
    unknown = set(table) - {f.name for f in dataclasses.fields(cls)}
    assert not unknown, f"options for fields {cls.__name__} does not have: {sorted(unknown)}"
    params = []
    for f in dataclasses.fields(cls):
        decls, help = table.get(f.name, (None, ""))
        typ = TYPES[f.type]
        if decls is None:
            flag = "--" + f.name.replace("_", "-")
            decls = (f"{flag}/--no-{flag[2:]}",) if typ is bool else (flag,)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        option = typer.Option(None, *decls, help=help, show_default=shown if shown else False)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=Optional[typ]))
    return params


def _config_arg(text: str | None) -> dict:
    """--config: a JSON file path, or the JSON object itself (`--config '{"drafter": {"qk_norm": true}}'`)."""
    if not text:
        return {}
    inline = text.lstrip().startswith("{")
    try:
        data = json.loads(text if inline else Path(text).read_text())
    except OSError as e:
        raise ConfigError(f"--config {text}: cannot read it ({e.strerror}); give a JSON file or an inline JSON object") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {'(inline)' if inline else text}: invalid JSON ({e})") from None
    if not isinstance(data, dict) or set(data) - {"drafter", "train"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--config: expected an object with keys 'drafter' and/or 'train', got {keys}")
    return data


def train_configs(config: str | None, drafter_opts: dict, train_opts: dict) -> tuple[DrafterConfig, TrainConfig]:
    """--config {"drafter": {...}, "train": {...}} (a file or inline JSON) overlaid with the options actually given.

    Unknown keys raise (config.from_dict), in the file as on the command line.
    """
    file = _config_arg(config)
    given = lambda opts: {k: v for k, v in opts.items() if v is not None}  # noqa: E731
    dcfg = from_dict(DrafterConfig, {**file.get("drafter", {}), **given(drafter_opts)})
    tcfg = from_dict(TrainConfig, {**file.get("train", {}), **given(train_opts)})
    if not tcfg.data:
        raise ConfigError("no training data: pass --data DIR (from `selfdraft data regenerate`) or set train.data in --config")
    return dcfg, tcfg


def train_cmd(
    out: Path, target: Optional[str], config: Optional[str], resume: bool, final_only: bool, threads: int, dtype: str,
    **fields,
) -> None:
    """Train a self-drafter on the target's own answers; the checkpoint loads with `--drafter OUT`."""
    from selfdraft.target import Target
    from selfdraft.training.records import iter_records
    from selfdraft.training.trainer import STATE_FILE, strategy_for
    from selfdraft.training.trainer import train as run_training

    set_threads(threads)
    if fields["feature_layers"] is not None:
        fields["feature_layers"] = int_list(fields["feature_layers"], "--feature-layers")
    dcfg, tcfg = train_configs(config, {f.name: fields[f.name] for f in dataclasses.fields(DrafterConfig)},
                               {f.name: fields[f.name] for f in dataclasses.fields(TrainConfig)})
    strategy_for(dcfg.method)  # fail on an unknown method before loading the target
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0 and not any(True for _ in iter_records(tcfg.data, "val")):
        warn(f"{tcfg.data} has no validation conversations (split val): training runs without a val loss; "
             "regenerate with a larger --limit or --val-fraction to have one")
    tgt = Target.load(target, dtype=dtype)
    res = run_training(tgt, dcfg, tcfg, out, resume=resume)
    if not rank0:
        return  # torchrun: rank 0 reports (train() returns once every rank is done and the checkpoint written)
    state = res.out_dir / STATE_FILE
    if final_only and state.exists():
        state.unlink()
    val = f", val loss {res.final_val.loss:.4f}" if res.final_val else ""
    print(f"{dcfg.method}: {res.steps} steps, {res.tokens} tokens (stopped by {res.stopped_by}){val}, "
          f"{res.elapsed_s:.0f}s -> {res.out_dir} ({checkpoint_sizes(res.out_dir)})\n"
          f"use it: selfdraft generate --drafter {res.out_dir} -p '...'", file=sys.stderr)


def _train_signature() -> inspect.Signature:
    """train_cmd's own options, then one per config field (typer reads options from the signature)."""
    P = inspect.Parameter
    own = [
        P("out", P.KEYWORD_ONLY, annotation=Path,
          default=typer.Option(..., "--out", "-o", help="checkpoint directory (then: --drafter OUT)")),
        P("target", P.KEYWORD_ONLY, annotation=Optional[str], default=TargetOpt),
        P("config", P.KEYWORD_ONLY, annotation=Optional[str], default=typer.Option(
            None, "--config", help='JSON file or inline JSON {"drafter": {...}, "train": {...}}; options override it')),
    ]
    rest = [
        P("resume", P.KEYWORD_ONLY, annotation=bool,
          default=typer.Option(True, "--resume/--no-resume", help="continue the run saved in --out")),
        P("final_only", P.KEYWORD_ONLY, annotation=bool, default=typer.Option(
            False, "--final-only", help="when the run finishes, delete trainer_state.pt (optimizer state, 2x the weights): "
            "keeps only the drafter; the run can no longer be resumed or extended")),
        P("threads", P.KEYWORD_ONLY, annotation=int, default=ThreadsOpt),
        P("dtype", P.KEYWORD_ONLY, annotation=str, default=ComputeDtypeOpt),
    ]
    params = own + config_options(DrafterConfig, DRAFTER_OPTIONS) + config_options(TrainConfig, TRAIN_OPTIONS) + rest
    names = [p.name for p in params]
    assert len(names) == len(set(names)), f"a config field clashes with another train option: {names}"
    return inspect.Signature(params, return_annotation=None)


train_cmd.__signature__ = _train_signature()
train_cmd.__annotations__ = {p.name: p.annotation for p in train_cmd.__signature__.parameters.values()}


def checkpoint_sizes(out: Path) -> str:
    """'model.safetensors 46.1 MB, trainer_state.pt 92.3 MB (resume only; --final-only drops it)'."""
    from selfdraft.checkpoint import WEIGHTS_FILE
    from selfdraft.training.trainer import STATE_FILE

    parts = [f"{WEIGHTS_FILE} {(out / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB"]
    if (out / STATE_FILE).exists():
        parts.append(f"{STATE_FILE} {(out / STATE_FILE).stat().st_size / 1e6:.1f} MB (resume only; --final-only drops it)")
    return ", ".join(parts)


def register(app: typer.Typer) -> None:
    command(app, "train")(train_cmd)
