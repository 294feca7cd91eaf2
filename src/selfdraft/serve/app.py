"""The OpenAI-compatible HTTP API over an already-running `EngineLoop` (no model loading here).

POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events),
GET /v1/models, GET /health, GET /metrics. Every error is an OpenAI error object with a 4xx/5xx code.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfdraft.serve.engine_loop import Delta, EngineLoop, Handle, Overloaded, RequestSpec, ShuttingDown
from selfdraft.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    build_spec,
    chat_prompt_ids,
    completion_prompt_ids,
    validation_error,
)

DISCONNECT_POLL_S = 0.5  # non-streamed requests: how often to check whether the client is still there


def create_app(runner: EngineLoop, model_name: str, api_key: str | None = None, gamma: int = 7,
               shutdown_grace_s: float = 10.0) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine thread and, on shutdown, stops admitting,
    lets in-flight requests finish for up to shutdown_grace_s, cancels the rest and joins the thread."""

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
    def error_response(e: OpenAIError) -> JSONResponse:
        if e.status in (400, 401, 404, 429, 503):
            metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        return error_response(OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error"))

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

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "drafter": runner.drafter_name, "in_flight": runner.in_flight}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "selfdraft",
                "max_model_len": runner.target.max_context, "drafter": runner.drafter_name}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        ids = completion_prompt_ids(req, runner.target)
        spec = build_spec(req, ids, runner.target, gamma, "completions", req.max_tokens)
        handle = submit(spec)
        rid, include_usage = f"cmpl-{uuid.uuid4().hex}", bool(req.stream_options and req.stream_options.include_usage)

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

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        ids = chat_prompt_ids(req, runner.target)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        spec = build_spec(req, ids, runner.target, gamma, "chat", max_tokens)
        handle = submit(spec)
        rid, include_usage = f"chatcmpl-{uuid.uuid4().hex}", bool(req.stream_options and req.stream_options.include_usage)

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

    def failure(last: Delta) -> OpenAIError:
        if last.finish_reason == "cancelled":
            return OpenAIError(503, last.error or "cancelled", "server_error", None, "shutting_down")
        return OpenAIError(500, last.error or "internal error", "internal_error")

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
        parts, ids, last = [], [], None
        async for d in deltas(handle, request):
            parts.append(d.text)
            ids += d.token_ids
            last = d
        if last is None:  # the client left; nobody reads this response
            raise OpenAIError(499, "client disconnected", "invalid_request_error")
        if last.finish_reason in ("error", "cancelled"):
            raise failure(last)
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
                    yield event(failure(d).body())
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
