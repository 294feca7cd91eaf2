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
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from selfdraft.serve.app import BODY_TIMEOUT_S, MAX_BODY_BYTES, create_app
from selfdraft.serve.engine_loop import EngineLoop, RequestSpec
from selfdraft.serve.metrics import ServerMetrics

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY_BYTES", "ConnectionLimits", "EngineLoop", "GracefulServer", "RequestSpec", "server_config",
           "ServerMetrics", "create_app", "run_server"]

FLUSH_S = 2.0  # after the grace period: time for the cancelled streams' last events to reach their clients


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client can hold before the app sees a request (uvicorn's own limits, plus a header timeout)."""

    max_connections: int = 256  # uvicorn's limit_concurrency: connections beyond it get 503
    header_timeout_s: float = 10.0  # a request's headers must be complete this long after the connection
    # opens (or the previous response ended); else the connection is closed (slow-header clients)
    keep_alive_s: float = 5.0  # uvicorn's timeout_keep_alive: an idle keep-alive connection is closed after it


def header_timeout_protocol(timeout_s: float, on_timeout=lambda: None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, plus a deadline for each request's headers: uvicorn has none, so a
    client sending a byte now and then would hold its connection forever."""

    class HeaderTimeoutH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in (or the connection is over)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # the next request on this keep-alive connection gets its own deadline

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                on_timeout()
                self.transport.close()

    return HeaderTimeoutH11


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


def server_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  limits: ConnectionLimits = ConnectionLimits()) -> uvicorn.Config:
    metrics = app.state.runner.metrics
    protocol = header_timeout_protocol(limits.header_timeout_s, metrics.header_timeouts.inc)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s)


def run_server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_grace_s: float = 10.0,
               log_level: str = "info", limits: ConnectionLimits = ConnectionLimits()) -> None:
    """Serve until SIGINT/SIGTERM: stop accepting, give open requests shutdown_grace_s, end the
    rest with an error event (streams) or a 503, then the app's lifespan joins the engine thread."""
    GracefulServer(server_config(app, host, port, log_level, limits), app.state.runner, shutdown_grace_s).run()
