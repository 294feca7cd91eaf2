"""The OpenAI wire format: typed request bodies, error objects, and request -> RequestSpec validation.

Defaults here are the OpenAI API's (temperature 1, top_p 1) so that an OpenAI client behaves as it
does against OpenAI; the engine's own limits come from `GenerationConfig`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from selfdraft.config import MAX_LOGIT_BIAS, MAX_PENALTY, ConfigError, GenerationConfig, SamplingParams
from selfdraft.serve.engine_loop import RequestSpec
from selfdraft.target import Target

API_TEMPERATURE = 1.0  # OpenAI's default when a request omits temperature
MAX_TEMPERATURE = 2.0  # OpenAI's accepted range is [0, 2]
MAX_STOP_STRINGS = 4


class OpenAIError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error response (OpenAI's shape)."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


# Fields of the OpenAI API that would change the output and that a lossless speculative engine does
# not implement: a request that sets one (to anything but null / its neutral value) gets a 400 naming it.
UNSUPPORTED = ("response_format", "tools", "tool_choice", "functions", "function_call", "top_logprobs",
               "logprobs", "echo", "suffix", "parallel_tool_calls", "prediction", "audio", "modalities",
               "web_search_options", "reasoning_effort", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "repetition_penalty", "min_p")
NEUTRAL: dict[str, tuple] = {"logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "tools": ([],),
                             "functions": ([],), "parallel_tool_calls": (True, False), "tool_choice": ("none",),
                             "repetition_penalty": (1.0,), "min_p": (0.0,)}


def _bad_text(value: Any, where: str) -> str | None:
    """The location of the first string inside value that is not valid Unicode text (a lone
    surrogate such as "\\ud800", which JSON allows but UTF-8 cannot encode), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for k, v in value.items():
            key = str(k).encode("utf-8", "replace").decode()
            bad = _bad_text(k, where) or _bad_text(v, f"{where}.{key}" if where != "body" else key)
            if bad is not None:
                return bad
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = _bad_text(v, f"{where}.[{i}]")
            if bad is not None:
                return bad
    return None


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted and ignored, as OpenAI-compatible
    servers do; fields that would change the output and are not supported raise 400 (UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow", strict=True)  # no coercion: [[false]] is not token ids

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        bad = _bad_text(data, "body")
        if bad is not None:  # a 400 here, never a 500 from the tokenizer or the JSON encoder
            raise OpenAIError(400, f"{bad}: the text is not valid Unicode (a lone surrogate)",
                              "invalid_request_error", None if bad == "body" else bad, "invalid_unicode")
        return data

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM-style): 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # no coercion: [[false]] is not token ids
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # no coercion: [[false]] is not token ids
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


# ---------------------------------------------------------------- validation
def _bad(message: str, param: str | None, code: str | None = None, status: int = 400) -> OpenAIError:
    return OpenAIError(status, message, "invalid_request_error", param, code)


def check_unsupported(req: _Request) -> None:
    """400 naming the first output-changing field this server does not implement."""
    extra = req.model_extra or {}
    for name in UNSUPPORTED:
        value = extra.get(name)
        if value is not None and not any(value == n and type(value) is type(n) for n in NEUTRAL.get(name, ())):
            raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")


def completion_prompt_ids(req: CompletionRequest, target: Target) -> list[int]:
    """Prompt -> token ids (tokenizes: call it off the event loop)."""
    if req.best_of not in (None, 1):
        raise _bad("best_of must be 1 (one completion per request)", "best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _bad("one prompt per request (batched prompts are not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = target.encode_prompt(prompt, chat=False) if prompt else []
    else:
        ids = list(prompt)
        if any(not 0 <= t < target.vocab_size for t in ids):
            raise _bad(f"prompt token ids must be in [0, {target.vocab_size})", "prompt")
    if not ids:
        raise _bad("the prompt is empty", "prompt")
    return ids


def chat_prompt_ids(req: ChatCompletionRequest, target: Target) -> list[int]:
    """Messages -> token ids through the chat template (tokenizes: call it off the event loop)."""
    if not req.messages:
        raise _bad("messages must not be empty", "messages")
    msgs = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise _bad("only text content parts are supported", f"messages.[{i}].content")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return target.encode_prompt(msgs, chat=True)


def build_spec(req: _Request, prompt_ids: list[int], target: Target, gamma: int, endpoint: str,
               max_tokens: int | None, request_id: str = "") -> RequestSpec:
    """Sampling and limits of a request, checked against the target's context."""
    if req.n not in (None, 1):
        raise _bad("n must be 1 (one completion per request)", "n")
    temperature = API_TEMPERATURE if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise _bad(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise _bad(f"top_k must be >= 0 (0 or -1 = off), got {req.top_k}", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise _bad("seed must be in [0, 2^63)", "seed")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name) or 0.0
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise _bad(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", name)
        penalties[name] = value
    bias = []
    for key, value in (req.logit_bias or {}).items():
        # Length first: int() refuses strings over 4,300 digits (ValueError), and no id is that long.
        if (not (key.isascii() and key.isdigit()) or len(key.lstrip("0")) > len(str(target.vocab_size))
                or int(key.lstrip("0") or "0") >= target.vocab_size):
            raise _bad(f"logit_bias keys must be token ids in [0, {target.vocab_size}), got {key!r}", "logit_bias")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise _bad(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}",
                       "logit_bias")
        bias.append((int(key.lstrip("0") or "0"), value))
    if len({t for t, _ in bias}) != len(bias):
        raise _bad("logit_bias names a token id twice", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise _bad(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", "stop")
    P, ctx = len(prompt_ids), target.max_context
    prompt_param = "messages" if endpoint == "chat" else "prompt"
    if P >= ctx:
        raise _bad(f"the prompt has {P} tokens; this model's context is {ctx} tokens (room for at least one "
                   "generated token is needed)", prompt_param, "context_length_exceeded")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens is not None and P + max_tokens > ctx:
        raise _bad(f"the prompt ({P} tokens) plus max_tokens ({max_tokens}) exceeds this model's context of {ctx} "
                   f"tokens: lower max_tokens to {ctx - P} or less", "max_tokens", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(GenerationConfig().max_new_tokens, ctx - P)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=req.seed,
                                logit_bias=tuple(bias), **penalties)
        config = GenerationConfig(max_new_tokens=max_tokens, gamma=gamma)
    except ConfigError as e:  # the checks above should have caught it; never a 500 for bad input
        raise _bad(str(e), None) from e
    return RequestSpec(prompt_ids, params, config, tuple(stop), endpoint, request_id)


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """FastAPI's RequestValidationError (incl. malformed JSON) -> a 400 OpenAI error."""
    e = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return _bad(f"malformed JSON body: {e.get('msg')}", None, "invalid_json")
    where = ".".join(loc)
    return _bad(f"{where}: {e.get('msg')}" if where else str(e.get("msg")), where or None)
