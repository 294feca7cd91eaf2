"""One background thread owns the model: the batched `Engine` and nothing else touches it.

HTTP handlers (asyncio) take an in-flight slot with `admit` and hand the request over with `submit`;
`cancel` gives the slot back. Both only put commands on a thread-safe inbox. Between engine steps
the thread takes the inbox (new requests join the batch while the padded KV cache stays within its
token budget, cancelled ones leave it: continuous batching; the requests taken together are
prefilled in one batched forward at the next step, which returns their first tokens), runs one
step, turns each request's committed tokens into text (`TextStream`: stop strings, multi-byte
characters) and hands a `Delta` to the request's own asyncio queue with `loop.call_soon_threadsafe`.
A request that hits a stop string is cancelled in the engine at once, so its slot is free for the
next step.

The thread is its own supervisor: any exception between or inside steps rebuilds the Engine.
Requests not yet prefilled rejoin the fresh engine; after an out-of-memory the request with the
longest context fails alone and the others resume from their committed tokens. Only repeated
failures with no successful step in between mark the engine failed (`/health` says so, new
requests get 503). Each request's outcome is counted exactly once (`_count`, `withdraw`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

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
OOM_ERROR = "the server ran out of memory for this request (the longest in its batch); retry with a shorter prompt or max_tokens"
FAULTS_ENV = "SELFDRAFT_SERVE_FAULTS"  # "1": POST /debug/fault injects engine failures (tests and soaks only)
FAULT_KINDS = ("step", "oom", "inbox")
MAX_RESTARTS = 5  # consecutive engine failures with no successful step in between before giving up


class Overloaded(RuntimeError):
    """More requests in flight than --max-concurrency (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The server is stopping and admits nothing new (HTTP 503)."""


class EngineUnavailable(RuntimeError):
    """The engine thread failed and could not be restarted (HTTP 503)."""


class InjectedFault(RuntimeError):
    """A failure injected on purpose (FAULTS_ENV), to test recovery."""


def injected_oom() -> Exception:
    oom = getattr(torch, "OutOfMemoryError", None)  # what a CUDA allocation failure raises
    return oom("injected out of memory") if oom else MemoryError("injected out of memory")


def is_oom(e: BaseException) -> bool:
    """An allocation failure: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    oom = getattr(torch, "OutOfMemoryError", ())
    return isinstance(e, (MemoryError, *([oom] if oom else []))) or "can't allocate memory" in str(e)


@dataclass
class Health:
    """What GET /health reports: `ok` is False once the engine thread has failed or stopped."""

    ok: bool
    engine: str  # running | failed | stopped | not started
    restarts: int  # times the engine was rebuilt after a failure
    last_error: str | None  # the exception type of the last failure (details in the log)


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
    endpoint: str
    queue: asyncio.Queue
    spec: RequestSpec | None = None  # set by submit
    loop: asyncio.AbstractEventLoop | None = None
    arrival: float = field(default_factory=time.perf_counter)
    done: bool = False  # set (on the event loop) once the final Delta was received
    released: bool = False  # its in-flight slot was given back (under EngineLoop._lock)
    submitted: bool = False  # handed to the engine thread, which then counts its outcome
    counted: bool = False  # its outcome is in the metrics (once)


@dataclass
class _Live:
    """Engine-thread state of one request."""

    handle: Handle
    engine_id: int
    text: TextStream
    tokens: int = 0  # completion tokens that count (up to the one completing a stop string)
    spec: SpecStats = field(default_factory=SpecStats)
    first_token_at: float | None = None
    retries: int = 0  # engine restarts it was resumed after without committing a token since


class EngineLoop:
    """Owns Engine + Target in one thread. `start()`, `admit()`, `submit()`, `cancel()`, `shutdown()`."""

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
        kv_budget: int | None = None,
        faults: bool | None = None,
    ) -> None:
        self.target = target
        self.make_drafter = make_drafter
        self.drafter_name = drafter_name
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        # Padded KV-cache tokens the batch may reach (rows x the longest prompt + max_tokens): None = no bound.
        self.kv_budget = kv_budget
        self.faults = os.environ.get(FAULTS_ENV) == "1" if faults is None else faults
        self.engine = Engine(target, scheduler, max_concurrency=max_batch, prefill_chunk=prefill_chunk)
        self.metrics = metrics or ServerMetrics(gamma=GenerationConfig().gamma)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._in_flight = 0  # admitted and not yet finished (being read + queued + running)
        self._admitting = True
        self._dead = False  # the engine failed for good: nothing is admitted, /health says so
        self._stop = threading.Event()
        self._live: dict[int, _Live] = {}  # engine request id -> state (engine thread only)
        self._waiting: deque[Handle] = deque()  # submitted, held back by the KV budget (engine thread only)
        self._fault: str | None = None  # an injected failure the engine thread has yet to raise
        self.restarts = 0
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- called from the HTTP side
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def health(self) -> Health:
        t = self._thread
        if self._dead:
            state = "failed"
        elif t is None:
            state = "not started"
        elif not t.is_alive():
            state = "stopped"
        else:
            state = "running"
        return Health(state == "running", state, self.restarts, self.last_error)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="selfdraft-engine", daemon=True)
            self._thread.start()

    def admit(self, endpoint: str = "completions") -> Handle:
        """Take an in-flight slot (before the body is parsed or tokenized) or raise Overloaded /
        ShuttingDown / EngineUnavailable. Then `submit` it, or `withdraw` it with the HTTP status."""
        with self._lock:
            self._check_open()
            if self._in_flight >= self.max_concurrency:
                raise Overloaded(f"too many concurrent requests (limit {self.max_concurrency}); retry later")
            self._in_flight += 1
        return Handle(next(self._ids), endpoint, asyncio.Queue())

    def submit(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop, handle: Handle | None = None) -> Handle:
        """Hand a request to the engine thread (admitting it first unless `handle` was admitted)."""
        h = handle or self.admit(spec.endpoint)
        h.spec, h.loop, h.endpoint = spec, loop, spec.endpoint
        with self._lock:  # under the lock: a dying engine thread drains the inbox after setting _dead
            try:
                self._check_open()
            except RuntimeError:
                self._release_locked(h)
                h.counted = True  # the caller answers 503 and counts it as rejected
                raise
            h.submitted = True
            self._inbox.put(("add", h))
        return h

    def withdraw(self, h: Handle, status: int) -> None:
        """An admitted request that never reached the engine (invalid, or the client left): give
        its slot back and count it as rejected with `status`."""
        if h.submitted:
            return
        self._release(h)
        if not h.counted:
            h.counted = True
            self.metrics.rejected.labels(str(status)).inc()

    def cancel(self, handle: Handle) -> None:
        """Drop a request (client gone): its in-flight slot is free at once (a new request may be
        admitted now); it leaves the engine's batch before the next step."""
        if handle.done or not self._release(handle):
            return
        if handle.submitted:
            self._inbox.put(("cancel", handle))

    def inject(self, kind: str) -> None:
        """Make the engine thread fail once (FAULTS_ENV only): "step" raises before a step, "oom"
        raises an out-of-memory in a step with requests decoding, "inbox" while taking its inbox."""
        if not self.faults or kind not in FAULT_KINDS:
            raise ValueError(f"fault injection is off or {kind!r} is not one of {FAULT_KINDS}")
        self._fault = kind
        self._inbox.put(("wake", None))

    def _check_open(self) -> None:
        if self._dead:
            raise EngineUnavailable("the engine failed and could not be restarted; the server log has the details")
        if not self._admitting:
            raise ShuttingDown("the server is shutting down")

    def _release(self, h: Handle) -> bool:
        """Give back h's in-flight slot, once (called from either thread)."""
        with self._lock:
            return self._release_locked(h)

    def _release_locked(self, h: Handle) -> bool:
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

    # ---------------------------------------------------------------- engine thread: supervision
    def _run(self) -> None:
        log.info("engine loop started")
        try:
            self._supervise()
        except BaseException as e:  # the last resort: nothing may be left hanging on a dead thread
            self._die(e)
            raise
        log.info("engine loop stopped")

    def _supervise(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self._iterate():
                    failures = 0
            except Exception as e:  # noqa: BLE001  (anything: the inbox, admission, a step)
                failures += 1
                if failures > MAX_RESTARTS:
                    log.exception("engine failed %d times in a row; giving up", failures)
                    self._die(e)
                    return
                log.exception("engine failed; restarting it (%d requests in the batch)", len(self._live))
                self._restart(e)
        self._fail_all("the server shut down before this request finished", reason="cancelled")

    def _iterate(self) -> bool:
        """Take the inbox, admit what fits, run one step. True if a step ran."""
        self._take_inbox(block=not self.engine.has_unfinished and not self._waiting and not self._stop.is_set())
        if self._stop.is_set():
            return False
        self._admit_waiting()
        if not self.engine.has_unfinished:
            return False
        self._raise_fault("step")
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self._dispatch(outputs, time.perf_counter() - t0)
        return True

    def _raise_fault(self, where: str) -> None:
        kind = self._fault
        if kind == "oom" and where == "step" and self.engine.active:
            self._fault = None
            raise injected_oom()
        if kind == where:
            self._fault = None
            raise InjectedFault(f"injected {where} fault")

    def _restart(self, e: BaseException) -> None:
        """A fresh Engine; each request in the old one rejoins it, resumed from the tokens it has
        already sent (their text is out: they become part of its prompt). After an out-of-memory the
        request with the longest context (the one the padded cache grows for) fails instead. A
        request caught in a second failure before it committed another token fails too, so one
        that breaks the engine cannot loop."""
        old = self.engine
        self.restarts += 1
        self.last_error = type(e).__name__
        self.engine = Engine(self.target, old.scheduler, old.max_concurrency, prefill_chunk=self.prefill_chunk)
        lives, self._live = [lv for lv in self._live.values()], {}
        staying = [lv for lv in lives if not lv.handle.released]
        culprit = max(staying, key=lambda lv: len(lv.handle.spec.prompt_ids) + len(lv.text.ids),
                      default=None) if is_oom(e) else None
        for lv in lives:
            if lv.handle.released:  # its client left (the failure may have been in its cancel)
                self._end(lv, "cancelled")
            elif lv is culprit:
                self._end(lv, "error", error=OOM_ERROR)
            elif lv.retries >= 1 or (lv.text.ids and not resumable(lv.handle.spec)):
                self._end(lv, "error", error=INTERNAL_ERROR)
            else:
                lv.retries += 1
                self._join(lv.handle, lv, list(lv.text.ids))
        self._update_gauges()

    def _die(self, e: BaseException) -> None:
        with self._lock:
            self._dead = True
        self.last_error = type(e).__name__
        self._fail_all(INTERNAL_ERROR)

    # ---------------------------------------------------------------- engine thread: requests
    def _take_inbox(self, block: bool) -> None:
        try:
            cmd, handle = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                self._waiting.append(handle)
            elif cmd == "cancel":
                self._cancel(handle)
            self._raise_fault("inbox")
            try:
                cmd, handle = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit_waiting(self) -> None:
        """Move waiting requests into the engine, oldest first, while the padded KV cache they could
        reach stays within kv_budget (one request alone is always admitted)."""
        while self._waiting:
            h = self._waiting[0]
            if h.released:  # cancelled before it reached the engine: it still counts, as cancelled
                self._waiting.popleft()
                self._count(h, "cancelled")
                continue
            if not self._fits(h.spec):
                return
            self._waiting.popleft()
            self._join(h)

    def _fits(self, spec: RequestSpec) -> bool:
        if self.kv_budget is None or not self._live:
            return True
        longest = max(reach(lv.handle.spec) for lv in self._live.values())
        return (len(self._live) + 1) * max(longest, reach(spec)) <= self.kv_budget

    def _join(self, h: Handle, live: _Live | None = None, done: list[int] | None = None) -> None:
        """Add h to the engine: afresh, or (done: its committed tokens) resumed with them as prompt."""
        spec, done = h.spec, done or []
        config = dataclasses.replace(spec.config, max_new_tokens=spec.config.max_new_tokens - len(done))
        try:
            rid = self.engine.add_request(spec.prompt_ids + done, self.make_drafter(), spec.params, config)
        except Exception:  # noqa: BLE001  (validated upstream; still never let one request kill the loop)
            log.exception("request %s could not join the batch", spec.request_id)
            if live is not None:
                self._end(live, "error", error=INTERNAL_ERROR)
            else:
                self._count(h, "error")
                self._post(h, Delta("", finished=True, finish_reason="error", error=INTERNAL_ERROR))
            return
        if live is None:
            live = _Live(h, rid, TextStream(self.target.decode, spec.stop))
            self.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        live.engine_id = rid
        self._live[rid] = live
        self._update_gauges()

    def _cancel(self, h: Handle) -> None:
        live = next((lv for lv in self._live.values() if lv.handle is h), None)
        if live is None:  # finished meanwhile, or still waiting (counted when it is taken)
            return
        self.engine.cancel(live.engine_id)
        self._end(live, "cancelled")

    def _dispatch(self, outputs: list[StepOutput], seconds: float) -> None:
        now = time.perf_counter()
        self.metrics.observe_step([o.round for o in outputs if o.round is not None], seconds)
        for o in outputs:
            live = self._live.get(o.request_id)
            if live is None:
                continue
            if o.finish_reason == "error":  # this request alone failed; the rest of the batch went on
                log.error("request %s failed in the engine", live.handle.spec.request_id, exc_info=o.error)
                self._end(live, "error", error=OOM_ERROR if is_oom(o.error) else INTERNAL_ERROR)
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
            if ids:
                live.retries = 0  # it makes progress: a later failure is not its doing
            if live.text.stopped:
                if not o.finished:
                    self.engine.cancel(o.request_id)  # free the slot before the next step
                self._end(live, "stop", "".join(text), ids)
            elif o.finished:
                text.append(live.text.flush())
                self._end(live, "stop" if o.finish_reason == "eos" else "length", "".join(text), ids)
            elif ids:
                self._post(live.handle, Delta("".join(text), ids))
        self._update_gauges()

    def _end(self, live: _Live, reason: str, text: str = "", ids: list[int] | None = None,
             error: str | None = None) -> None:
        self._live.pop(live.engine_id, None)
        self.engine.results.pop(live.engine_id, None)  # the engine keeps results; a server must not
        h = live.handle
        self._count(h, reason)
        self.metrics.latency.observe(time.perf_counter() - h.arrival)
        self._post(h, Delta(text, ids or [], True, reason, len(h.spec.prompt_ids), live.tokens, live.spec, error))

    def _count(self, h: Handle, reason: str) -> None:
        """The one place a submitted request's outcome is counted (engine thread only)."""
        if not h.counted:
            h.counted = True
            self.metrics.requests.labels(h.endpoint, reason).inc()

    def _fail_all(self, message: str, reason: str = "error") -> None:
        """End every request: in the engine, waiting for room, and still in the inbox (shutdown, or
        an engine that cannot be restarted)."""
        for live in list(self._live.values()):
            self._end(live, reason, error=message)
        self.engine = Engine(self.target, self.engine.scheduler, self.engine.max_concurrency, prefill_chunk=self.prefill_chunk)
        while True:
            try:
                cmd, h = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd == "add":
                self._waiting.append(h)
        while self._waiting:
            h = self._waiting.popleft()
            self._count(h, "cancelled" if h.released else reason)
            self._post(h, Delta("", finished=True, finish_reason=reason, prompt_tokens=len(h.spec.prompt_ids),
                                error=message))
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


def reach(spec: RequestSpec) -> int:
    """The most KV-cache slots a request can fill: its prompt plus max_tokens."""
    return len(spec.prompt_ids) + spec.config.max_new_tokens


def resumable(spec: RequestSpec) -> bool:
    """Whether a request can continue from its committed tokens in a fresh engine with the same
    output distribution: penalties count the tokens generated so far, which a resumed request
    would see as prompt, so those cannot."""
    p = spec.params
    return not (p.presence_penalty or p.frequency_penalty)
