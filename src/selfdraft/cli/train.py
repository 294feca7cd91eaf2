"""`selfdraft train`: the generic training loop (docs/training.md).

Its options are generated from the fields of every method's config (selfdraft.methods) and of
`TrainConfig`: a new config field is a new option, with the config's default shown, and no value is
copied by hand between the two. A method's own option says whose it is in its help; giving one with
another --method is an error. The drafter options' help and spelling live in the config fields
(config.knob); the table below does the same for TrainConfig.
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

from selfdraft import methods
from selfdraft.cli.common import ComputeDtypeOpt, DeviceOpt, TargetOpt, ThreadsOpt, command, int_list, set_threads, warn
from selfdraft.config import ConfigError, DrafterConfig, TrainConfig, from_dict

# field -> (option declarations or None for `--field-name`, help). Fields without an entry get both by default.
# The drafter options come from the method configs' own field metadata (config.knob) instead.
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
    "init_from": (None, "warm start a fresh run from this checkpoint's drafter weights (same method and shapes, or more "
                        "--layers: new layers start as the identity; "
                        "new schedule and optimizer; the loss vocabulary comes from --data)"),
    "new_lr": (None, "learning rate of the parameters a warm start adds (grown layers, W_s, W_e), on the same "
                     "schedule (0 = --lr)"),
}
# TYPES maps a field's annotation (a string: config.py uses postponed annotations) to the option's type;
# tuples of ints are given as comma lists.
TYPES = {"int": int, "float": float, "bool": bool, "str": str, "tuple[int, ...]": str}


def drafter_fields() -> list[tuple[dataclasses.Field, list[str]]]:
    """The union of every trained method's config fields, each once: the shared ones (DrafterConfig)
    first, then each method's own, with the methods that have it."""
    fields = {f.name: f for f in dataclasses.fields(DrafterConfig)}
    shared, owners = set(fields), {}
    for name in methods.names(trained=True):
        for f in dataclasses.fields(methods.get(name).config):
            if f.name not in shared:
                fields.setdefault(f.name, f)
                owners.setdefault(f.name, []).append(name)
    return [(f, owners.get(f.name, [])) for f in fields.values()]


def drafter_table() -> dict[str, tuple]:
    """The drafter options' spelling and help, from the config fields' metadata; a method's own
    option says whose it is, and a field methods share with different defaults shows each one."""
    table = {}
    for f, owners in drafter_fields():
        help = f.metadata.get("help", "")
        if f.name == "method":
            help = " | ".join(methods.names(trained=True))
        by_default: dict[str, list[str]] = {}
        for m in owners:
            d = next(g.default for g in dataclasses.fields(methods.get(m).config) if g.name == f.name)
            by_default.setdefault(str(d), []).append(m)
        shown = (", ".join(f"{'/'.join(ms)} {d}" for d, ms in by_default.items()),) if len(by_default) > 1 else ()
        table[f.name] = (f.metadata.get("flags") or None, f"{'/'.join(owners)}: {help}" if owners else help, *shown)
    return table


def config_options(fields: list[dataclasses.Field], table: dict) -> list[inspect.Parameter]:
    """One keyword parameter per field, defaulting to None (= not given: the config's default)."""
    unknown = set(table) - {f.name for f in fields}
    assert not unknown, f"options for fields the configs do not have: {sorted(unknown)}"
    params = []
    for f in fields:
        decls, help, *shown = table.get(f.name, (None, ""))
        typ = TYPES[f.type]
        if decls is None:
            flag = "--" + f.name.replace("_", "-")
            decls = (f"{flag}/--no-{flag[2:]}",) if typ is bool else (flag,)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = shown[0] if shown else ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
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

    Unknown keys raise (config.from_dict), in the file as on the command line, and so do options of
    another method than --method (methods.drafter_config).
    """
    file = _config_arg(config)
    given = lambda opts: {k: v for k, v in opts.items() if v is not None}  # noqa: E731
    dcfg = methods.drafter_config({**file.get("drafter", {}), **given(drafter_opts)})
    tcfg = from_dict(TrainConfig, {**file.get("train", {}), **given(train_opts)})
    if not tcfg.data:
        raise ConfigError("no training data: pass --data DIR (from `selfdraft data regenerate`) or set train.data in --config")
    return dcfg, tcfg


def train_cmd(
    out: Path, target: Optional[str], config: Optional[str], resume: bool, final_only: bool, threads: int, dtype: str,
    device: str, **fields,
) -> None:
    """Train a self-drafter on the target's own answers; the checkpoint loads with `--drafter OUT`."""
    from selfdraft.target import Target
    from selfdraft.target_loading import resolve_device
    from selfdraft.training.records import iter_records
    from selfdraft.training.checkpointing import STATE_FILE
    from selfdraft.training.distributed import bind_local_gpu
    from selfdraft.training.trainer import strategy_for
    from selfdraft.training.trainer import train as run_training

    set_threads(threads)
    device = resolve_device(device)  # a GPU asked for on a machine without one fails here, in one line
    if fields["feature_layers"] is not None:
        fields["feature_layers"] = int_list(fields["feature_layers"], "--feature-layers")
    dcfg, tcfg = train_configs(config, {f.name: fields[f.name] for f, _ in drafter_fields()},
                               {f.name: fields[f.name] for f in dataclasses.fields(TrainConfig)})
    strategy_for(dcfg.method)  # fail on an unknown method before loading the target
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0 and not any(True for _ in iter_records(tcfg.data, "val")):
        warn(f"{tcfg.data} has no validation conversations (split val): training runs without a val loss; "
             "regenerate with a larger --limit or --val-fraction to have one")
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        bind_local_gpu()  # torchrun: each rank's target (and drafter) on its own GPU, cuda:LOCAL_RANK
    tgt = Target.load(target, dtype=dtype, device=device)
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
        P("device", P.KEYWORD_ONLY, annotation=str, default=DeviceOpt),
    ]
    params = (own + config_options([f for f, _ in drafter_fields()], drafter_table())
              + config_options(list(dataclasses.fields(TrainConfig)), TRAIN_OPTIONS) + rest)
    names = [p.name for p in params]
    assert len(names) == len(set(names)), f"a config field clashes with another train option: {names}"
    return inspect.Signature(params, return_annotation=None)


train_cmd.__signature__ = _train_signature()
train_cmd.__annotations__ = {p.name: p.annotation for p in train_cmd.__signature__.parameters.values()}


def checkpoint_sizes(out: Path) -> str:
    """'model.safetensors 46.1 MB, trainer_state.pt 92.3 MB (resume only; --final-only drops it)'."""
    from selfdraft.checkpoint import WEIGHTS_FILE
    from selfdraft.training.checkpointing import STATE_FILE

    parts = [f"{WEIGHTS_FILE} {(out / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB"]
    if (out / STATE_FILE).exists():
        parts.append(f"{STATE_FILE} {(out / STATE_FILE).stat().st_size / 1e6:.1f} MB (resume only; --final-only drops it)")
    return ", ".join(parts)


def register(app: typer.Typer) -> None:
    command(app, "train")(train_cmd)
