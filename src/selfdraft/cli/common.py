"""What every command group shares: the options that mean the same everywhere, loading the target,
and the one mapping from errors to exit codes (`command`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

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
WeightsOpt = typer.Option("auto", "--weights", help="native weights: auto (fp16 on x86 CPUs, the fastest measured; dense "
                          "in --dtype when --dtype is given, and on CUDA) | fp32 | bf16 | fp16 (FBGEMM, CPU) | int8 "
                          "(per row) | int4 (groups of 32; a GGUF's Q4 blocks exactly)")
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


# The shipped drafters, in a repository checkout (an editable install); absent from a wheel.
SHIPPED = Path(__file__).resolve().parents[3] / "checkpoints"
DrafterOpt = typer.Option(
    "auto", "--drafter", "-d", help="auto (the embedded target: hybrid drafting over the shipped DSpark, the fastest on the "
    "bundled bench; another target: ngram) | none | ngram | suffix | suffix+tree | a checkpoint dir | hybrid[+RULE]:DIR "
    "(suffix + a trained drafter, docs/methods/hybrid.md) | tree:DIR")


def resolve_drafter(drafter: str, options: "TargetOptions") -> str:
    """`auto` -> the drafter to run: on the embedded target the fastest on the bundled bench with the machine's
    own costs (BENCHMARKS.md#which-drafter), suffix trees or the shipped DSpark chosen per round; else
    training-free ngram (no trained drafter fits another target)."""
    if drafter != "auto":
        return drafter
    dspark = SHIPPED / "dspark"
    return f"hybrid:{dspark}" if options.target is None and dspark.is_dir() else "ngram"


@dataclass(frozen=True)
class TargetOptions:
    """How a command runs the target: --target, --threads, --dtype, --backend, --weights, --device and
    (where offered) --compile; `with_target_options` declares them once for every such command."""

    target: Optional[str] = None
    threads: int = DEFAULT_THREADS
    dtype: Optional[str] = None
    backend: str = "auto"
    weights: str = "auto"
    device: str = "auto"
    compile: bool = False

    def load(self, gamma: int = DEFAULT_GAMMA):
        """Set the torch threads, then Target.load (--compile: the steps of 1..γ+1 tokens)."""
        from selfdraft.target import Target

        set_threads(self.threads)
        return Target.load(self.target, dtype=self.dtype, backend=self.backend, weights=self.weights,
                           device=self.device, compile=gamma + 1 if self.compile else 0)


TARGET_OPTIONS = {"target": (Optional[str], TargetOpt), "threads": (int, ThreadsOpt), "dtype": (Optional[str], EngineDtypeOpt),
                  "backend": (str, BackendOpt), "weights": (str, WeightsOpt), "device": (str, DeviceOpt)}


def with_target_options(compile: bool = False) -> Callable[[Callable], Callable]:
    """A command's `target_options: TargetOptions` parameter becomes the target options (and --compile
    if asked) in its CLI signature; the command receives them as one TargetOptions."""
    options = {**TARGET_OPTIONS, **({"compile": (bool, CompileOpt)} if compile else {})}

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "target_options"]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
                   for n, (ann, opt) in options.items()]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            return fn(*args, target_options=TargetOptions(**{n: kwargs.pop(n) for n in options}), **kwargs)

        run.__signature__ = sig.replace(parameters=params)  # what Typer reads
        return run

    return deco


def with_suffix_options(fn: Callable) -> Callable:
    """A command's `suffix: SuffixConfig` parameter becomes one --suffix-FIELD option per SuffixConfig
    field (its default shown): the knobs of the `suffix` and `hybrid:DIR` drafters."""
    from selfdraft.methods.suffix.config import SuffixConfig

    fields = [f for f in dataclasses.fields(SuffixConfig) if f.name != "tree"]  # tree: the suffix+tree drafter
    types = {"int": int, "float": float}
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "suffix"]
    params += [inspect.Parameter(f"suffix_{f.name}", inspect.Parameter.KEYWORD_ONLY, annotation=types[f.type],
                                 default=typer.Option(f.default, f"--suffix-{f.name.replace('_', '-')}",
                                                      help=f"suffix / hybrid drafters: {f.name} (docs/methods/suffix.md)"))
               for f in fields]

    @functools.wraps(fn)
    def run(*args, **kwargs):
        cfg = SuffixConfig(**{f.name: kwargs.pop(f"suffix_{f.name}") for f in fields})
        return fn(*args, suffix=cfg, **kwargs)

    run.__signature__ = sig.replace(parameters=params)
    return run


def make_scheduler(kind: str, threshold: float | None, cost=None):
    """A Scheduler of `kind`; --threshold only when given (else the scheduler's default)."""
    from selfdraft.scheduler import Scheduler

    return Scheduler(kind, cost=cost, **({} if threshold is None else {"threshold": threshold}))


def int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated integers, e.g. 1,8,14,20,27; got {text!r}") from None
