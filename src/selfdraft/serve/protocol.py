"""The OpenAI wire format: typed request bodies, error objects, and request -> RequestSpec validation.

Defaults here are the OpenAI API's (temperature 1, top_p 1) so that an OpenAI client behaves as it
does against OpenAI; the engine's own limits come from `GenerationConfig`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from selfdraft.config import ConfigError, GenerationConfig, SamplingParams
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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted and ignored, as OpenAI-compatible
    servers do; fields that would change the output and are not supported raise 400."""

    model_config = ConfigDict(extra="allow")

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


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


# ---------------------------------------------------------------- validation
def _bad(message: str, param: str | None, code: str | None = None, status: int = 400) -> OpenAIError:
    return OpenAIError(status, message, "invalid_request_error", param, code)


def completion_prompt_ids(req: CompletionRequest, target: Target) -> list[int]:
    if req.echo:
        raise _bad("echo is not supported", "echo")
    if req.best_of not in (None, 1):
        raise _bad("best_of must be 1 (one completion per request)", "best_of")
    if req.logprobs is not None:
        raise _bad("logprobs are not supported", "logprobs")
    if req.suffix:
        raise _bad("suffix is not supported", "suffix")
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
    if req.logprobs:
        raise _bad("logprobs are not supported", "logprobs")
    if (req.model_extra or {}).get("tools"):
        raise _bad("tools are not supported", "tools")
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
               max_tokens: int | None) -> RequestSpec:
    """Sampling and limits of a request, checked against the target's context."""
    if req.n not in (None, 1):
        raise _bad("n must be 1 (one completion per request)", "n")
    temperature = API_TEMPERATURE if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise _bad(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise _bad(f"top_k must be >= 0 (0 or -1 = off), got {req.top_k}", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise _bad("seed must be in [0, 2^63)", "seed")
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
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=req.seed)
        config = GenerationConfig(max_new_tokens=max_tokens, gamma=gamma)
    except ConfigError as e:  # the checks above should have caught it; never a 500 for bad input
        raise _bad(str(e), None) from e
    return RequestSpec(prompt_ids, params, config, tuple(stop), endpoint)


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """FastAPI's RequestValidationError (incl. malformed JSON) -> a 400 OpenAI error."""
    e = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return _bad(f"malformed JSON body: {e.get('msg')}", None, "invalid_json")
    where = ".".join(loc)
    return _bad(f"{where}: {e.get('msg')}" if where else str(e.get("msg")), where or None)
