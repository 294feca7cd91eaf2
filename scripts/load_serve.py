"""Bounded load run against a running `selfdraft serve` (loopback), with the official openai client.

N concurrent streaming clients share M greedy chat requests (prompts from the bundled sets, first
turns). Measures failed requests, time to first token (client side: first non-empty text), per-user
tokens/s and aggregate tokens/s. With --check, the streams also carry the generated token ids (the
`return_token_ids` extension): they must number usage.completion_tokens and decode to exactly the
streamed text (no token lost or duplicated on the way); then each prompt is sent once more, alone
(one request at a time, non-streamed), and compared token for token with what it gave under load.
Server-side τ and verify tokens per step: /metrics.
With --poison-every S, one more client sends a request with hostile parameters every S seconds
(temperatures and top_p below float32's range, NaN, lone surrogates, unsupported fields): each must
get its expected status (200 or 400) while every other request still finishes normally. With
--big-body-mb, /health latency is measured first while a request that large is rejected (413).
With --duration S (a soak), the clients send requests for S seconds instead of --requests: every
--cancel-every'th one drops its stream after two chunks, every --nonstream-every'th one is not
streamed; --server-pid samples the server's RSS every --rss-every seconds; at the end every request
sent (load, dropped, hostile) must be counted once in /metrics (selfdraft_requests_total +
selfdraft_rejected_requests_total).

    python scripts/load_serve.py --url http://127.0.0.1:8000 --clients 16 --requests 32 --max-tokens 48 \
        --check --out runs/serve/dspark.json
    python scripts/load_serve.py --clients 8 --duration 1800 --cancel-every 5 --nonstream-every 4 \
        --poison-every 10 --server-pid PID --out runs/serve/soak.json

Deliberately light: no torch import, so the client does not compete with the server for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai
import platformdirs
from tokenizers import Tokenizer
from prometheus_client.parser import text_string_to_metric_families

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "src" / "selfdraft" / "bench" / "prompts"


@dataclass
class Sample:
    index: int
    prompt: int  # index into the prompt list
    ok: bool
    kind: str = "stream"  # stream | nonstream | dropped (the client closes the stream after two chunks)
    error: str = ""
    text: str = ""
    token_ids: list[int] | None = None  # with --check: the `return_token_ids` extension
    chunks: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    start: float = 0.0
    first: float = 0.0  # first non-empty text chunk
    end: float = 0.0


def load_prompts(names: str, per_set: int) -> list[str]:
    out = []
    for name in names.split(","):
        lines = (PROMPTS_DIR / f"{name.strip()}.jsonl").read_text().splitlines()
        out += [json.loads(x)["turns"][0] for x in lines if x.strip()][:per_set]
    return out


def default_tokenizer() -> Path:
    root = os.environ.get("SELFDRAFT_CACHE") or platformdirs.user_cache_dir("selfdraft")
    return Path(root) / "targets" / "smollm2-135m-instruct" / "tokenizer.json"


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """Each sample of /metrics by name (labels summed), and by name{label=value,...} too."""
    flat: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=headers, timeout=30).text):
        for s in fam.samples:
            flat[s.name] = flat.get(s.name, 0.0) + s.value
            if s.labels:
                key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                flat[key] = flat.get(key, 0.0) + s.value
    return flat


async def one(client, model, i, p, prompt, max_tokens, stream: bool, ids: bool, drop_after: int = 0) -> Sample:
    s = Sample(i, p, False, kind="dropped" if drop_after else "stream" if stream else "nonstream", start=time.perf_counter())
    msgs = [{"role": "user", "content": prompt}]
    extra = {"return_token_ids": True} if ids else None
    try:
        if stream:
            resp = await client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        extra_body=extra)
            parts, s.token_ids = [], [] if ids else None
            async for ch in resp:
                if ch.usage is not None:
                    s.completion_tokens = ch.usage.completion_tokens
                if not ch.choices:
                    continue
                piece = ch.choices[0].delta.content or ""
                if piece and not s.first:
                    s.first = time.perf_counter()
                parts.append(piece)
                if ids:
                    s.token_ids += ch.choices[0].model_extra.get("token_ids") or []
                s.chunks += 1
                s.finish_reason = ch.choices[0].finish_reason or s.finish_reason
                if drop_after and s.chunks >= drop_after:
                    await resp.close()  # the client goes away mid-response
                    s.ok, s.end = True, time.perf_counter()
                    return s
            s.text = "".join(parts)
        else:
            resp = await client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                                        extra_body=extra)
            s.text, s.finish_reason = resp.choices[0].message.content, resp.choices[0].finish_reason
            s.token_ids = resp.choices[0].model_extra.get("token_ids") if ids else None
            s.completion_tokens, s.first = resp.usage.completion_tokens, time.perf_counter()
        s.ok = s.finish_reason in ("stop", "length") and s.completion_tokens > 0
        s.error = "" if s.ok else f"finish_reason={s.finish_reason!r}, completion_tokens={s.completion_tokens}"
    except Exception as e:  # every failure is counted, none aborts the run
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.perf_counter()
    return s


async def run_phase(client, model, prompts, requests, clients, max_tokens, stream, ids, duration: float = 0.0,
                    cancel_every: int = 0, nonstream_every: int = 0) -> tuple[list[Sample], float]:
    """`requests` requests over `clients` workers; with `duration`, as many as they send in that time."""
    counter = iter(range(10**9 if duration else requests))
    deadline = time.perf_counter() + duration
    done: list[Sample] = []

    async def worker():
        for i in counter:
            if duration and time.perf_counter() >= deadline:
                return
            drop = 2 if cancel_every and i % cancel_every == cancel_every - 1 else 0
            streamed = stream and not (nonstream_every and not drop and i % nonstream_every == nonstream_every - 1)
            done.append(await one(client, model, i, i % len(prompts), prompts[i % len(prompts)], max_tokens,
                                  streamed, ids, drop))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return sorted(done, key=lambda s: s.index), time.perf_counter() - t0


# (label, JSON fragment sent raw: NaN and lone surrogates are not valid for the openai client, status expected)
POISON = [
    ("temperature 1e-40", '"temperature": 1e-40', 200),
    ("temperature 5e-324", '"temperature": 5e-324', 200),
    ("top_p 1e-46", '"temperature": 1, "top_p": 1e-46', 200),
    ("top_p 1e-300", '"temperature": 1, "top_p": 1e-300', 200),
    ("temperature NaN", '"temperature": NaN', 400),
    ("presence_penalty NaN", '"presence_penalty": NaN', 400),
    ("lone surrogate", '"stop": ["\\ud800"]', 400),
    ("logit_bias junk", '"logit_bias": {"abc": 1e308}', 400),
    ("response_format", '"response_format": {"type": "json_object"}', 400),
]


async def poisoner(url: str, key: str, model: str, every: float, stop: asyncio.Event,
                   max_pending: int = 8) -> tuple[list[dict], int]:
    """One client that sends the next hostile request every `every` seconds without waiting for the
    replies, but with at most `max_pending` of its own in flight (a tick is skipped and counted while
    that many are pending: on a starved server the run then measures hostile input, not admission
    control). Returns the replies and the number of skipped ticks."""
    async with httpx.AsyncClient(timeout=600) as c:
        async def send(label: str, fragment: str, expected: int) -> dict:
            body = (f'{{"model": {json.dumps(model)}, "max_tokens": 4, '
                    f'"messages": [{{"role": "user", "content": "Hi"}}], {fragment}}}')
            try:
                r = await c.post(f"{url}/v1/chat/completions", content=body.encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
                status = r.status_code
            except httpx.HTTPError as e:
                status = f"{type(e).__name__}"
            return {"label": label, "status": status, "expected": expected}

        tasks, k, skipped = [], 0, 0
        while not stop.is_set():
            if sum(not t.done() for t in tasks) < max_pending:
                tasks.append(asyncio.create_task(send(*POISON[k % len(POISON)])))
                k += 1
            else:
                skipped += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=every)
            except asyncio.TimeoutError:
                pass
        return list(await asyncio.gather(*tasks)), skipped


def health_during_big_body(url: str, key: str, model: str, megabytes: float, chunked: bool) -> dict:
    """/health latency (client side, polled every 10 ms) while one thread posts a chat request whose
    body is `megabytes` MB (over the default 1 MiB limit: expected 413), with a Content-Length header
    or, `chunked`, without one (the server must read up to its limit before it can refuse)."""
    text = "The quick brown fox jumps over the lazy dog. " * int(megabytes * 1e6 / 45 + 1)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()
    tag = "chunked" if chunked else "sized"
    out: dict = {f"big_body_{tag}_bytes": len(body)}

    def pieces():
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    def post() -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(f"{url}/v1/chat/completions", content=pieces() if chunked else body, timeout=300,
                           headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
            out[f"big_body_{tag}_status"] = r.status_code
        except httpx.HTTPError as e:  # a server may close the connection while the client still sends
            out[f"big_body_{tag}_status"] = type(e).__name__
        out[f"big_body_{tag}_s"] = time.perf_counter() - t0

    th = threading.Thread(target=post)
    lat = []
    with httpx.Client(timeout=30) as c:
        c.get(f"{url}/health")  # connection open before the clock starts
        th.start()
        while th.is_alive():
            t0 = time.perf_counter()
            c.get(f"{url}/health").raise_for_status()
            lat.append(1000 * (time.perf_counter() - t0))
            time.sleep(0.01)
    th.join()
    out.update({f"{tag}_health_checks": len(lat),
                f"{tag}_health_ms_median": statistics.median(lat) if lat else None,
                f"{tag}_health_ms_max": max(lat) if lat else None})
    return out


async def rss_sampler(pid: int, every: float, stop: asyncio.Event) -> list[tuple[float, float]]:
    """(seconds since start, RSS in MB) of process `pid` every `every` seconds, until `stop`."""
    out, t0 = [], time.perf_counter()
    while True:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out.append((round(time.perf_counter() - t0, 1), int(line.split()[1]) / 1024))
        try:
            await asyncio.wait_for(stop.wait(), timeout=every)
            return out
        except asyncio.TimeoutError:
            pass


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", default="mt-bench,humaneval,gsm8k", help="bundled prompt sets (first turns)")
    ap.add_argument("--per-set", type=int, default=6, help="prompts taken from each set")
    ap.add_argument("--check", action="store_true", help="then send each prompt non-streamed and compare")
    ap.add_argument("--tokenizer", type=Path, default=default_tokenizer(), help="tokenizer.json of the target (--check)")
    ap.add_argument("--out", type=Path, default=None, help="write all samples and the summary as JSON")
    ap.add_argument("--poison-every", type=float, default=0.0, help="one more client: a hostile request every S seconds")
    ap.add_argument("--big-body-mb", type=float, default=0.0,
                    help="first: /health latency while a request of this many MB is posted (and rejected, 413)")
    ap.add_argument("--duration", type=float, default=0.0, help="a soak: send requests for S seconds (not --requests)")
    ap.add_argument("--cancel-every", type=int, default=0, help="every Nth request drops its stream after two chunks")
    ap.add_argument("--nonstream-every", type=int, default=0, help="every Nth request is not streamed")
    ap.add_argument("--server-pid", type=int, default=0, help="sample this process's RSS (the server)")
    ap.add_argument("--rss-every", type=float, default=30.0)
    a = ap.parse_args()

    client = openai.AsyncOpenAI(base_url=f"{a.url}/v1", api_key=a.api_key, max_retries=0, timeout=600,
                                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=a.clients + 4)))
    model = (await client.models.list()).data[0].id
    health = httpx.get(f"{a.url}/health", timeout=30).json()
    prompts = load_prompts(a.prompts, a.per_set)
    await one(client, model, -1, 0, "Hi", 4, True, False)  # warm-up, not counted
    big = {}
    for chunked in (False, True) if a.big_body_mb else ():
        big.update(await asyncio.to_thread(health_during_big_body, a.url, a.api_key, model, a.big_body_mb, chunked))
    if big:
        print(json.dumps(big), flush=True)  # now: the load phase can take long on a busy machine
    before = scrape(a.url)
    stop = asyncio.Event()
    poison = asyncio.create_task(poisoner(a.url, a.api_key, model, a.poison_every, stop)) if a.poison_every else None
    rss = asyncio.create_task(rss_sampler(a.server_pid, a.rss_every, stop)) if a.server_pid else None
    samples, wall = await run_phase(client, model, prompts, a.requests, a.clients, a.max_tokens, True, a.check,
                                    a.duration, a.cancel_every, a.nonstream_every)
    stop.set()
    poisoned, skipped = await poison if poison else ([], 0)
    rss_trend = await rss if rss else []
    await asyncio.sleep(3.0)  # dropped streams reach the engine's inbox within a poll interval
    after = scrape(a.url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    dropped = [s for s in samples if s.kind == "dropped"]
    samples = [s for s in samples if s.kind != "dropped"]
    ok = [s for s in samples if s.ok]
    ttft = [s.first - s.start for s in ok if s.first]
    per_user = [(s.completion_tokens - 1) / (s.end - s.first) for s in ok if s.first and s.end > s.first]
    per_user_e2e = [s.completion_tokens / (s.end - s.start) for s in ok]
    summary = {
        "drafter": health.get("drafter"), "model": model, "clients": a.clients, "requests": a.requests,
        "max_tokens": a.max_tokens, "ok": len(ok), "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if not s.ok}),
        "output_tokens": sum(s.completion_tokens for s in ok), "wall_s": wall,
        "aggregate_tok_s": sum(s.completion_tokens for s in ok) / wall,
        "ttft_median_s": statistics.median(ttft) if ttft else None, "ttft_p90_s": pct(ttft, 0.9),
        "per_user_tok_s_median": statistics.median(per_user) if per_user else None,
        "per_user_e2e_tok_s_median": statistics.median(per_user_e2e) if per_user_e2e else None,
        "finish_reasons": {r: sum(s.finish_reason == r for s in ok) for r in ("length", "stop")},
        "server_tau": d.get("selfdraft_spec_round_tokens_total", 0) / max(1.0, d.get("selfdraft_spec_rounds_total", 0)),
        "server_acceptance": d.get("selfdraft_spec_accepted_tokens_total", 0) / max(1.0, d.get("selfdraft_spec_draft_tokens_total", 0)),
        "server_verify_tokens_per_step": d.get("selfdraft_verify_tokens_per_step_sum", 0) / max(1.0, d.get("selfdraft_verify_tokens_per_step_count", 0)),
        "server_requests_per_step": d.get("selfdraft_batch_requests_per_step_sum", 0) / max(1.0, d.get("selfdraft_batch_requests_per_step_count", 0)),
        "server_steps": d.get("selfdraft_step_seconds_count", 0),
    }
    # Token accounting from the stream itself: every request ends with a finish reason and a usage
    # count; a length-finished one must have exactly max_tokens.
    summary.update(big)
    summary["bad_counts"] = sum(1 for s in ok if s.finish_reason == "length" and s.completion_tokens != a.max_tokens)
    # Every request sent is counted once by the server: finished (any reason) or rejected before running.
    sent = len(samples) + len(dropped) + len(poisoned)
    counted = d.get("selfdraft_requests_total", 0) + d.get("selfdraft_rejected_requests_total", 0)
    reasons: dict[str, float] = {}
    for k, v in d.items():  # summed over endpoints
        if k.startswith("selfdraft_requests_total{") and v:
            reason = k.split("finish_reason=")[1].split(",")[0].rstrip("}")
            reasons[reason] = reasons.get(reason, 0.0) + v
    server_errors = reasons.get("error", 0) + sum(v for k, v in d.items()
                                                  if k.startswith("selfdraft_rejected_requests_total{status=5") and v)
    summary.update(requests_sent=sent, requests_counted=counted, uncounted=sent - counted, server_finish_reasons=reasons,
                   server_errors=server_errors, dropped_streams=len(dropped),
                   dropped_failed=sum(not s.ok for s in dropped),
                   kinds={k: sum(s.kind == k for s in samples) for k in ("stream", "nonstream")})
    if rss_trend:
        warm = [mb for t, mb in rss_trend if t >= min(300.0, rss_trend[-1][0] / 3)]  # after warm-up
        summary.update(rss_mb_start=rss_trend[0][1], rss_mb_after_warmup=warm[0] if warm else None,
                       rss_mb_end=rss_trend[-1][1], rss_mb_max_after_warmup=max(warm) if warm else None,
                       rss_growth_after_warmup=(rss_trend[-1][1] / warm[0] - 1) if warm else None, rss_trend=rss_trend)
    if poisoned:
        by: dict[str, dict] = {}
        for x in poisoned:
            by.setdefault(x["label"], {}).setdefault(str(x["status"]), 0)
            by[x["label"]][str(x["status"])] += 1
        statuses: dict[str, int] = {}
        for x in poisoned:
            statuses[str(x["status"])] = statuses.get(str(x["status"]), 0) + 1
        summary.update(poison_requests=len(poisoned), poison_ticks_skipped=skipped, poison_statuses=statuses,
                       poison_by_label=by,
                       poison_unexpected=sum(x["status"] != x["expected"] for x in poisoned))
    if a.check:
        # 1. Lost / duplicated tokens: the ids streamed with the text number usage.completion_tokens and
        #    decode (the target's own tokenizer, here in the client) to exactly the streamed text.
        tok = Tokenizer.from_file(str(a.tokenizer))
        lost_dup = [s.index for s in ok if s.token_ids is None or len(s.token_ids) != s.completion_tokens
                    or tok.decode(s.token_ids, skip_special_tokens=True) != s.text]
        # 2. The same prompts as single requests (one at a time, non-streamed): greedy output under load
        #    must equal it token for token; exact in float32, while in bf16 a batch-shape-dependent
        #    rounding can flip a near-tie.
        refs, ref_wall = await run_phase(client, model, prompts, len(prompts), 1, a.max_tokens, False, True)
        by_prompt = {r.prompt: r for r in refs if r.ok}
        mismatch = []
        for s in ok:
            r = by_prompt.get(s.prompt)
            if r is None or r.token_ids != s.token_ids or r.text != s.text:
                ref = (r.token_ids or []) if r else []
                at = next((k for k, (x, y) in enumerate(zip(s.token_ids or [], ref)) if x != y), None)
                mismatch.append({"request": s.index, "prompt": s.prompt, "first_diff_token": at})
        summary.update(token_accounting_failures=lost_dup, check_references=len(by_prompt),
                       check_failed=len(refs) - len(by_prompt), stream_vs_nonstream_mismatches=mismatch,
                       check_wall_s=ref_wall)
    print(json.dumps(summary, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"summary": summary, "samples": [asdict(s) for s in samples + dropped]}, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
