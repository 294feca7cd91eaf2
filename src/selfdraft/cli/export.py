"""`selfdraft export`: a trained drafter for another runtime: a speculators checkpoint for vLLM, or a GGUF
drafter for llama.cpp (docs/architecture.md#checkpoints-and-export, docs/llamacpp.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import DtypeOpt, TargetOpt, ThreadsOpt, command, set_threads
from selfdraft.config import ConfigError

FORMATS = ("speculators", "gguf")


def register(app: typer.Typer) -> None:
    command(app, "export")(export_cmd)


def export_cmd(
    src: Path = typer.Argument(..., help="selfdraft drafter checkpoint directory (from `selfdraft train`)"),
    out: Path = typer.Argument(..., help="output: a directory (speculators) or a .gguf file (gguf); written atomically"),
    fmt: str = typer.Option("speculators", "--format", help="speculators (what vLLM loads) | gguf (what llama.cpp's -md loads)"),
    target: Optional[str] = TargetOpt,
    verifier: Optional[str] = typer.Option(
        None, "--verifier", help="speculators: the verifier as you will serve it: hub id or local model dir (default: the target's hub id)"
    ),
    target_gguf: Optional[Path] = typer.Option(
        None, "--target-gguf", help="gguf: the target's GGUF as llama.cpp serves it (its vocabulary is copied; default: the GGUF the target was loaded from)"
    ),
    gguf_type: str = typer.Option("f16", "--gguf-type", help="gguf: matrices in f16 | bf16 | f32 (norms stay f32)"),
    recommend: bool = typer.Option(
        True, "--recommend/--no-recommend",
        help="gguf, DSpark: time llama.cpp here and print the --spec-draft-p-min / -n-max with the most expected tokens/s "
             "(needs llama.cpp and a calibrated drafter; written beside OUT as .settings.json/.md)",
    ),
    threads: int = ThreadsOpt,
    dtype: str = DtypeOpt,
) -> None:
    """Export a trained drafter: a speculators checkpoint for vLLM, or a GGUF drafter for llama.cpp."""
    from selfdraft.target import Target

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    set_threads(threads)  # also the llama.cpp threads that --recommend times
    tgt = Target.load(target, dtype=dtype)
    if fmt == "gguf":
        from selfdraft.llamacpp.export import export_gguf

        rep = export_gguf(src, out, tgt, target_gguf=target_gguf, out_type=gguf_type)
        print(f"-> {rep.path} ({rep.bytes / 1e6:.1f} MB, llama.cpp arch {rep.arch!r}, {len(rep.tensors)} tensors)\n"
              f"serve it: {rep.server_command()}", file=sys.stderr)  # fmt: skip
        not_carried(src, "llama.cpp")
        if recommend and rep.method == "dspark":
            from selfdraft.llamacpp.settings import recommend_for

            rec = recommend_for(src, rep, tgt, threads)
            if rec is not None:
                print(f"recommended on this machine: {rep.server_command(rec.best.p_min, rec.best.n_max)}", file=sys.stderr)
        return
    from selfdraft.export import export_speculators

    rep = export_speculators(src, out, tgt, verifier=verifier)
    files = ", ".join(f"{name} ({size / 1e6:.1f} MB)" for name, size in rep.files.items())
    print(f"-> {rep.path}: {files}\nserve it: vllm serve {rep.verifier} --speculative-config "
          f"'{{\"model\": \"{rep.path}\", \"method\": \"{rep.method}\", "
          f"\"num_speculative_tokens\": {rep.speculative_tokens}}}'\nor here: selfdraft generate --drafter {rep.path} -p '...'",
          file=sys.stderr)  # fmt: skip
    not_carried(src, "vLLM")


def not_carried(src: str, engine: str) -> None:
    """Say which of the source's inference-only options the export leaves behind (the engine lacks them)."""
    from selfdraft.checkpoint import read_config

    beta = read_config(src).get("drafter", {}).get("copy_bias", 0)
    if beta:
        print(f"note: the copy bias (copy_bias {beta:g}) is an option of selfdraft's engine and is not exported: {engine} "
              f"drafts without it (docs/methods/dspark.md#the-copy-bias)", file=sys.stderr)
