"""One background thread owns the model: the batched `Engine` and nothing else touches it.

HTTP handlers (asyncio) call `submit` / `cancel`, which only put commands on a thread-safe inbox.
Between engine steps the thread takes the inbox (new requests join the batch, cancelled ones
leave it: continuous batching; the requests taken together are prefilled in one batched
forward at the next step, which returns their first tokens), runs one step, turns each request's committed tokens into text
(`TextStream`: stop strings, multi-byte characters) and hands a `Delta` to the request's own
asyncio queue with `loop.call_soon_threadsafe`. A request that hits a stop string is cancelled in
the engine at once, so its slot is free for the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from selfdraft.config import DEFAULT_PREFILL_CHUNK, GenerationConfig, SamplingParams
from selfdraft.decode import RoundStats
from selfdraft.drafters.base import Drafter
from selfdraft.engine import Engine, StepOutput
from selfdraft.scheduler import Scheduler
from selfdraft.serve.metrics import ServerMetrics
from selfdraft.serve.text import TextStream
from selfdraft.target import Target

log = logging.getLogger("selfdraft.serve")
# What a client learns about a failure inside the engine; the details go to the server log.
INTERNAL_ERROR = "internal error while generating this request; the server log has the details"


class Overloaded(RuntimeError):
    """More requests in flight than --max-concurrency (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The server is stopping and admits nothing new (HTTP 503)."""


@dataclass(frozen=True)
class RequestSpec:
    """Everything the engine thread needs for one request (validated by the HTTP layer)."""

    prompt_ids: list[int]
    params: SamplingParams
    config: GenerationConfig
    stop: tuple[str, ...] = ()
    endpoint: str = "completions"
    request_id: str = ""  # the response id; server logs name failures by it


@dataclass
class SpecStats:
    """Speculative statistics of one request (reported in the response's usage)."""

    rounds: int = 0
    draft_tokens: int = 0  # drafts sent to verification
    accepted_tokens: int = 0  # drafts accepted

    def add(self, r: RoundStats) -> None:
        self.rounds += 1
        self.draft_tokens += r.proposed
        self.accepted_tokens += r.accepted

    def as_dict(self, drafter: str) -> dict:
        return {
            "drafter": drafter,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "tau": (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0,
        }


@dataclass
class Delta:
    """New text of one request. The last one has `finished` set, the finish reason and the counts."""

    text: str
    token_ids: list[int] = field(default_factory=list)  # tokens committed since the last Delta (text may lag)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | cancelled | error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats | None = None
    error: str | None = None


@dataclass
class Handle:
    """The HTTP side of one request: its Deltas arrive on `queue` (in the handler's event loop)."""

    id: int
    spec: RequestSpec
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    done: bool = False  # set (on the event loop) once the final Delta was received
    released: bool = False  # its in-flight slot was given back (under EngineLoop._lock)


@dataclass
class _Live:
    """Engine-thread state of one request."""

    handle: Handle
    engine_id: int
    text: TextStream
    tokens: int = 0  # completion tokens that count (up to the one completing a stop string)
    spec: SpecStats = field(default_factory=SpecStats)
    first_token_at: float | None = None


class EngineLoop:
    """Owns Engine + Target in one thread. `start()`, `submit()`, `cancel()`, `shutdown()`."""

    def __init__(
        self,
        target: Target,
        make_drafter: Callable[[], Drafter],
        drafter_name: str,
        scheduler: Scheduler | None = None,
        max_batch: int = 16,
        max_concurrency: int = 16,
        metrics: ServerMetrics | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.target = target
        self.make_drafter = make_drafter
        self.drafter_name = drafter_name
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.engine = Engine(target, scheduler, max_concurrency=max_batch, prefill_chunk=prefill_chunk)
        self.metrics = metrics or ServerMetrics(gamma=GenerationConfig().gamma)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and not yet finished (queued + running)
        self._admitting = True
        self._stop = threading.Event()
        self._live: dict[int, _Live] = {}  # engine request id -> state (engine thread only)
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- called from the HTTP side
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="selfdraft-engine", daemon=True)
            self._thread.start()

    def submit(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> Handle:
        """Admit a request or raise Overloaded / ShuttingDown."""
        with self._lock:
            if not self._admitting:
                raise ShuttingDown("the server is shutting down")
            if self._in_flight >= self.max_concurrency:
                raise Overloaded(f"too many concurrent requests (limit {self.max_concurrency}); retry later")
            self._in_flight += 1
        handle = Handle(next(self._ids), spec, asyncio.Queue(), loop)
        self._inbox.put(("add", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Drop a request (client gone): its in-flight slot is free at once (a new request may be
        admitted now); it leaves the engine's batch before the next step."""
        if handle.done or not self._release(handle):
            return
        self._inbox.put(("cancel", handle))

    def _release(self, h: Handle) -> bool:
        """Give back h's in-flight slot, once (called from either thread)."""
        with self._lock:
            if h.released:
                return False
            h.released = True
            self._in_flight -= 1
            return True

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop admitting, let in-flight requests finish for up to grace_s, cancel the rest (their
        streams end with an error event), join. Calling it again only joins."""
        with self._lock:
            self._admitting = False
        deadline = time.monotonic() + grace_s
        while (self._in_flight and time.monotonic() < deadline and not self._stop.is_set()
               and self._thread and self._thread.is_alive()):
            time.sleep(0.05)
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        log.info("engine loop started")
        while True:
            self._take_inbox(block=not self.engine.has_unfinished and not self._stop.is_set())
            if self._stop.is_set():
                break
            if not self.engine.has_unfinished:
                continue
            try:
                t0 = time.perf_counter()
                outputs = self.engine.step()
                self._dispatch(outputs, time.perf_counter() - t0)
            except Exception:  # a failure no single request caused (the batched forward): fail the batch
                log.exception("engine step failed; failing the %d requests in the batch", len(self._live))
                self._fail_all(INTERNAL_ERROR)
        self._fail_all("the server shut down before this request finished", reason="cancelled", inbox=True)
        log.info("engine loop stopped")

    def _take_inbox(self, block: bool) -> None:
        try:
            cmd, handle = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                self._add(handle)
            elif cmd == "cancel":
                self._cancel(handle)
            try:
                cmd, handle = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, h: Handle) -> None:
        if h.released:  # cancelled before it reached the engine: it still counts, as cancelled
            self.metrics.requests.labels(h.spec.endpoint, "cancelled").inc()
            return
        try:
            rid = self.engine.add_request(h.spec.prompt_ids, self.make_drafter(), h.spec.params, h.spec.config)
        except Exception:  # validated upstream; still never let one request kill the loop
            log.exception("request %s could not join the batch", h.spec.request_id)
            self._post(h, Delta("", finished=True, finish_reason="error", error=INTERNAL_ERROR))
            return
        self._live[rid] = _Live(h, rid, TextStream(self.target.decode, h.spec.stop))
        self.metrics.prompt_tokens.inc(len(h.spec.prompt_ids))
        self._update_gauges()

    def _cancel(self, h: Handle) -> None:
        live = next((lv for lv in self._live.values() if lv.handle is h), None)
        if live is None:  # finished meanwhile, or failed to add
            return
        self.engine.cancel(live.engine_id)
        self._finish(live, "cancelled")

    def _dispatch(self, outputs: list[StepOutput], seconds: float) -> None:
        now = time.perf_counter()
        self.metrics.observe_step([o.round for o in outputs if o.round is not None], seconds)
        for o in outputs:
            live = self._live.get(o.request_id)
            if live is None:
                continue
            if o.finish_reason == "error":  # this request alone failed; the rest of the batch went on
                log.error("request %s failed in the engine", live.handle.spec.request_id, exc_info=o.error)
                self._finish(live, "error", error=INTERNAL_ERROR)
                continue
            if o.round is not None:
                live.spec.add(o.round)
            if live.first_token_at is None and o.new_tokens:
                live.first_token_at = now
                self.metrics.ttft.observe(now - live.handle.arrival)
            self.metrics.output_tokens.inc(len(o.new_tokens))
            text, ids = [], []
            for t in o.new_tokens:
                ids.append(t)
                text.append(live.text.push(t))
                if live.text.stopped:
                    break
            live.tokens += len(ids)
            if live.text.stopped:
                if not o.finished:
                    self.engine.cancel(o.request_id)  # free the slot before the next step
                self._finish(live, "stop", "".join(text), ids)
            elif o.finished:
                text.append(live.text.flush())
                self._finish(live, "stop" if o.finish_reason == "eos" else "length", "".join(text), ids)
            elif ids:
                self._post(live.handle, Delta("".join(text), ids))
        self._update_gauges()

    def _finish(self, live: _Live, reason: str, text: str = "", ids: list[int] | None = None,
                error: str | None = None) -> None:
        del self._live[live.engine_id]
        self.engine.results.pop(live.engine_id, None)  # the engine keeps results; a server must not
        h = live.handle
        self.metrics.requests.labels(h.spec.endpoint, reason).inc()
        self.metrics.latency.observe(time.perf_counter() - h.arrival)
        self._post(h, Delta(text, ids or [], True, reason, len(h.spec.prompt_ids), live.tokens, live.spec, error))

    def _fail_all(self, message: str, reason: str = "error", inbox: bool = False) -> None:
        """End every request in the engine; with inbox, also those still waiting to join it (shutdown).
        Otherwise they stay queued and join the fresh engine."""
        for live in list(self._live.values()):
            self._finish(live, reason, error=message)
        self.engine = Engine(self.target, self.engine.scheduler, self.engine.max_concurrency, prefill_chunk=self.prefill_chunk)
        while inbox:
            try:
                cmd, h = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd == "add":
                self._post(h, Delta("", finished=True, finish_reason=reason, error=message))
        self._update_gauges()

    def _post(self, h: Handle, delta: Delta) -> None:
        if delta.finished:
            self._release(h)
        try:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, delta)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(max(0, self._in_flight - len(self.engine.active)))
        self.metrics.running.set(len(self.engine.active))
