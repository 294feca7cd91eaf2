"""`selfdraft calibrate`: Sequential Temperature Scaling of a DSpark checkpoint's confidences
(docs/calibration.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import (
    TargetOptions,
    command,
    default_of,
    warn,
    with_target_options,
)
from selfdraft.config import ConfigError, SamplingParams


def register(app: typer.Typer) -> None:
    command(app, "calibrate")(calibrate_cmd)


@with_target_options(compile=False)
def calibrate_cmd(
    target_options: TargetOptions,
    drafter: Path = typer.Option(..., "--drafter", "-d", help="DSpark checkpoint dir (updated in place, atomically)"),
    data: Optional[Path] = typer.Option(None, "--data", help="regenerated dataset dir: prompts of its --split"),
    split: str = typer.Option("val", "--split", help="dataset split used with --data"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="or: a JSONL of {\"turns\": [...]} lines"),
    num_prompts: int = typer.Option(64, "--num-prompts", help="first N prompts"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="tokens decoded per prompt"),
    temperature: float = typer.Option(default_of(SamplingParams, "temperature"), "--temperature", "-t", help="0 = greedy acceptance; > 0 = chain rule"),
    top_p: float = typer.Option(default_of(SamplingParams, "top_p"), "--top-p"),
    top_k: int = typer.Option(default_of(SamplingParams, "top_k"), "--top-k", help="0 = off"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Fit T_k (Sequential Temperature Scaling) on held-out rounds; store them in the checkpoint with
    calibration.json and a reliability diagram per position (ECE and ROC-AUC before/after)."""
    from selfdraft.bench import load_prompt_set
    from selfdraft.training.calibrate import calibrate_checkpoint
    from selfdraft.training.records import iter_records

    if (data is None) == (prompts is None):
        raise ConfigError("give exactly one of --data DIR (held-out split) or --prompts FILE.jsonl")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    tgt = target_options.load()
    if data is not None:
        recs = (r for r in iter_records(data, split) if 1 in r["loss_mask"])
        ids = [r["input_ids"][: r["loss_mask"].index(1)] for r, _ in zip(recs, range(num_prompts))]
        if not ids:
            raise ConfigError(f"{data} has no {split!r} conversations to calibrate on (the {split} split is empty): "
                              f"regenerate with a larger --limit or --val-fraction, or pass --split train")
    else:
        ids = load_prompt_set(prompts, num_prompts).encode(tgt)
    reports = calibrate_checkpoint(drafter, tgt, ids, params, max_new_tokens, seed)
    print(f"{'k':>2} {'T_k':>6} {'rounds':>6} {'reached':>7} {'accept':>6} {'ECE before':>10} {'ECE after':>9} "
          f"{'AUC before':>10} {'AUC after':>9}")
    for r in reports:
        print(f"{r.k:>2} {r.temperature:>6.3f} {r.rounds_reached:>6} {r.reached:>7.3f} {r.acceptance:>6.3f} "
              f"{r.ece_before:>10.4f} {r.ece_after:>9.4f} {r.auc_before:>10.4f} {r.auc_after:>9.4f}"
              + (f"  {r.note}" if r.note else ""))
    unfit = [r.k for r in reports if r.note]
    if unfit:
        warn(f"{len(unfit)} of {len(reports)} positions ({', '.join(map(str, unfit))}) had too few rounds or one class "
              f"to fit T_k or score the AUC (nan): calibrate on more prompts (--num-prompts; {len(ids)} used) "
              f"or longer answers (--max-new-tokens)")
    print(f"-> {drafter}/calibration.json, {drafter}/calibration/reliability_k*.png", file=sys.stderr)
