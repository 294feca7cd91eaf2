"""`selfdraft serve`: the OpenAI-compatible HTTP server on the batched engine (docs/engine.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import (
    GammaOpt,
    SchedulerOpt,
    TargetOptions,
    ThresholdOpt,
    check_gamma,
    command,
    note,
    with_suffix_options,
    with_target_options,
)
from selfdraft.config import DEFAULT_PREFILL_CHUNK, ConfigError


def register(app: typer.Typer) -> None:
    command(app, "serve")(serve_cmd)


@with_target_options(compile=False)
@with_suffix_options
def serve_cmd(
    target_options: TargetOptions,
    suffix,
    drafter: str = typer.Option("ngram", "--drafter", "-d", help="none | ngram | suffix | suffix+tree | a checkpoint dir | "
                                "hybrid[+RULE]:DIR; suffix drafters share one global tree over the served responses"),
    scheduler: str = SchedulerOpt,
    threshold: Optional[float] = ThresholdOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (loopback by default)"),
    port: int = typer.Option(8000, "--port"),
    max_concurrency: int = typer.Option(16, "--max-concurrency", help="requests in flight (running + queued); more get 429"),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="requests decoded together (default: --max-concurrency)"),
    prefill_chunk: int = typer.Option(DEFAULT_PREFILL_CHUNK, "--prefill-chunk",
                                      help="prompt tokens per row in one prefill forward (joining requests are prefilled together; longer prompts chunk by chunk)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SELFDRAFT_API_KEY", help="require 'Authorization: Bearer KEY'"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the `model` clients send (default: the target's name)"),
    gamma: int = GammaOpt,
    shutdown_grace: float = typer.Option(10.0, "--shutdown-grace", help="seconds in-flight requests get to finish on SIGINT/SIGTERM"),
    max_body_size: int = typer.Option(1 << 20, "--max-body-size", help="largest request body in bytes (larger: 413)"),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, streaming) on the batched speculative engine."""
    from selfdraft.engine import drafter_factory
    from selfdraft.profile import scheduler_for
    from selfdraft.serve import EngineLoop, ServerMetrics, create_app, run_server

    if max_concurrency < 1 or (max_batch is not None and max_batch < 1) or max_body_size < 1 or prefill_chunk < 1:
        raise ConfigError("--max-concurrency, --max-batch, --prefill-chunk and --max-body-size must be >= 1")
    check_gamma(gamma)
    tgt = target_options.load()
    make = drafter_factory(drafter, tgt, suffix=suffix)
    batch = max_batch or max_concurrency
    sched = scheduler_for(scheduler, tgt, make(), gamma, threshold, log=note, batch_tokens=min(128, batch * (gamma + 1)))
    name = model_name or Path(tgt.name).name
    runner = EngineLoop(tgt, make, make().name, sched, batch, max_concurrency,
                        ServerMetrics(gamma), prefill_chunk)
    print(f"serving {name!r} with drafter {runner.drafter_name} ({drafter}), scheduler {sched.kind if sched else 'fixed'}, on "
          f"http://{host}:{port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr)
    run_server(create_app(runner, name, api_key, gamma=gamma, shutdown_grace_s=shutdown_grace,
                          max_body_bytes=max_body_size), host, port, shutdown_grace, log_level)
