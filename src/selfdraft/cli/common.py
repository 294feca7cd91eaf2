"""What every command group shares: the options that mean the same everywhere, loading the target,
and the one mapping from errors to exit codes (`command`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Callable

import typer

from selfdraft.config import DEFAULT_GAMMA, DEFAULT_THREADS, EMBEDDED_TARGET, ConfigError
from selfdraft.errors import SelfdraftError

TargetOpt = typer.Option(None, "--target", help=f"HF model dir or .gguf file (default: embedded {EMBEDDED_TARGET})")
DtypeOpt = typer.Option("bfloat16", "--dtype", help="bfloat16 (CPU default) or float32 (exactness)")
# Commands that compute with the target on CPU for a long time (features, train): float32 is faster there.
ComputeDtypeOpt = typer.Option("float32", "--dtype", help="target dtype while computing: float32 (faster on CPU) or bfloat16")
ThreadsOpt = typer.Option(
    DEFAULT_THREADS, "--threads", help="torch CPU threads (1 is safe on a shared machine; an idle one may gain from its cores)")
GammaOpt = typer.Option(DEFAULT_GAMMA, "--gamma", help="draft tokens per round (γ)")
# None = the scheduler's own default (scheduler.Scheduler.threshold), so the number lives in one place.
ThresholdOpt = typer.Option(None, "--threshold", help="a_j threshold of the threshold scheduler "
                            "(default: the scheduler's)")
SchedulerOpt = typer.Option(
    "auto", "--scheduler", help="drafts verified per round: auto (hardware: DSpark's confidences, or the request's "
    "past acceptance for other drafters) | fixed | threshold | hardware")

# Commands that run the target (generate, demo, bench, profile, calibrate, serve): backend options
EngineDtypeOpt = typer.Option(None, "--dtype", help="bfloat16 | float32 (exactness); default: float32 on the native "
                              "backend on CPU (its fastest kernels), bfloat16 otherwise")
BackendOpt = typer.Option("auto", "--backend", help="auto (native for Llama/Mistral/Qwen2/Qwen3, else hf) | native | hf")
WeightsOpt = typer.Option("auto", "--weights", help="native weights: auto (the fastest measured on CPU; dense in --dtype "
                          "when --dtype is given, and on CUDA) | bf16 | fp32 | int8 (per row) | int4 (groups of 32; a "
                          "GGUF's Q4 blocks exactly)")
DeviceOpt = typer.Option("auto", "--device", help="auto (cuda if available) | cpu | cuda")
CompileOpt = typer.Option(False, "--compile", help="torch.compile the native backend's decode/verify steps for "
                          "blocks of 1..γ+1 tokens, up front (minutes on CPU; docs/engine.md)")


def default_of(cls: type, name: str):
    """The default of dataclass field `name`: CLI options that mirror a config field show its default, not a copy."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def command(group: typer.Typer, name: str | None = None) -> Callable[[Callable], Callable]:
    """Register a command on `group`. The one place errors become exit codes: an error the user can fix
    (SelfdraftError: config, target, data, checkpoint) exits with its `exit_code` and a one-line
    message; so does a file that cannot be read (OSError) or parsed (JSONDecodeError). Anything else is
    a bug and keeps its traceback."""

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except SelfdraftError as e:
                fail(str(e), e.exit_code)
            except (OSError, json.JSONDecodeError) as e:
                fail(str(e))

        group.command(name)(run)
        return fn

    return register


def fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(code)


def note(msg: str) -> None:
    """A progress or information line on stderr (stdout stays the command's output)."""
    print(msg, file=sys.stderr)


def warn(msg: str) -> None:
    typer.secho(f"warning: {msg}", fg="yellow", err=True)


def set_threads(threads: int) -> None:
    """Every command takes --threads with the same default (config.DEFAULT_THREADS)."""
    import torch

    if threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def check_gamma(gamma: int) -> None:
    """γ = 0 drafts nothing: plain decoding under another name. Say how to ask for that instead."""
    if gamma < 1:
        raise ConfigError(f"--gamma must be >= 1 (draft tokens per round), got {gamma}; for plain decoding use --drafter none")


def load_target(target, dtype, backend, weights, device, compile: bool = False, gamma: int = DEFAULT_GAMMA):
    """Target.load with the backend options (--backend, --weights, --dtype, --device, --compile: the
    steps of 1..γ+1 tokens)."""
    from selfdraft.target import Target

    return Target.load(target, dtype=dtype, backend=backend, weights=weights, device=device,
                       compile=gamma + 1 if compile else 0)


def make_scheduler(kind: str, threshold: float | None, cost=None):
    """A Scheduler of `kind`; --threshold only when given (else the scheduler's default)."""
    from selfdraft.scheduler import Scheduler

    return Scheduler(kind, cost=cost, **({} if threshold is None else {"threshold": threshold}))


def int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated integers, e.g. 1,8,14,20,27; got {text!r}") from None
