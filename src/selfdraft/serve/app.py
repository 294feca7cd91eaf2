"""The OpenAI-compatible HTTP API over an already-running `EngineLoop` (no model loading here).

POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events),
GET /v1/models, GET /health, GET /metrics. Every error is an OpenAI error object with a 4xx/5xx code;
the text of an internal exception never reaches a client (it is logged with the request id).

`Gate`, in front of FastAPI, decides what the headers allow before a byte of the body is read (the
API key, a declared size), reads the body within a size and time limit, and takes the request's
in-flight slot; only then does FastAPI parse the JSON and a worker thread tokenize the prompt. So
an unauthenticated, oversized, slow or surplus request costs neither parsing nor tokenizing, and
the tokenizer's queue is bounded by --max-concurrency. The Gate also counts every refused request
once (the engine thread counts the outcome of every request that reached it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfdraft.config import DEFAULT_GAMMA
from selfdraft.serve.engine_loop import (
    Delta,
    EngineLoop,
    EngineUnavailable,
    Handle,
    Overloaded,
    RequestSpec,
    ShuttingDown,
)
from selfdraft.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    OpenAIError,
    build_spec,
    chat_prompt_ids,
    check_unsupported,
    completion_prompt_ids,
    validation_error,
)

log = logging.getLogger("selfdraft.serve")
DISCONNECT_POLL_S = 0.5  # non-streamed requests: how often to check whether the client is still there
MAX_BODY_BYTES = 1 << 20  # default request-body limit (413 above it): ~100x the largest prompt that fits SmolLM2's context
BODY_TIMEOUT_S = 30.0  # default: a body not complete this long after its headers gets 408 (slow clients)
TOKENIZE_THREADS = 2  # prompts tokenized at once; admission bounds the queue to --max-concurrency
GENERATE = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)  # answered without the API key (liveness probes); /metrics with open_metrics
# One server-sent event (OpenAPI 3.1 tools check each event of a text/event-stream against the schema;
# 3.2 calls it itemSchema): `data` is a JSON chunk, an error object, or the final [DONE].
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a JSON chunk, an error object, or [DONE]"},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
ERROR_RESPONSES: dict[int | str, dict] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
          "description": "the completion (JSON), or with stream: true server-sent events ending in data: [DONE]"},
    400: {"model": ErrorBody, "description": "invalid request (parameters, prompt, unsupported field)"},
    401: {"model": ErrorBody, "description": "missing or wrong API key (with --api-key)"},
    404: {"model": ErrorBody, "description": "unknown model"},
    408: {"model": ErrorBody, "description": "the request body did not arrive within the body timeout"},
    413: {"model": ErrorBody, "description": "request body above the size limit"},
    429: {"model": ErrorBody, "description": "too many requests in flight"},
    503: {"model": ErrorBody, "description": "the server is shutting down, or its engine failed"},
}


class BodyTooLarge(Exception):
    pass


class Gate:
    """ASGI middleware: access, body, admission, and the count of refused requests (module docstring)."""

    def __init__(self, inner, server: "OpenAIServer", body_timeout_s: float) -> None:
        self.inner, self.server, self.body_timeout_s = inner, server, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        s, status, handle = self.server, 0, None

        async def tracked(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = s.check_access(scope)
            if error is None and scope["method"] == "POST" and scope["path"] in GENERATE:
                body, error = await self.read_body(scope, receive)
                if body is None and error is None:
                    return  # the client left while sending: counted below
                if error is None:
                    handle, error = s.admit(scope["path"])
                if error is None:
                    scope.setdefault("state", {})["selfdraft_handle"] = handle
                    receive = replay(body, receive)
            if error is not None:
                return await s.error_response(error)(scope, receive, tracked)
            await self.inner(scope, receive, tracked)
        except Exception:
            status = status or 500
            raise
        finally:
            s.settle(scope, handle, status)

    async def read_body(self, scope, receive) -> tuple[bytes | None, OpenAIError | None]:
        """The whole body, or the error that ends the request (413, 408); (None, None): client gone."""
        limit = self.server.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return None, self.server.too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None, None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise BodyTooLarge
                    chunks.append(chunk)
                    if not message.get("more_body"):
                        return b"".join(chunks), None
        except BodyTooLarge:
            return None, self.server.too_large
        except TimeoutError:
            return None, OpenAIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                     "invalid_request_error", None, "request_timeout")


def replay(body: bytes, receive):
    """A receive() that gives the already-read body first, then the client's own messages (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again():
        return pending.pop() if pending else await receive()

    return again


class OpenAIServer:
    """The handlers of the API over one `EngineLoop`: requests in, OpenAI objects (or SSE) out.
    `create_app` binds them to routes; everything here is plain methods so each reads on its own."""

    def __init__(self, runner: EngineLoop, model_name: str, api_key: str | None, gamma: int, max_body_bytes: int,
                 open_metrics: bool = False) -> None:
        if api_key == "":  # an empty key must not silently mean "no authentication"
            raise ValueError("the API key is empty; pass a non-empty key or none")
        self.runner, self.model_name, self.api_key, self.gamma = runner, model_name, api_key, gamma
        self.max_body_bytes, self.open_metrics = max_body_bytes, open_metrics
        self.metrics = runner.metrics
        self.created = int(time.time())
        self.tokenizer_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="selfdraft-tokenize")
        self.too_large = OpenAIError(413, f"the request body exceeds this server's limit of {max_body_bytes} bytes",
                                     "invalid_request_error", None, "request_too_large")

    # ------------------------------------------------------------ errors: always OpenAI objects
    def error_response(self, e: OpenAIError, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def on_openai_error(self, _: Request, e: OpenAIError) -> JSONResponse:
        return self.error_response(e)

    async def on_validation_error(self, _: Request, e: RequestValidationError) -> JSONResponse:
        return self.error_response(validation_error(list(e.errors())))

    async def on_http_error(self, _: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 413:
            return self.error_response(self.too_large)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return self.error_response(OpenAIError(e.status_code, str(e.detail), kind), e.headers)  # e.g. 405's Allow

    async def on_internal_error(self, request: Request, e: Exception) -> JSONResponse:  # a bug: log it, say nothing
        return self.error_response(internal(f"req-{uuid.uuid4().hex}", request.url.path, e))

    # ------------------------------------------------------------ the Gate's decisions
    def check_access(self, scope) -> OpenAIError | None:
        """401 unless the API key is right (or none is set, or the path is open): every path but
        /health (and /metrics with open_metrics), the API documentation included."""
        path = scope["path"]
        if self.api_key is None or path in OPEN_PATHS or (path == "/metrics" and self.open_metrics):
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
            return None
        return OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           "invalid_request_error", None, "invalid_api_key")

    def admit(self, path: str) -> tuple[Handle | None, OpenAIError | None]:
        try:
            return self.runner.admit("chat" if path.endswith("chat/completions") else "completions"), None
        except RuntimeError as e:
            return None, refusal(e)

    def settle(self, scope, handle: Handle | None, status: int) -> None:
        """After the response (or the client's departure): a request that reached the engine leaves
        it if still there (a stream whose client left before its generator ever ran, too); one
        that did not is counted as rejected with its status (499: the client left first)."""
        generate = scope["method"] == "POST" and scope["path"] in GENERATE
        if handle is not None:
            if handle.submitted:
                self.runner.cancel(handle)  # no-op once finished
            else:
                self.runner.withdraw(handle, status or 499)
        elif status >= 400 or (generate and status == 0):
            self.metrics.rejected.labels(str(status or 499)).inc()

    # ------------------------------------------------------------ routes
    async def health(self) -> JSONResponse:
        """200 while the engine thread runs; 503 once it has failed for good or stopped."""
        r, h = self.runner, self.runner.health()
        body = {"status": "ok" if h.ok else "unavailable", "engine": h.engine, "model": self.model_name,
                "drafter": r.drafter_name, "in_flight": r.in_flight, "restarts": h.restarts, "last_error": h.last_error}
        return JSONResponse(body, status_code=200 if h.ok else 503)

    async def fault(self, kind: str) -> dict:
        """Inject one engine failure (only with SELFDRAFT_SERVE_FAULTS=1: tests and soaks)."""
        try:
            self.runner.inject(kind)
        except ValueError as e:
            raise OpenAIError(400, str(e), "invalid_request_error", "kind") from None
        return {"injected": kind}

    async def metrics_route(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "selfdraft",
                "max_model_len": self.runner.target.max_context, "drafter": self.runner.drafter_name}
        return {"object": "list", "data": [card]}

    async def completions(self, req: CompletionRequest, request: Request):
        rid = f"cmpl-{uuid.uuid4().hex}"
        handle = self.submit(await self.prepare(req, rid, "completions", req.max_tokens), request)

        def chunk(text: str, finish: str | None, ids: list[int] | None = None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                    "choices": [with_ids(choice, ids, req)]}

        if req.stream:
            return self.sse(handle, req, lambda: None, chunk, "text_completion")
        text, ids, last = await self.collect(handle, request)
        return {**chunk(text, last.finish_reason, ids), "usage": self.usage(last)}

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        handle = self.submit(await self.prepare(req, rid, "chat", max_tokens), request)

        def chunk(text: str, finish: str | None, ids: list[int] | None = None, role: bool = False) -> dict:
            delta = ({"role": "assistant", "content": text} if role else {"content": text}) if finish is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": self.model_name, "choices": [with_ids(choice, ids, req)]}

        if req.stream:
            return self.sse(handle, req, lambda: chunk("", None, role=True), chunk, "chat.completion.chunk")
        text, ids, last = await self.collect(handle, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [with_ids(choice, ids, req)], "usage": self.usage(last)}

    # ------------------------------------------------------------ request plumbing
    async def prepare(self, req, rid: str, endpoint: str, max_tokens: int | None) -> RequestSpec:
        """Validate and tokenize in a worker thread: a long prompt never stalls the event loop
        (other clients, /health)."""
        if req.model != self.model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                              "invalid_request_error", "model", "model_not_found")
        check_unsupported(req)
        to_ids, target = (chat_prompt_ids if endpoint == "chat" else completion_prompt_ids), self.runner.target

        def work() -> RequestSpec:
            try:
                ids = to_ids(req, target)
            except OpenAIError:
                raise
            except Exception as e:  # noqa: BLE001  (the tokenizer or template on odd input: log, generic 500)
                raise internal(rid, "tokenizing the prompt", e) from None
            return build_spec(req, ids, target, self.gamma, endpoint, max_tokens, rid)

        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, work)

    def submit(self, spec: RequestSpec, request: Request) -> Handle:
        """Hand the request to the engine, in the slot the Gate took for it."""
        try:
            return self.runner.submit(spec, asyncio.get_running_loop(), request.scope.get("state", {}).get("selfdraft_handle"))
        except RuntimeError as e:
            raise refusal(e) from e

    def usage(self, last: Delta) -> dict:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                "speculative": last.spec.as_dict(self.runner.drafter_name) if last.spec else None}

    async def deltas(self, handle: Handle, request: Request | None) -> AsyncIterator[Delta]:
        """The request's Deltas until the final one. If the consumer goes away (client disconnect:
        the stream task is cancelled, or `request` reports it), the request leaves the batch."""
        try:
            while True:
                if request is None:
                    d = await handle.queue.get()
                else:  # one pending get() across polls, so no Delta can be lost to a timeout
                    get = asyncio.ensure_future(handle.queue.get())
                    try:
                        while not (await asyncio.wait({get}, timeout=DISCONNECT_POLL_S))[0]:
                            if await request.is_disconnected():
                                return
                    finally:
                        get.cancel()  # no-op once done
                    d = get.result()
                handle.done = d.finished
                yield d
                if d.finished:
                    return
        finally:
            self.runner.cancel(handle)  # no-op once done

    async def collect(self, handle: Handle, request: Request) -> tuple[str, list[int], Delta]:
        parts, ids, last = [], [], None
        async for d in self.deltas(handle, request):
            parts.append(d.text)
            ids += d.token_ids
            last = d
        if last is None:  # the client left; nobody reads this response
            raise OpenAIError(499, "client disconnected", "invalid_request_error")
        if last.finish_reason in ("error", "cancelled"):
            raise failure(last, handle.spec.request_id)
        return "".join(parts), ids, last

    def sse(self, handle: Handle, req, first, chunk, obj: str) -> StreamingResponse:
        """Server-sent events: `first()` (a role chunk or None), one chunk per Delta with text, the
        final chunk (and usage when asked), an error event for a failed request, then [DONE]."""
        rid, ids = handle.spec.request_id, wants_ids(req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream() -> AsyncIterator[str]:
            head = first()
            if head is not None:
                yield event(head)
            async for d in self.deltas(handle, None):
                if d.text or (ids and d.token_ids):
                    yield event(chunk(d.text, None, d.token_ids))
                if d.finished and d.finish_reason in ("error", "cancelled"):
                    yield event(failure(d, rid).body())
                    break
                if d.finished:
                    yield event(chunk("", d.finish_reason))
                    if include_usage:
                        yield event({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                                     "choices": [], "usage": self.usage(d)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def openapi(self, app: FastAPI) -> dict:
        """FastAPI's document with the codes actually returned: request validation answers 400 (an
        OpenAI error object), never FastAPI's 422; `model` takes the one name this server serves."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in schema["paths"].values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            parts = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                parts.pop(name, None)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                parts[name]["properties"]["model"] = {"type": "string", "enum": [self.model_name], "title": "Model"}
            app.openapi_schema = schema
        return app.openapi_schema


def internal(rid: str, what: str, e: BaseException) -> OpenAIError:
    """A bug or an odd failure: the log gets the traceback, the client a request id."""
    log.error("request %s failed (%s)", rid, what, exc_info=e)
    return OpenAIError(500, f"internal error (request id {rid}); the server log has the details", "internal_error")


def refusal(e: RuntimeError) -> OpenAIError:
    """Why the engine takes no request now, as an OpenAI error (429 or 503)."""
    if isinstance(e, Overloaded):
        return OpenAIError(429, str(e), "rate_limit_error", None, "too_many_requests")
    if isinstance(e, ShuttingDown):
        return OpenAIError(503, str(e), "server_error", None, "shutting_down")
    if isinstance(e, EngineUnavailable):
        return OpenAIError(503, str(e), "server_error", None, "engine_unavailable")
    raise e


def failure(last: Delta, rid: str) -> OpenAIError:
    if last.finish_reason == "cancelled":
        return OpenAIError(503, last.error or "cancelled", "server_error", None, "shutting_down")
    return OpenAIError(500, f"{last.error or 'internal error'} (request id {rid})", "internal_error")


def wants_ids(req) -> bool:
    """Extension (as in vLLM): `"return_token_ids": true` adds each choice's generated token ids."""
    return bool((req.model_extra or {}).get("return_token_ids"))


def with_ids(choice: dict, ids: list[int] | None, req) -> dict:
    if ids is not None and wants_ids(req):
        choice["token_ids"] = ids
    return choice


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(runner: EngineLoop, model_name: str, api_key: str | None = None, gamma: int = DEFAULT_GAMMA,
               shutdown_grace_s: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S, open_metrics: bool = False) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine thread and, on shutdown, stops admitting,
    lets in-flight requests finish for up to shutdown_grace_s, cancels the rest and joins the thread
    (`GracefulServer` starts that drain when the server begins to stop, so streams cut by the grace
    period still end with an error event and [DONE])."""

    s = OpenAIServer(runner, model_name, api_key, gamma, max_body_bytes, open_metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        runner.start()
        yield
        await asyncio.to_thread(runner.shutdown, shutdown_grace_s)
        s.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="selfdraft", lifespan=lifespan)
    app.state.runner = runner
    for kind, handler in ((OpenAIError, s.on_openai_error), (RequestValidationError, s.on_validation_error),
                          (StarletteHTTPException, s.on_http_error), (Exception, s.on_internal_error)):
        app.add_exception_handler(kind, handler)
    app.add_middleware(Gate, server=s, body_timeout_s=body_timeout_s)
    app.get("/health", responses={503: {"description": "the engine failed for good or stopped"}})(s.health)
    app.get("/metrics", response_class=PlainTextResponse)(s.metrics_route)
    app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})(s.models)
    app.post("/v1/completions", responses=ERROR_RESPONSES)(s.completions)
    app.post("/v1/chat/completions", responses=ERROR_RESPONSES)(s.chat_completions)
    if runner.faults:
        app.post("/debug/fault", include_in_schema=False)(s.fault)
    app.openapi = lambda: s.openapi(app)  # type: ignore[method-assign]
    return app
