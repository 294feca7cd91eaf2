"""`selfdraft serve`: an OpenAI-compatible HTTP server on the batched speculative engine.

engine_loop.py  one thread owns the Engine; thread-safe submit/cancel; per-request asyncio queues
text.py         incremental detokenization with stop strings
protocol.py     OpenAI request bodies, error objects, validation -> RequestSpec
app.py          FastAPI app factory over a built EngineLoop (no model loading)
__init__.py     GracefulServer / run_server: uvicorn whose shutdown drains the engine first
metrics.py      Prometheus metrics
"""

from __future__ import annotations

import asyncio

import uvicorn

from selfdraft.serve.app import MAX_BODY_BYTES, create_app
from selfdraft.serve.engine_loop import EngineLoop, RequestSpec
from selfdraft.serve.metrics import ServerMetrics

__all__ = ["MAX_BODY_BYTES", "EngineLoop", "GracefulServer", "RequestSpec", "ServerMetrics", "create_app", "run_server"]

FLUSH_S = 2.0  # after the grace period: time for the cancelled streams' last events to reach their clients


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: the moment it starts to stop, the engine stops admitting and gives
    in-flight requests `grace_s` to finish, then cancels the rest itself, so a stream that outlives
    the grace period still ends with an error event and [DONE]. uvicorn's own deadline
    (`timeout_graceful_shutdown`, which cuts connections silently) is set FLUSH_S later."""

    def __init__(self, config: uvicorn.Config, runner: EngineLoop, grace_s: float) -> None:
        config.timeout_graceful_shutdown = grace_s + FLUSH_S
        super().__init__(config)
        self.runner, self.grace_s = runner, grace_s

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(asyncio.to_thread(self.runner.shutdown, self.grace_s))
        await super().shutdown(sockets)
        await drain


def run_server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_grace_s: float = 10.0,
               log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM: stop accepting, give open requests shutdown_grace_s, end the
    rest with an error event (streams) or a 503, then the app's lifespan joins the engine thread."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    GracefulServer(config, app.state.runner, shutdown_grace_s).run()
