"""The OpenAI-compatible HTTP API over an already-running `EngineLoop` (no model loading here).

POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events),
GET /v1/models, GET /health, GET /metrics. Every error is an OpenAI error object with a 4xx/5xx code;
the text of an internal exception never reaches a client (it is logged with the request id).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfdraft.config import DEFAULT_GAMMA
from selfdraft.serve.engine_loop import Delta, EngineLoop, Handle, Overloaded, RequestSpec, ShuttingDown
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
ERROR_CODES = (400, 401, 404, 413, 429, 503)  # what the API returns besides 200 (and 500 for a bug)
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
    413: {"model": ErrorBody, "description": "request body above the size limit"},
    429: {"model": ErrorBody, "description": "too many requests in flight"},
    503: {"model": ErrorBody, "description": "the server is shutting down"},
}


def create_app(runner: EngineLoop, model_name: str, api_key: str | None = None, gamma: int = DEFAULT_GAMMA,
               shutdown_grace_s: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine thread and, on shutdown, stops admitting,
    lets in-flight requests finish for up to shutdown_grace_s, cancels the rest and joins the thread
    (`GracefulServer` starts that drain when the server begins to stop, so streams cut by the grace
    period still end with an error event and [DONE])."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        runner.start()
        yield
        await asyncio.to_thread(runner.shutdown, shutdown_grace_s)

    app = FastAPI(title="selfdraft", lifespan=lifespan)
    app.state.runner = runner
    created = int(time.time())
    metrics = runner.metrics

    # ------------------------------------------------------------ errors: always OpenAI objects
    def error_response(e: OpenAIError, headers: dict | None = None) -> JSONResponse:
        if e.status in ERROR_CODES:
            metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        if e.status_code == 413:
            return error_response(too_large)
        return error_response(OpenAIError(e.status_code, str(e.detail), kind), e.headers)  # e.g. 405's Allow

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:  # a bug: log it, say nothing
        return error_response(internal(f"req-{uuid.uuid4().hex}", request.url.path, e))

    def internal(rid: str, what: str, e: BaseException) -> OpenAIError:
        log.error("request %s failed (%s)", rid, what, exc_info=e)
        return OpenAIError(500, f"internal error (request id {rid}); the server log has the details", "internal_error")

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                              "invalid_request_error", None, "invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                              "invalid_request_error", "model", "model_not_found")

    def submit(spec: RequestSpec) -> Handle:
        try:
            return runner.submit(spec, asyncio.get_running_loop())
        except Overloaded as e:
            raise OpenAIError(429, str(e), "rate_limit_error", None, "too_many_requests") from e
        except ShuttingDown as e:
            raise OpenAIError(503, str(e), "server_error", None, "shutting_down") from e

    too_large = OpenAIError(413, f"the request body exceeds this server's limit of {max_body_bytes} bytes",
                            "invalid_request_error", None, "request_too_large")

    class BodyLimit:
        """413 (an OpenAI error object) for a body over max_body_bytes: at once when Content-Length
        says so, else as soon as the streamed body passes the limit (the handler's error path)."""

        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > max_body_bytes:
                return await error_response(too_large)(scope, receive, send)
            seen = 0

            async def limited():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > max_body_bytes:
                        raise StarletteHTTPException(413)
                return message

            await self.inner(scope, limited, send)

    app.add_middleware(BodyLimit)

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "drafter": runner.drafter_name, "in_flight": runner.in_flight}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorize)], responses={401: ERROR_RESPONSES[401]})
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "selfdraft",
                "max_model_len": runner.target.max_context, "drafter": runner.drafter_name}
        return {"object": "list", "data": [card]}

    async def prepare(req, rid: str, endpoint: str, max_tokens: int | None) -> RequestSpec:
        """Validate and tokenize in a worker thread: a long prompt never stalls the event loop
        (other clients, /health)."""
        check_model(req.model)
        check_unsupported(req)
        to_ids = chat_prompt_ids if endpoint == "chat" else completion_prompt_ids

        def work() -> RequestSpec:
            try:
                ids = to_ids(req, runner.target)
            except OpenAIError:
                raise
            except Exception as e:  # noqa: BLE001  (the tokenizer or template on odd input: log, generic 500)
                raise internal(rid, "tokenizing the prompt", e) from None
            return build_spec(req, ids, runner.target, gamma, endpoint, max_tokens, rid)

        return await asyncio.to_thread(work)

    @app.post("/v1/completions", dependencies=[Depends(authorize)], responses=ERROR_RESPONSES)
    async def completions(req: CompletionRequest, request: Request):
        rid, include_usage = f"cmpl-{uuid.uuid4().hex}", bool(req.stream_options and req.stream_options.include_usage)
        handle = submit(await prepare(req, rid, "completions", req.max_tokens))

        def chunk(text: str, finish: str | None, ids: list[int] | None = None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                    "choices": [with_ids(choice, ids, req)]}

        if req.stream:
            return sse(handle, lambda: None, chunk, rid, "text_completion", include_usage, wants_ids(req))
        text, ids, last = await collect(handle, request)
        body = chunk(text, last.finish_reason, ids)
        body["usage"] = usage(last)
        return body

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], responses=ERROR_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        rid, include_usage = f"chatcmpl-{uuid.uuid4().hex}", bool(req.stream_options and req.stream_options.include_usage)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        handle = submit(await prepare(req, rid, "chat", max_tokens))

        def chunk(text: str, finish: str | None, ids: list[int] | None = None, role: bool = False) -> dict:
            delta = ({"role": "assistant", "content": text} if role else {"content": text}) if finish is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                    "choices": [with_ids(choice, ids, req)]}

        if req.stream:
            return sse(handle, lambda: chunk("", None, role=True), chunk, rid, "chat.completion.chunk", include_usage,
                       wants_ids(req))
        text, ids, last = await collect(handle, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [with_ids(choice, ids, req)], "usage": usage(last)}

    def openapi() -> dict:
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
                parts[name]["properties"]["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    # ------------------------------------------------------------ request plumbing
    def wants_ids(req) -> bool:
        """Extension (as in vLLM): `"return_token_ids": true` adds each choice's generated token ids."""
        return bool((req.model_extra or {}).get("return_token_ids"))

    def with_ids(choice: dict, ids: list[int] | None, req) -> dict:
        if ids is not None and wants_ids(req):
            choice["token_ids"] = ids
        return choice

    def usage(last: Delta) -> dict:
        return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                "speculative": last.spec.as_dict(runner.drafter_name) if last.spec else None}

    def failure(last: Delta, rid: str) -> OpenAIError:
        if last.finish_reason == "cancelled":
            return OpenAIError(503, last.error or "cancelled", "server_error", None, "shutting_down")
        return OpenAIError(500, f"{last.error or 'internal error'} (request id {rid})", "internal_error")

    async def deltas(handle: Handle, request: Request | None) -> AsyncIterator[Delta]:
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
            runner.cancel(handle)  # no-op once done

    async def collect(handle: Handle, request: Request) -> tuple[str, list[int], Delta]:
        rid = handle.spec.request_id
        parts, ids, last = [], [], None
        async for d in deltas(handle, request):
            parts.append(d.text)
            ids += d.token_ids
            last = d
        if last is None:  # the client left; nobody reads this response
            raise OpenAIError(499, "client disconnected", "invalid_request_error")
        if last.finish_reason in ("error", "cancelled"):
            raise failure(last, rid)
        return "".join(parts), ids, last

    def sse(handle: Handle, first, chunk, rid: str, obj: str, include_usage: bool, ids: bool) -> StreamingResponse:
        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def stream() -> AsyncIterator[str]:
            head = first()
            if head is not None:
                yield event(head)
            async for d in deltas(handle, None):
                if d.text or (ids and d.token_ids):
                    yield event(chunk(d.text, None, d.token_ids))
                if d.finished and d.finish_reason in ("error", "cancelled"):
                    yield event(failure(d, rid).body())
                    break
                if d.finished:
                    yield event(chunk("", d.finish_reason))
                    if include_usage:
                        yield event({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                     "choices": [], "usage": usage(d)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
