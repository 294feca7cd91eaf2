"""`selfdraft serve`: the OpenAI-compatible HTTP server on the batched engine (docs/serve/README.md)."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import (
    DrafterOpt,
    GammaOpt,
    SchedulerOpt,
    TargetOptions,
    ThresholdOpt,
    check_gamma,
    command,
    note,
    resolve_drafter,
    with_suffix_options,
    with_target_options,
)
from selfdraft.config import DEFAULT_PREFILL_CHUNK, ConfigError

API_KEY_ENV = "SELFDRAFT_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
KV_MEMORY_SHARE = 0.25  # --max-kv-tokens 0: the padded KV cache may take this share of the memory free at start


def register(app: typer.Typer) -> None:
    command(app, "serve")(serve_cmd)


@with_target_options(compile=False)
@with_suffix_options
def serve_cmd(
    target_options: TargetOptions,
    suffix,
    drafter: str = DrafterOpt,  # suffix drafters share one global tree over the served responses
    scheduler: str = SchedulerOpt,
    threshold: Optional[float] = ThresholdOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (loopback by default; another one warns without an API key)"),
    port: int = typer.Option(8000, "--port"),
    max_concurrency: int = typer.Option(16, "--max-concurrency", help="requests in flight (being tokenized + queued + running); more get 429"),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="requests decoded together (default: --max-concurrency)"),
    max_kv_tokens: int = typer.Option(0, "--max-kv-tokens", help="padded KV-cache tokens the batch may reach (rows x the longest "
                                      "prompt + max_tokens); requests wait beyond it. 0: a quarter of the memory free at start"),
    prefill_chunk: int = typer.Option(DEFAULT_PREFILL_CHUNK, "--prefill-chunk",
                                      help="prompt tokens per row in one prefill forward (joining requests are prefilled together; longer prompts chunk by chunk)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV,
                                          help="require 'Authorization: Bearer KEY' on every path but /health"),
    open_metrics: bool = typer.Option(False, "--open-metrics", help="serve /metrics without the API key (for a scraper without it)"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the `model` clients send (default: the target's name)"),
    gamma: int = GammaOpt,
    shutdown_grace: float = typer.Option(10.0, "--shutdown-grace", help="seconds in-flight requests get to finish on SIGINT/SIGTERM"),
    max_body_size: int = typer.Option(1 << 20, "--max-body-size", help="largest request body in bytes (larger: 413)"),
    body_timeout: float = typer.Option(30.0, "--body-timeout", help="seconds a request body may take to arrive (slower: 408)"),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="seconds a request's headers may take to arrive (slower: connection closed)"),
    keep_alive_timeout: float = typer.Option(5.0, "--keep-alive-timeout", help="seconds an idle keep-alive connection stays open"),
    max_connections: int = typer.Option(256, "--max-connections", help="open connections (uvicorn's limit_concurrency); more get 503"),
    log_level: str = typer.Option("info", "--log-level", help=" | ".join(LOG_LEVELS)),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, streaming) on the batched speculative engine."""
    from selfdraft.engine import drafter_factory
    from selfdraft.profile import scheduler_for
    from selfdraft.serve import ConnectionLimits, EngineLoop, ServerMetrics, create_app, run_server

    check_options(max_concurrency, max_batch, max_body_size, prefill_chunk, max_connections, max_kv_tokens,
                  (body_timeout, header_timeout, keep_alive_timeout), log_level, api_key)
    check_gamma(gamma)
    if api_key is None and not is_loopback(host):
        note(f"warning: serving on {host} without an API key: anyone who can reach it can use it "
             "(set SELFDRAFT_API_KEY or --api-key)")
    drafter = resolve_drafter(drafter, target_options)
    tgt = target_options.load()
    make = drafter_factory(drafter, tgt, suffix=suffix)
    batch = max_batch or max_concurrency
    sched = scheduler_for(scheduler, tgt, make(), gamma, threshold, log=note, batch_tokens=min(128, batch * (gamma + 1)))
    name = model_name or Path(tgt.name).name
    kv_budget = max_kv_tokens or auto_kv_budget(tgt)
    runner = EngineLoop(tgt, make, make().name, sched, batch, max_concurrency, ServerMetrics(gamma), prefill_chunk,
                        kv_budget=kv_budget)
    if runner.faults:
        note("warning: fault injection is on (SELFDRAFT_SERVE_FAULTS=1): POST /debug/fault breaks the engine on purpose")
    print(f"serving {name!r} with drafter {runner.drafter_name} ({drafter}), scheduler {sched.kind if sched else 'fixed'}, "
          f"KV budget {kv_budget} tokens, on http://{host}:{port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr)
    app = create_app(runner, name, api_key, gamma=gamma, shutdown_grace_s=shutdown_grace, max_body_bytes=max_body_size,
                     body_timeout_s=body_timeout, open_metrics=open_metrics)
    run_server(app, host, port, shutdown_grace, log_level,
               ConnectionLimits(max_connections, header_timeout, keep_alive_timeout))


def check_options(max_concurrency, max_batch, max_body_size, prefill_chunk, max_connections, max_kv_tokens,
                  timeouts, log_level, api_key) -> None:
    """Every option checked before the model loads (a typo costs no loading time)."""
    if min(max_concurrency, max_batch or 1, max_body_size, prefill_chunk, max_connections) < 1:
        raise ConfigError("--max-concurrency, --max-batch, --prefill-chunk, --max-body-size and --max-connections must be >= 1")
    if max_kv_tokens < 0:
        raise ConfigError(f"--max-kv-tokens must be >= 0 (0: automatic), got {max_kv_tokens}")
    if not all(t > 0 for t in timeouts):
        raise ConfigError("--body-timeout, --header-timeout and --keep-alive-timeout must be > 0")
    if log_level.lower() not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    if api_key is None:  # click reads an empty environment variable as unset: that must not mean "no key"
        api_key = os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key (--api-key or SELFDRAFT_API_KEY) is empty; set a key, or unset it to serve "
                          "without authentication")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auto_kv_budget(target) -> int:
    """KV-cache tokens that fit KV_MEMORY_SHARE of the memory free now (the device's, on a GPU)."""
    import psutil
    import torch

    cfg = target.model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * target.num_layers * heads * head_dim * target.model.dtype.itemsize  # keys + values
    if target.device.type == "cuda":
        free = torch.cuda.mem_get_info(target.device)[0]
    else:
        free = psutil.virtual_memory().available
    logging.getLogger("selfdraft.serve").debug("KV cache: %d bytes per token, %d bytes free", per_token, free)
    return max(target.max_context, int(free * KV_MEMORY_SHARE) // per_token)


