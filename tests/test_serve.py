"""`selfdraft serve`: the real server (uvicorn on a free loopback port) driven by the official
`openai` client. A tiny random Llama with a character tokenizer, saved to disk and loaded the way
the CLI loads a target (float32, so greedy output is exact and comparable with `selfdraft generate`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from selfdraft.cli import app as cli_app
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters.base import Drafter, Proposal
from selfdraft.engine import drafter_factory
from selfdraft.methods.eagle3.config import Eagle3Config
from selfdraft.scheduler import Scheduler
from selfdraft.serve import (
    MAX_BODY_BYTES,
    ConnectionLimits,
    EngineLoop,
    GracefulServer,
    RequestSpec,
    ServerMetrics,
    create_app,
    server_config,
)
from selfdraft.serve.text import TextStream
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from tests.conftest import tiny_llama
from tests.helpers import char_tokenizer
from tests.test_tree import ArgmaxTreeDrafter

KEY = "sk-test"
GAMMA = GenerationConfig().gamma
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = char_tokenizer()
    d = tmp_path_factory.mktemp("tiny-chat")
    tiny_llama(vocab=len(tok), hidden=32, layers=4, seed=3, max_pos=256).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(model_dir) -> Target:
    return Target.load(str(model_dir), dtype="float32")


class SlowNone(Drafter):
    """Plain decoding that takes at least `delay` per round: keeps requests in flight long enough to
    test admission limits, disconnects and shutdown deterministically."""

    name = "slow"

    def __init__(self, delay: float = 0.03) -> None:
        self.delay = delay

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        time.sleep(self.delay)
        return Proposal.empty()


@dataclass
class Server:
    url: str
    runner: EngineLoop
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(target: Target, make_drafter, name: str, api_key: str | None = KEY, max_concurrency: int = 8,
                 max_batch: int = 8, grace: float = 5.0, max_body_bytes: int = MAX_BODY_BYTES,
                 limits: ConnectionLimits = ConnectionLimits(), body_timeout: float = 30.0, open_metrics: bool = False,
                 kv_budget: int | None = None, faults: bool = False) -> Server:
    runner = EngineLoop(target, make_drafter, name, Scheduler("fixed"), max_batch, max_concurrency, ServerMetrics(GAMMA),
                        kv_budget=kv_budget, faults=faults)
    app = create_app(runner, "tiny", api_key, gamma=GAMMA, shutdown_grace_s=grace, max_body_bytes=max_body_bytes,
                     body_timeout_s=body_timeout, open_metrics=open_metrics)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = GracefulServer(server_config(app, log_level="warning", limits=limits), runner, grace)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started
    return Server(f"http://127.0.0.1:{sock.getsockname()[1]}", runner, server, thread)


@pytest.fixture(scope="module")
def servers(target):
    out = {name: start_server(target, drafter_factory(name, target), name, api_key=KEY if name == "ngram" else None)
           for name in ("ngram", "none")}
    yield out
    for s in out.values():
        s.stop()


@pytest.fixture(scope="module")
def srv(servers) -> Server:
    return servers["ngram"]


@pytest.fixture
def slow(target):
    s = start_server(target, lambda: SlowNone(), "slow", api_key=None, max_concurrency=2, max_batch=1, grace=5.0)
    yield s
    s.stop()


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].text if hasattr(c.choices[0], "text") else c.choices[0].delta.content or "")
                   for c in chunks if c.choices)
    return text, chunks


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# ---------------------------------------------------------------- incremental detokenization (pure)
def utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def feed(ts: TextStream, data: bytes) -> list[str]:
    return [ts.push(b) for b in data]


def test_text_stream_waits_for_whole_characters():
    ts = TextStream(utf8)
    pieces = feed(ts, "aé€b".encode())
    assert "".join(pieces) + ts.flush() == "aé€b" and "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # é is two bytes: nothing after the first one


def test_text_stream_cuts_at_stop_across_tokens_and_holds_possible_prefixes():
    ts = TextStream(utf8, stop=("END", "xyz"))
    pieces = feed(ts, b"abEN")
    assert "".join(pieces) == "ab"  # "EN" may start "END": held back
    assert ts.push(ord("D")) == "" and ts.stopped
    assert ts.push(ord("q")) == "" and ts.flush() == ""
    ts = TextStream(utf8, stop=("END",))
    assert "".join(feed(ts, b"abENx")) + ts.flush() == "abENx"  # not a stop after all: released
    ts = TextStream(lambda ids: "".join(["hello", " wor", "ld!"][i] for i in ids), stop=("lo w", "d!"))
    assert ts.push(0) == "hel" and ts.push(1) == "" and ts.stopped  # the stop string inside/over tokens


# ---------------------------------------------------------------- the OpenAI API
def test_models_health_and_auth(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = httpx.get(f"{srv.url}/health").json()
    assert h["status"] == "ok" and h["drafter"] == "ngram"
    with pytest.raises(openai.AuthenticationError):
        srv.client("sk-wrong").models.list()
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_greedy_chat_equals_selfdraft_generate(servers, model_dir, drafter):
    """Server output == `selfdraft generate` (the CLI, same saved target, float32) token for token."""
    s = servers[drafter]
    resp = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=60, temperature=0)
    res = CliRunner().invoke(cli_app, ["generate", "-p", PROMPT, "--target", str(model_dir), "--dtype", "float32",
                                       "--drafter", drafter, "-n", "60", "--json"])
    assert res.exit_code == 0, res.output
    ref = json.loads(res.stdout.strip().splitlines()[-1])  # stderr may carry notes (e.g. a scheduler profile)
    assert resp.choices[0].message.content == ref["text"]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == len(ref["token_ids"]) == 60
    assert resp.usage.prompt_tokens == len(ref["prompt_token_ids"])


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_greedy_completion_equals_single_request_decode(servers, target, drafter):
    s = servers[drafter]
    ids = target.encode_prompt(PROMPT, chat=False)
    ref = generate(target, drafter_factory(drafter, target)(), ids, SamplingParams(), GenerationConfig(max_new_tokens=50))
    resp = s.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=50, temperature=0)
    assert resp.choices[0].text == target.decode(ref.token_ids)
    spec = resp.usage.model_extra["speculative"]
    assert spec["drafter"] == drafter and spec["rounds"] == len(ref.rounds)
    assert spec["accepted_draft_tokens"] == sum(r.accepted for r in ref.rounds)
    assert spec["tau"] == pytest.approx(ref.tau)
    by_ids = s.client().completions.create(model="tiny", prompt=ids, max_tokens=50, temperature=0)
    assert by_ids.choices[0].text == resp.choices[0].text


def tree_drafter(kind: str, target: Target):
    """EAGLE-3 as a dynamic tree (random weights), or a tree whose best branch is the target's greedy path."""
    if kind == "oracle-tree":
        return lambda: ArgmaxTreeDrafter(target)
    torch.manual_seed(0)
    cfg = Eagle3Config(feature_layers=(0, 1, 2), gamma=4)
    model = STRATEGIES["eagle3"].build(cfg, target)

    def make():
        d = STRATEGIES["eagle3"].drafter(model, cfg, target)
        d.set_tree(depth=4, top_k=3, total_tokens=12)
        return d

    return make


@pytest.mark.parametrize("kind", ["eagle3-tree", "oracle-tree"])
def test_tree_drafter_served_equals_generate(target, kind):
    """Draft trees through the OpenAI endpoint (the batched engine, two requests in flight) give
    `generate`'s tokens and rounds (float32 greedy)."""
    make = tree_drafter(kind, target)
    s = start_server(target, make, kind, api_key=None)
    try:
        prompts = [PROMPT, "Jumps over the lazy dog"]
        refs = [generate(target, make(), target.encode_prompt(p, chat=False), SamplingParams(),
                         GenerationConfig(max_new_tokens=40, gamma=GAMMA)) for p in prompts]
        ask = lambda p: s.client().completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0)  # noqa: E731
        with ThreadPoolExecutor(2) as pool:
            resps = list(pool.map(ask, prompts))
        for resp, ref in zip(resps, refs):
            assert resp.choices[0].text == target.decode(ref.token_ids)
            spec = resp.usage.model_extra["speculative"]
            assert spec["rounds"] == len(ref.rounds) and spec["accepted_draft_tokens"] == sum(r.accepted for r in ref.rounds)
        if kind == "oracle-tree":
            assert all(ref.tau > 2.0 for ref in refs)  # multi-token paths were committed
    finally:
        s.stop()


def test_streaming_concatenation_equals_non_streamed(srv):
    c = srv.client()
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    text, chunks = stream_text(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0)
    text, chunks = stream_text(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0,
                                                         stream=True))
    assert text == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) > 3  # text arrives step by step


def test_token_ids_extension_accounts_for_every_token(srv, target):
    """`return_token_ids`: the streamed ids, concatenated, are the non-streamed ids, decode to the
    streamed text and number usage.completion_tokens (nothing lost or duplicated on the way)."""
    c, extra = srv.client(), {"return_token_ids": True}
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
    text, chunks = stream_text(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body=extra))
    ids = [t for ch in chunks if ch.choices for t in (ch.choices[0].model_extra.get("token_ids") or [])]
    assert ids == whole.choices[0].model_extra["token_ids"] and len(ids) == chunks[-1].usage.completion_tokens == 40
    assert target.decode(ids) == text == whole.choices[0].text


def test_stop_strings(srv):
    c = srv.client()
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0).choices[0].text
    stop = full[20:23]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop, "\x00never"],
                                 stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            text, chunks = stream_text(r)
            finish, usage = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1], chunks[-1].usage
        else:
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == expected and finish == "stop", stream
        assert len(expected) < usage.completion_tokens < 60  # the tokens up to the stop string, no more
    assert wait_until(lambda: not srv.runner.engine.active)  # stopped requests left the batch


def test_seed_reproducible_at_temperature_one(srv):
    c = srv.client()
    msgs = [{"role": "user", "content": PROMPT}]
    run = lambda seed: c.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=1.0,  # noqa: E731
                                                 top_p=0.95, seed=seed).choices[0].message.content
    a, b, other = run(7), run(7), run(8)
    assert a == b and a != other
    streamed, _ = stream_text(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=1.0,
                                                        top_p=0.95, seed=7, stream=True))
    assert streamed == a


def test_metrics_parse(srv):
    srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    text = httpx.get(f"{srv.url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    total = lambda name: sum(s.value for s in samples[name])  # noqa: E731
    assert total("selfdraft_requests_total") >= 1 and total("selfdraft_output_tokens_total") >= 20
    assert samples["selfdraft_spec_tau"][0].value >= 1.0
    assert {s.labels["position"] for s in samples["selfdraft_spec_acceptance_rate"]} >= {"1"}
    for name in ("selfdraft_verify_tokens_per_step_count", "selfdraft_time_to_first_token_seconds_count",
                 "selfdraft_request_latency_seconds_bucket", "selfdraft_queue_depth", "selfdraft_running_requests"):
        assert name in samples, name
    assert total("selfdraft_time_to_first_token_seconds_count") >= 1


BAD = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, None),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("max_tokens 0", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond context", {"model": "tiny", "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ("temperature too high", {"model": "tiny", "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("negative temperature", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("temperature not a number", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("top_p 0", {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above 1", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n 2", {"model": "tiny", "prompt": "hi", "n": 2}, 400, "n"),
    ("prompt too long", {"model": "tiny", "prompt": "x" * 300}, 400, "prompt"),
    ("empty prompt", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("token id out of vocab", {"model": "tiny", "prompt": [5, 100000]}, 400, "prompt"),
    ("no prompt", {"model": "tiny"}, 400, "prompt"),
    ("not an object", [1, 2], 400, None),
]


@pytest.mark.parametrize("case,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_server_survives(servers, case, body, status, param):
    s = servers["none"]
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{s.url}/v1/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert httpx.get(f"{s.url}/health").status_code == 200


def test_openai_client_raises_typed_errors_and_server_answers_after(servers):
    c = servers["none"].client()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="context") as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 300}])
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="stream"):
        c.completions.create(model="tiny", prompt="hi", stream="yes please")
    ok = c.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3 and not servers["none"].runner.in_flight


def test_too_many_concurrent_requests_get_429(slow):
    c = slow.client()
    streams = [c.completions.create(model="tiny", prompt="hi", max_tokens=200, temperature=0, stream=True)
               for _ in range(2)]  # admitted once the headers are back; limit 2: one decoding, one queued (max_batch 1)
    assert slow.runner.in_flight == 2
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=5)
    assert e.value.status_code == 429 and e.value.body["code"] == "too_many_requests"
    for st in streams:
        st.close()
    assert wait_until(lambda: slow.runner.in_flight == 0)
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_client_disconnect_mid_stream_frees_the_slot(slow):
    st = slow.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=200, temperature=0, stream=True)
    it = iter(st)
    next(it), next(it)
    assert slow.runner.engine.active
    st.close()
    assert wait_until(lambda: not slow.runner.engine.active and slow.runner.in_flight == 0)
    samples = {s.name + str(s.labels): s.value for f in text_string_to_metric_families(httpx.get(f"{slow.url}/metrics").text)
               for s in f.samples}
    assert samples["selfdraft_requests_total{'endpoint': 'chat', 'finish_reason': 'cancelled'}"] == 1


def test_graceful_shutdown_finishes_in_flight_stream(slow):
    st = slow.client().completions.create(model="tiny", prompt="hi", max_tokens=25, temperature=0, stream=True)
    it = iter(st)
    first = next(it)
    slow.server.should_exit = True  # what SIGINT/SIGTERM does
    rest = list(it)
    chunks = [first, *rest]
    assert chunks[-1].choices[0].finish_reason == "length"
    slow.thread.join(timeout=20)
    assert not slow.thread.is_alive() and not slow.runner._thread.is_alive()
    assert slow.runner.in_flight == 0


def sse_lines(response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_shutdown_past_the_grace_period_ends_the_stream_with_an_error_event_and_done(target):
    s = start_server(target, lambda: SlowNone(), "slow", api_key=None, grace=0.5)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        s.server.should_exit = True  # what SIGINT/SIGTERM does
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(first[6:])["choices"][0]["text"] is not None
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error"
    s.thread.join(timeout=20)
    assert not s.thread.is_alive() and not s.runner._thread.is_alive() and s.runner.in_flight == 0
    cancelled = [x for f in text_string_to_metric_families(s.runner.metrics.render().decode()) for x in f.samples
                 if x.name == "selfdraft_requests_total" and x.labels["finish_reason"] == "cancelled"]
    assert sum(x.value for x in cancelled) == 1


class Boom(Drafter):
    """Raises inside the engine step whenever the context holds token `bang` (a stand-in for a bug)."""

    name = "boom"

    def __init__(self, bang: int) -> None:
        self.bang = bang

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        if self.bang in tokens:
            raise RuntimeError("drafter exploded")
        return Proposal.empty()


def test_engine_failure_fails_the_request_alone_and_tells_the_client_nothing_internal(target, caplog):
    """A request whose drafter raises fails alone (500 / an error event then [DONE]) while requests in
    the same batch finish with their normal output; the client gets a request id, the log the details."""
    bang = target.tokenizer.convert_tokens_to_ids("!")
    s = start_server(target, lambda: Boom(bang), "boom", api_key=None, max_batch=8)
    try:
        c = s.client()
        expected = c.completions.create(model="tiny", prompt="fine", max_tokens=40, temperature=0).choices[0].text
        streams = [c.completions.create(model="tiny", prompt="fine", max_tokens=40, temperature=0, stream=True)
                   for _ in range(3)]  # all in flight (headers back) before the poisoned ones arrive
        with caplog.at_level("ERROR", logger="selfdraft.serve"):
            with pytest.raises(openai.InternalServerError, match="request id") as e:
                c.completions.create(model="tiny", prompt="boom!", max_tokens=5)
            assert "exploded" not in str(e.value.body) and "RuntimeError" not in str(e.value.body)
            with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "boom!", "max_tokens": 5, "stream": True}) as r:
                lines = sse_lines(r)
            assert lines[-1] == "data: [DONE]" and "exploded" not in "".join(lines)
            assert json.loads(lines[-2][6:])["error"]["type"] == "internal_error"
        assert [stream_text(st)[0] for st in streams] == [expected] * 3
        rid = e.value.body["message"].split("request id ")[1].split(")")[0]
        assert any(rid in r.getMessage() and r.exc_info and "exploded" in str(r.exc_info[1]) for r in caplog.records)
        ok = c.completions.create(model="tiny", prompt="fine", max_tokens=5, temperature=0)
        assert ok.usage.completion_tokens == 5 and s.runner.in_flight == 0
    finally:
        s.stop()


def test_parameters_at_the_edge_of_float_range_are_served_or_rejected(srv):
    """Temperatures too small for float32 are greedy; tiny top_p keeps the top token (= greedy);
    values the maths cannot honour get a 400 naming the field. The server serves on afterwards."""
    c = srv.client()
    greedy = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    for kw in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e-30},
               {"temperature": 1.0, "top_p": 1e-46}, {"temperature": 1.0, "top_p": 1e-300}):
        assert c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, **kw).choices[0].text == greedy, kw
    for body, param in (('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
                        ('"top_p": NaN', "top_p"), ('"presence_penalty": NaN', "presence_penalty"),
                        ('"frequency_penalty": 2.5', "frequency_penalty"), ('"logit_bias": {"5": NaN}', "logit_bias"),
                        ('"logit_bias": {"x": 1}', "logit_bias"), ('"logit_bias": {"99999": 1}', "logit_bias"),
                        ('"logit_bias": {"5": 101}', "logit_bias")):
        r = httpx.post(f"{srv.url}/v1/completions", headers={"authorization": f"Bearer {KEY}",
                                                             "content-type": "application/json"},
                       content=f'{{"model": "tiny", "prompt": "hi", {body}}}')
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


@pytest.mark.parametrize("field,value", [("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
                                         ("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("top_logprobs", 2),
                                         ("logprobs", True), ("function_call", "auto")])
def test_unsupported_output_changing_fields_get_400_naming_them(servers, field, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = httpx.post(f"{servers['none'].url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    neutral = {**body, "logprobs": False, "tools": None, "response_format": None}
    del neutral[field]
    assert httpx.post(f"{servers['none'].url}/v1/chat/completions", json=neutral).status_code == 200


def test_logit_bias_and_penalties_change_greedy_output_as_defined(srv, target):
    c = srv.client()
    plain = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0,
                                 extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    banned = plain[0]
    biased = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0,
                                  logit_bias={str(banned): -100}, extra_body={"return_token_ids": True})
    assert banned not in biased.choices[0].model_extra["token_ids"]
    ids = target.encode_prompt(PROMPT, chat=False)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((banned, -100.0),))
    ref = generate(target, drafter_factory("ngram", target)(), ids, params, GenerationConfig(max_new_tokens=30))
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, presence_penalty=1.0,
                               frequency_penalty=0.5, logit_bias={str(banned): -100},
                               extra_body={"return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == ref.token_ids != plain


@pytest.mark.parametrize("where", ["prompt", "messages", "stop", "model", "key"])
def test_lone_surrogates_get_400_and_the_connection_stays_open(servers, where):
    s = servers["none"]
    raw = {"prompt": '{"model": "tiny", "prompt": "a\\ud800b"}',
           "messages": '{"model": "tiny", "messages": [{"role": "user", "content": "x\\udfff"}]}',
           "stop": '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}',
           "model": '{"model": "\\ud800", "prompt": "hi"}',
           "key": '{"model": "tiny", "prompt": "hi", "\\ud800": 1}'}[where]
    endpoint = "chat/completions" if where == "messages" else "completions"
    with httpx.Client(timeout=30) as client:
        r = client.post(f"{s.url}/v1/{endpoint}", content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_unicode" and "surrogate" in err["message"]
        assert r.headers.get("connection") != "close"
        assert client.get(f"{s.url}/health").status_code == 200


def test_openapi_lists_the_codes_actually_returned(servers):
    doc = httpx.get(f"{servers['none'].url}/openapi.json").json()
    text = json.dumps(doc)
    assert "422" not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        codes = set(doc["paths"][path]["post"]["responses"])
        assert {"200", "400", "401", "404", "413", "429"} <= codes
    assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]


def sse_events(raw: str) -> list[dict]:
    """A text/event-stream body -> its events as {"event", "data"} (data lines joined), the way
    OpenAPI tools (schemathesis) parse a stream before checking each event against the document."""
    out = []
    for block in raw.strip().split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")]
        if data:
            out.append({"event": "message", "data": "\n".join(data)})
    return out


def conforms(value, schema: dict) -> bool:
    """The JSON-Schema keywords the stream schema uses (type, required, properties)."""
    types = {"object": dict, "string": str, "integer": int}
    if "type" in schema and not isinstance(value, types[schema["type"]]):
        return False
    if isinstance(value, dict):
        if any(k not in value for k in schema.get("required", ())):
            return False
        props = schema.get("properties", {})
        return all(conforms(v, props[k]) for k, v in value.items() if k in props)
    return True


def test_openapi_stream_schema_describes_each_event(servers):
    """The documented text/event-stream schema is the schema of one event (OpenAPI 3.1 tools read
    it so): every event of real streams, incl. the final [DONE], conforms to it (a bare
    {"type": "string"} does not: schemathesis reported ST108 on every stream)."""
    s = servers["none"]
    doc = httpx.get(f"{s.url}/openapi.json").json()
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": PROMPT})):
        schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        r = httpx.post(f"{s.url}{path}", json={"model": "tiny", "max_tokens": 4, "stream": True, **body}, timeout=30)
        events = sse_events(r.text)
        assert r.status_code == 200 and len(events) >= 3 and events[-1]["data"] == "[DONE]"
        assert all(conforms(e, schema) for e in events), (path, schema)
        assert not conforms("data: [DONE]", schema)  # the check can fail


def test_body_limit_413_and_health_stays_fast_while_a_large_prompt_is_tokenized(target):
    """A body over the limit gets 413 at once; a large body under it is tokenized off the event loop,
    so /health answers within 100 ms meanwhile."""
    s = start_server(target, drafter_factory("none", target), "none", api_key=None)
    try:
        url = f"{s.url}/v1/completions"
        big = {"model": "tiny", "prompt": "The quick brown fox. " * (800_000 // 21)}  # ~1 s of tokenizing on an idle CPU
        done: dict = {}

        def post(body) -> None:
            t0 = time.perf_counter()
            r = httpx.post(url, json=body, timeout=120)
            done.update(status=r.status_code, body=r.json(), seconds=time.perf_counter() - t0)

        th = threading.Thread(target=post, args=(big,))
        th.start()
        lat = []
        with httpx.Client(timeout=10) as client:
            while th.is_alive() or not lat:
                t0 = time.perf_counter()
                assert client.get(f"{s.url}/health").status_code == 200
                lat.append(time.perf_counter() - t0)
                time.sleep(0.02)
        th.join()
        assert done["status"] == 400 and done["body"]["error"]["code"] == "context_length_exceeded"
        assert len(lat) >= 5, done["seconds"]  # the health checks overlapped the request
        assert sorted(lat)[len(lat) // 2] < 0.1 and max(lat) < 0.5, (done["seconds"], sorted(lat)[-5:])
        huge = httpx.post(url, content=b'{"model": "tiny", "prompt": "' + b"x" * (2 * MAX_BODY_BYTES) + b'"}',
                          headers={"content-type": "application/json"}, timeout=60)
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_a_cancelled_request_frees_its_slot_at_once(target):
    """The in-flight slot is given back when the client goes, not at the engine's next step."""
    import asyncio

    runner = EngineLoop(target, lambda: SlowNone(), "slow", Scheduler("fixed"), 1, 2, ServerMetrics(GAMMA))
    loop = asyncio.new_event_loop()  # the engine thread is not started: nothing would free a slot but cancel()
    try:
        spec = RequestSpec([5, 6, 7], SamplingParams(), GenerationConfig(max_new_tokens=4))
        a, _ = runner.submit(spec, loop), runner.submit(spec, loop)
        runner.cancel(a)
        assert runner.in_flight == 1
        runner.submit(spec, loop)  # admitted: no 429
        runner.cancel(a)  # a second cancel gives nothing back twice
        assert runner.in_flight == 2
        runner._take_inbox(block=False)  # the engine thread's next look at its inbox: a never joined the batch
        runner._admit_waiting()
        counted = {tuple(x.labels.values()): x.value for f in text_string_to_metric_families(runner.metrics.render().decode())
                   for x in f.samples if x.name == "selfdraft_requests_total"}
        assert counted == {(spec.endpoint, "cancelled"): 1.0}  # counted once, though it never ran
    finally:
        loop.close()


@pytest.mark.parametrize("args,match", [(["--max-concurrency", "0"], "max-concurrency"),
                                        (["--prefill-chunk", "0"], "prefill-chunk"),
                                        (["--scheduler", "psychic"], "scheduler"),
                                        (["--drafter", "warp-drive"], "unknown drafter")])
def test_serve_command_reports_bad_options_without_traceback(model_dir, args, match):
    res = CliRunner().invoke(cli_app, ["serve", "--target", str(model_dir), "--dtype", "float32", *args])
    assert res.exit_code == 2 and "Traceback" not in res.output and match in res.output


def test_serve_command_end_to_end_and_sigterm(model_dir):
    """The real `selfdraft serve` process: answers the openai client, then exits cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SELFDRAFT_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "selfdraft", "serve", "--target", str(model_dir), "--dtype", "float32",
                             "--drafter", "ngram", "--port", str(port), "--threads", "1", "--log-level", "info"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _up(url), timeout=60), "server did not come up"
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        name = c.models.list().data[0].id
        assert name == model_dir.name
        text, _ = stream_text(c.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}],
                                                        max_tokens=12, temperature=0, stream=True))
        assert text
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        # uvicorn shuts down gracefully (lifespan: engine thread joined), then re-raises the signal
        assert proc.returncode in (0, -signal.SIGTERM), out
        assert "Application shutdown complete" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
