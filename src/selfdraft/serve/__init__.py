"""`selfdraft serve`: an OpenAI-compatible HTTP server on the batched speculative engine.

engine_loop.py  one thread owns the Engine; thread-safe submit/cancel; per-request asyncio queues
text.py         incremental detokenization with stop strings
protocol.py     OpenAI request bodies, error objects, validation -> RequestSpec
app.py          FastAPI app factory over a built EngineLoop (no model loading)
metrics.py      Prometheus metrics
"""

from __future__ import annotations

from selfdraft.serve.app import create_app
from selfdraft.serve.engine_loop import EngineLoop, RequestSpec
from selfdraft.serve.metrics import ServerMetrics

__all__ = ["EngineLoop", "RequestSpec", "ServerMetrics", "create_app", "run_server"]


def run_server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_grace_s: float = 10.0,
               log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM: uvicorn stops accepting, waits up to shutdown_grace_s for open
    requests, cancels what is left, then the app's lifespan joins the engine thread."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_grace_s)
