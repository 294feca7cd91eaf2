"""`selfdraft serve` under faults: a failing engine thread, hostile or slow clients, requests that
leave early, and the count of every request (docs/serve/faults.md lists each test with the
behaviour it pins down). Tiny random models (tests/test_serve.py's fixtures), loopback only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from selfdraft.cli import app as cli_app
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.engine import Engine
from selfdraft.methods.suffix.config import SuffixConfig
from selfdraft.methods.suffix.drafter import GlobalSuffixCache
from selfdraft.scheduler import Scheduler
from selfdraft.serve import ConnectionLimits, EngineLoop, RequestSpec, ServerMetrics, create_app
from selfdraft.serve.engine_loop import MAX_RESTARTS, OOM_ERROR
from selfdraft.serve.text import TextStream
from tests.test_serve import GAMMA, KEY, SlowNone, model_dir, start_server, target, wait_until  # noqa: F401

PROMPTS = ("Hi", "The quick brown fox jumps", "ok")


def counts(runner: EngineLoop) -> dict[str, float]:
    """selfdraft_requests_total by finish reason, selfdraft_rejected_requests_total by 'rejected STATUS'."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(runner.metrics.render().decode()):
        for x in fam.samples:
            if x.name == "selfdraft_requests_total":
                out[x.labels["finish_reason"]] = out.get(x.labels["finish_reason"], 0) + x.value
            elif x.name == "selfdraft_rejected_requests_total":
                out[f"rejected {x.labels['status']}"] = x.value
    return out


def stream_body(prompt: str, max_tokens: int = 30) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}


def read_stream(url: str, body: dict, out: dict, key: str | None = None) -> None:
    """POST a stream; out gets its text, its error object (if any) and whether it ended with [DONE]."""
    text, error, done = [], None, False
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=20) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text.append(event["choices"][0]["text"])
    out.update(text="".join(text), error=error, done=done)


def greedy(url: str, prompt: str, max_tokens: int = 30) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=20).json()["choices"][0]["text"]


def start_streams(url: str, prompts, max_tokens: int = 30) -> tuple[list[threading.Thread], list[dict]]:
    outs = [{} for _ in prompts]
    threads = [threading.Thread(target=read_stream, args=(url, stream_body(p, max_tokens), o)) for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    return threads, outs


# ---------------------------------------------------------------- 1. the engine thread
def test_a_failure_in_the_engine_inbox_restarts_the_engine_and_the_batch_resumes(target, monkeypatch):
    """An exception while the engine thread takes its inbox (here: in Engine.cancel, as an
    out-of-memory there would) no longer kills the thread: the engine restarts, the other requests
    resume with their uninterrupted greedy output, slots are freed, /health reports the restart."""
    s = start_server(target, lambda: SlowNone(0.02), "slow", api_key=None, max_batch=4)
    try:
        expected = [greedy(s.url, p, 80) for p in PROMPTS[:2]]
        real, calls = Engine.cancel, []

        def flaky(self, rid):
            calls.append(rid)
            if len(calls) == 1:
                raise RuntimeError("simulated failure in cancel")
            return real(self, rid)

        monkeypatch.setattr(Engine, "cancel", flaky)
        with httpx.stream("POST", f"{s.url}/v1/completions", json=stream_body("leaving", 200), timeout=20) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the response
            next(line for line in lines if line.startswith("data: "))
            threads, outs = start_streams(s.url, PROMPTS[:2], 80)
            assert wait_until(lambda: len(s.runner.engine.active) == 3)  # then the client leaves: a cancel
        for t in threads:
            t.join(timeout=30)
        assert calls and all(o["done"] and not o["error"] for o in outs)
        assert [o["text"] for o in outs] == expected  # resumed from their committed tokens: the same greedy text
        assert wait_until(lambda: s.runner.in_flight == 0)
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 200 and h.json()["restarts"] == 1 and h.json()["engine"] == "running"
        assert greedy(s.url, PROMPTS[0], 80) == expected[0]
    finally:
        s.stop()


def test_an_engine_that_keeps_failing_is_reported_dead_and_refuses_requests(target, monkeypatch):
    """When every restart fails at once, the engine gives up: open requests end with an error,
    /health answers 503 with engine "failed", new requests get 503 at once (not 429, not a hang)."""
    def broken(self):
        raise RuntimeError("simulated persistent failure")

    s = start_server(target, lambda: SlowNone(0.0), "slow", api_key=None)
    try:
        assert httpx.get(f"{s.url}/health").json()["status"] == "ok"
        monkeypatch.setattr(Engine, "step", broken)
        sent = 0
        while httpx.get(f"{s.url}/health").status_code == 200 and sent <= MAX_RESTARTS:
            out: dict = {}
            read_stream(s.url, stream_body("Hi"), out)  # each is retried once, then fails: it never hangs
            assert out["error"]["type"] == "internal_error" and out["done"]
            sent += 1
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and h.json()["engine"] == "failed" and h.json()["restarts"] == MAX_RESTARTS
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert s.runner.in_flight == 0
    finally:
        s.stop()


# ---------------------------------------------------------------- 2. auth, admission, slow clients
def test_auth_comes_before_the_body_is_parsed(target):
    s = start_server(target, lambda: SlowNone(0.0), "slow", api_key=KEY)
    try:
        r = httpx.post(f"{s.url}/v1/completions", content=b'{"model": "tiny", "prompt": ',
                       headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # not a 400 about the JSON
    finally:
        s.stop()


def test_admission_comes_before_tokenizing(target, monkeypatch):
    """With every slot taken, a request gets 429 without its prompt being tokenized."""
    s = start_server(target, lambda: SlowNone(0.05), "slow", api_key=None, max_concurrency=2, max_batch=1)
    tokenized = []
    real = target.encode_prompt
    monkeypatch.setattr(target, "encode_prompt", lambda *a, **k: tokenized.append(a) or real(*a, **k))
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
        streams = [c.completions.create(model="tiny", prompt="hi", max_tokens=200, temperature=0, stream=True)
                   for _ in range(2)]
        before = len(tokenized)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "tokenize me " * 100})
        assert r.status_code == 429 and len(tokenized) == before
        for st in streams:
            st.close()
    finally:
        s.stop()


def test_slow_headers_and_slow_bodies_are_cut_off(target):
    """A client that never finishes its headers has its connection closed after the header timeout;
    one that never finishes its body gets 408 after the body timeout; neither holds a slot."""
    limits = ConnectionLimits(header_timeout_s=0.5)
    s = start_server(target, lambda: SlowNone(0.0), "slow", api_key=None, limits=limits, body_timeout=0.5)
    port = int(s.url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
            t0 = time.monotonic()
            assert sock.recv(100) == b"" and time.monotonic() - t0 < 3  # closed by the server
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\"")
            reply = b""
            try:  # the answer, then the server closes the connection (or keeps it alive: read until quiet)
                while b"request_timeout" not in reply and (chunk := sock.recv(4096)):
                    reply += chunk
            except TimeoutError:
                pass
            assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        deadline = time.monotonic() + 3  # the request is counted just after its answer is sent
        while counts(s.runner).get("rejected 408") != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.runner.in_flight == 0
        assert counts(s.runner).get("rejected 408") == 1
        text = s.runner.metrics.render().decode()
        assert "selfdraft_header_timeouts_total 1.0" in text
    finally:
        s.stop()


def test_connections_beyond_the_limit_get_503(target):
    s = start_server(target, lambda: SlowNone(0.0), "slow", api_key=None, limits=ConnectionLimits(max_connections=2))
    port = int(s.url.rsplit(":", 1)[1])
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.2)
        assert httpx.get(f"{s.url}/health").status_code == 503  # uvicorn's limit_concurrency
        for sock in idle:
            sock.close()
        assert wait_until(lambda: httpx.get(f"{s.url}/health").status_code == 200)
    finally:
        s.stop()


# ---------------------------------------------------------------- 3. the suffix cache
def test_suffix_cache_is_bounded_by_bytes():
    """Responses near the context length would make 64 of them gigabytes: the byte bound evicts the oldest."""
    cache = GlobalSuffixCache(SuffixConfig(max_cached_mb=1))
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        cache.add(torch.randint(0, 5000, (1500,), generator=gen).tolist())  # ~36k nodes, ~10 MiB unbounded each
        assert cache.tree.bytes <= 1 << 20
    assert len(cache.responses) <= 1
    small = GlobalSuffixCache(SuffixConfig(max_cached_mb=1))
    for _ in range(3):
        small.add([1, 2, 3, 4])
    assert len(small.responses) == 3  # short responses still stay (the count bound is 64)


# ---------------------------------------------------------------- 4. a stream whose client left before it started
def test_a_stream_whose_client_left_before_its_generator_ran_frees_its_slot(target):
    """The client disconnects while the prompt is tokenized: the response's generator is cancelled
    before it ever runs, so its `finally` cannot clean up; the request must still leave the batch."""
    runner = EngineLoop(target, lambda: SlowNone(0.05), "slow", Scheduler("fixed"), 4, 4, ServerMetrics(GAMMA))
    app = create_app(runner, "tiny", None, gamma=GAMMA)
    body = json.dumps(stream_body("Hi", 200)).encode()

    async def scenario() -> None:
        runner.start()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                await asyncio.sleep(0.1)  # the stream task waits here while the disconnect is noticed

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        await app(scope, receive, send)
        for _ in range(100):  # the engine thread takes the cancel at its next look at the inbox
            if runner.in_flight == 0 and not runner.engine.active and counts(runner):
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(scenario())
        assert runner.in_flight == 0 and not runner.engine.active  # not decoding 200 tokens for nobody
        assert counts(runner) == {"cancelled": 1}
    finally:
        runner.shutdown(0)


# ---------------------------------------------------------------- 5. authentication defaults
def test_with_a_key_metrics_and_api_docs_need_it_unless_metrics_are_opened(target):
    s = start_server(target, lambda: SlowNone(0.0), "slow", api_key=KEY)
    opened = start_server(target, lambda: SlowNone(0.0), "slow", api_key=KEY, open_metrics=True)
    auth = {"authorization": f"Bearer {KEY}"}
    try:
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert httpx.get(f"{s.url}{path}").status_code == 401, path
            assert httpx.get(f"{s.url}{path}", headers=auth).status_code == 200, path
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{opened.url}/metrics").status_code == 200
        assert httpx.get(f"{opened.url}/openapi.json").status_code == 401
    finally:
        s.stop()
        opened.stop()


def busy_port() -> socket.socket:
    """A bound loopback socket: a server that would start on its port fails instead of serving forever."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("env,args", [({"SELFDRAFT_API_KEY": ""}, []), ({}, ["--api-key", " "])], ids=["env", "option"])
def test_an_empty_api_key_is_an_error_not_an_open_server(model_dir, env, args):  # noqa: F811
    with busy_port() as sock:
        res = CliRunner().invoke(cli_app, ["serve", "--target", str(model_dir), "--dtype", "float32",
                                           "--port", str(sock.getsockname()[1]), *args], env=env)
    assert res.exit_code == 2 and "API key" in res.output and "empty" in res.output, res.output
    assert "Traceback" not in res.output


def test_a_non_loopback_host_without_a_key_warns(model_dir):  # noqa: F811
    res = CliRunner().invoke(cli_app, ["serve", "--target", str(model_dir), "--dtype", "float32", "--host", "0.0.0.0",
                                       "--drafter", "warp-drive"],  # fails before binding anything
                             env={"SELFDRAFT_API_KEY": None})
    assert res.exit_code == 2 and "warning: serving on 0.0.0.0 without an API key" in res.output, res.output


# ---------------------------------------------------------------- 6. logit_bias keys
def test_a_logit_bias_key_of_thousands_of_digits_is_a_400(target):
    s = start_server(target, lambda: SlowNone(0.0), "slow", api_key=None)
    try:
        for key in ("9" * 5000, "0" * 5000 + "5"):
            r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                           "logit_bias": {key: 1}})
            expected = 400 if key.startswith("9") else 200  # leading zeros: token 5
            assert r.status_code == expected and (expected == 200 or r.json()["error"]["param"] == "logit_bias"), r.text
    finally:
        s.stop()


# ---------------------------------------------------------------- 7. incremental detokenization
def test_detokenizing_costs_constant_work_per_token_and_gives_the_same_text(target):
    """Decoding work per token does not grow with the output (it ran in the engine thread, stalling
    the batch); the pieces still add up to decode(all tokens), with stop strings held back as before."""
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return target.decode(ids)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, target.vocab_size, (3000,), generator=gen).tolist()
    ts = TextStream(decode, stop=("never appears \x00",))
    pieces = [ts.push(t) for t in ids] + [ts.flush()]
    assert "".join(pieces) == target.decode(ids)
    assert sum(decoded) < 10 * len(ids), sum(decoded)  # re-decoding everything: ~n^2/2 = 4.5M


@pytest.mark.slow
def test_incremental_text_equals_full_decode_with_a_byte_level_tokenizer(embedded_dir):
    """Byte-level BPE (multi-byte characters split across tokens, leading spaces): the pieces equal
    the tokenizer's own decode of the whole output."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    text = "Grüße, 世界! 🙂 naïve café — ünïcödé\n  indented\tcode()"
    ids = tok.encode(text)
    gen = torch.Generator().manual_seed(2)
    ids += torch.randint(0, tok.vocab_size, (500,), generator=gen).tolist()
    ts = TextStream(lambda x: tok.decode(x, skip_special_tokens=True))
    assert "".join([ts.push(t) for t in ids] + [ts.flush()]) == tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- 8. every request counted once
def test_a_non_streamed_request_cancelled_at_shutdown_is_counted_once(target):
    s = start_server(target, lambda: SlowNone(0.05), "slow", api_key=None, grace=0.3)
    out: dict = {}

    def post() -> None:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 200}, timeout=30)
        out["status"] = r.status_code

    th = threading.Thread(target=post)
    th.start()
    assert wait_until(lambda: s.runner.engine.active)
    s.stop()
    th.join(timeout=30)
    assert out["status"] == 503
    assert counts(s.runner) == {"cancelled": 1}  # not also "rejected 503"


def test_requests_that_fail_to_join_or_are_cleared_at_shutdown_are_counted(target):
    calls = []

    def drafter():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure making a drafter")
        return SlowNone(0.05)

    runner = EngineLoop(target, drafter, "slow", Scheduler("fixed"), 1, 8, ServerMetrics(GAMMA))
    loop = asyncio.new_event_loop()
    try:
        runner.start()
        spec = RequestSpec([5, 6, 7], SamplingParams(), GenerationConfig(max_new_tokens=100))
        for _ in range(5):  # the 1st runs, the 2nd fails to join, the rest wait behind the 1st (batch of 1)
            runner.submit(spec, loop)
        assert wait_until(lambda: runner.engine.active)
        runner.shutdown(0)
        assert counts(runner) == {"error": 1, "cancelled": 4} and runner.in_flight == 0
    finally:
        loop.close()


# ---------------------------------------------------------------- 9. out of memory in the batch
def test_out_of_memory_in_the_shared_forward_fails_only_the_longest_request(target, monkeypatch):
    """An out-of-memory in the batched verification forward: the request with the longest context
    fails with a clear error; the other decoding request and the one still waiting to be
    prefilled finish with their uninterrupted greedy output."""
    s = start_server(target, lambda: SlowNone(0.02), "slow", api_key=None, max_batch=2)
    try:
        prompts = ("Hi", "The quick brown fox jumps over the lazy dog", "ok")
        expected = [greedy(s.url, p) for p in prompts]
        real, fired = Engine._verify_forward, []

        def oom_once(self, blocks, reqs):
            if len(reqs) == 2 and self.pending and not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(self, blocks, reqs)

        monkeypatch.setattr(Engine, "_verify_forward", oom_once)
        threads, outs = start_streams(s.url, prompts)
        for t in threads:
            t.join(timeout=30)
        assert fired
        assert outs[1]["error"]["message"].startswith(OOM_ERROR) and outs[1]["done"]
        assert not outs[0]["error"] and not outs[2]["error"] and outs[0]["done"] and outs[2]["done"]
        assert [outs[0]["text"], outs[2]["text"]] == [expected[0], expected[2]]
        assert httpx.get(f"{s.url}/health").json()["restarts"] == 1
    finally:
        s.stop()


def test_admission_keeps_the_padded_kv_cache_within_its_budget(target, monkeypatch):
    """Rows are padded to the longest: with a budget of two requests' reach, a third waits."""
    reach = len(target.encode_prompt("Hi", chat=False)) + 30
    s = start_server(target, lambda: SlowNone(0.01), "slow", api_key=None, max_batch=4, kv_budget=2 * reach + 5)
    widest, real = [], Engine.step

    def step(self):
        widest.append(len(self.active) + len(self.pending))
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    try:
        threads, outs = start_streams(s.url, ["Hi"] * 4)
        for t in threads:
            t.join(timeout=30)
        assert all(o["done"] and not o["error"] and o["text"] == outs[0]["text"] for o in outs)
        assert max(widest) == 2
    finally:
        s.stop()
