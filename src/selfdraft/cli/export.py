"""`selfdraft export`: a trained drafter as a speculators checkpoint for vLLM (docs/architecture.md#checkpoints-and-export)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import DtypeOpt, TargetOpt, command
from selfdraft.config import ConfigError


def register(app: typer.Typer) -> None:
    command(app, "export")(export_cmd)


def export_cmd(
    src: Path = typer.Argument(..., help="selfdraft drafter checkpoint directory (from `selfdraft train`)"),
    out: Path = typer.Argument(..., help="output directory (written atomically)"),
    fmt: str = typer.Option("speculators", "--format", help="speculators (what vLLM's speculative decoding loads)"),
    target: Optional[str] = TargetOpt,
    verifier: Optional[str] = typer.Option(
        None, "--verifier", help="the verifier as you will serve it: hub id or local model dir (default: the target's hub id)"
    ),
    dtype: str = DtypeOpt,
) -> None:
    """Export a trained drafter as a speculators checkpoint (config.json + model.safetensors) for vLLM."""
    from selfdraft.export import export_speculators
    from selfdraft.target import Target

    if fmt != "speculators":
        raise ConfigError(f"--format {fmt!r}: the only export format is 'speculators'")
    tgt = Target.load(target, dtype=dtype)
    rep = export_speculators(src, out, tgt, verifier=verifier)
    files = ", ".join(f"{name} ({size / 1e6:.1f} MB)" for name, size in rep.files.items())
    print(f"-> {rep.path}: {files}\nserve it: vllm serve {rep.verifier} --speculative-config "
          f"'{{\"model\": \"{rep.path}\", \"method\": \"{rep.method}\", "
          f"\"num_speculative_tokens\": {rep.speculative_tokens}}}'\nor here: selfdraft generate --drafter {rep.path} -p '...'",
          file=sys.stderr)  # fmt: skip
