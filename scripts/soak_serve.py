"""Fault-injection soak of `selfdraft serve` on loopback: it starts the server (with fault injection
on, SELFDRAFT_SERVE_FAULTS=1), drives it with mixed clients and breaks its engine on purpose.

Clients (one role each, cycled over --clients): normal streamed and non-streamed greedy chats,
long ones (max_tokens up to the context length), streams dropped after two chunks, hostile
requests (each must get its expected status), oversized bodies (413), and slow clients (headers
that never end: the connection must be closed at the header timeout; bodies that never end: 408).
Every --fault-every seconds an engine exception is injected (alternately in a step and in the
inbox), every --oom-every seconds an out-of-memory in a step with requests decoding. After each,
the engine must restart (/health's `restarts` goes up) and a probe request must succeed.

Checked at the end: no 5xx but one per injected out-of-memory (its victim, the longest request);
/health answered 200 with engine "running" at every poll; every request sent is counted exactly
once in /metrics (selfdraft_requests_total + selfdraft_rejected_requests_total), every slow-header
connection in selfdraft_header_timeouts_total; the server's RSS after warm-up.

    python scripts/soak_serve.py --drafter hybrid:checkpoints/dspark --duration 1800 --clients 8 \\
        --out /tmp/soak.json --log /tmp/soak-server.log

Light on purpose (httpx only, no torch) so the clients do not compete with the server for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load_serve import scrape  # noqa: E402  (the /metrics reader both load tools share)

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "src" / "selfdraft" / "bench" / "prompts"
KEY = "sk-soak"
OOM_PREFIX = "the server ran out of memory"
ROLES = ("normal", "nonstream", "long", "dropped", "hostile", "oversized", "slow", "normal")
# (label, path, raw body or None for GET, authorized, expected status)
HOSTILE = [
    ("temperature NaN", "/v1/chat/completions", '"temperature": NaN', True, 400),
    ("lone surrogate", "/v1/chat/completions", '"stop": ["\\ud800"]', True, 400),
    ("logit_bias 5000 digits", "/v1/chat/completions", '"logit_bias": {"' + "9" * 5000 + '": 1}', True, 400),
    ("response_format", "/v1/chat/completions", '"response_format": {"type": "json_object"}', True, 400),
    ("n 2", "/v1/chat/completions", '"n": 2', True, 400),
    ("temperature 1e-40", "/v1/chat/completions", '"temperature": 1e-40', True, 200),
    ("unknown model", "/v1/chat/completions", None, True, 404),
    ("malformed JSON", "/v1/chat/completions", "MALFORMED", True, 400),
    ("wrong key", "/v1/chat/completions", '"temperature": 0', False, 401),
    ("models without key", "/v1/models", None, False, 401),
    ("metrics without key", "/metrics", None, False, 401),
    ("openapi without key", "/openapi.json", None, False, 401),
]


@dataclass
class Tally:
    """What the clients saw. `sent`: requests the server must count (requests_total + rejected_total)."""

    sent: int = 0
    by_role: dict = field(default_factory=dict)
    by_role_status: dict = field(default_factory=dict)  # "role status" -> requests
    statuses: dict = field(default_factory=dict)
    ok: int = 0
    oom_victims: int = 0
    unexpected_5xx: list = field(default_factory=list)
    unexpected_status: list = field(default_factory=list)
    client_errors: list = field(default_factory=list)  # transport errors the client did not expect
    slow_header_connections: int = 0
    slow_header_closed_late: int = 0
    completion_tokens: int = 0
    longest_max_tokens: int = 0

    def count(self, role: str, status: int | str) -> None:
        self.sent += 1
        self.by_role[role] = self.by_role.get(role, 0) + 1
        self.outcome(role, status)

    def outcome(self, role: str, status: int | str) -> None:
        key = f"{role} {status}"
        self.by_role_status[key] = self.by_role_status.get(key, 0) + 1
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1


@dataclass
class Fault:
    kind: str
    at_s: float
    recovered_s: float | None = None  # until /health reported the restart
    probe_ok: bool = False  # a request right after it succeeded


def load_prompts() -> list[str]:
    out = []
    for name in ("mt-bench", "humaneval", "gsm8k", "alpaca"):
        lines = (PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines()
        out += [json.loads(x)["turns"][0] for x in lines if x.strip()][:20]
    return [p for p in out if len(p) < 1500]


def auth(ok: bool = True) -> dict:
    return {"authorization": f"Bearer {KEY}" if ok else "Bearer wrong"}


class Soak:
    def __init__(self, a, url: str, pid: int, model: str, context: int) -> None:
        self.a, self.url, self.pid, self.model, self.context = a, url, pid, model, context
        self.t = Tally()
        self.faults: list[Fault] = []
        self.health: list[tuple[float, int, str, int]] = []  # (s, status, engine, restarts)
        self.rss: list[tuple[float, float]] = []
        self.prompts = load_prompts()
        self.rng = random.Random(0)
        self.t0 = time.monotonic()
        self.stop = asyncio.Event()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    # ------------------------------------------------------------ client roles
    def chat(self, max_tokens: int, stream: bool) -> dict:
        prompt = self.rng.choice(self.prompts)
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}

    async def generate(self, c: httpx.AsyncClient, role: str, body: dict, drop_after: int = 0) -> None:
        status: int | str = "none"
        try:
            if body["stream"]:
                async with c.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=auth()) as r:
                    status, chunks, error = r.status_code, 0, None
                    if r.status_code != 200:
                        await r.aread()
                        error = r.json().get("error", {}).get("message", "")
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = event["error"]["message"]
                                status = 500 if event["error"]["type"] == "internal_error" else 503
                            chunks += 1
                            if drop_after and chunks >= drop_after:
                                break  # the client goes away mid-stream
            else:
                r = await c.post(f"{self.url}/v1/chat/completions", json=body, headers=auth())
                status, error = r.status_code, None
                if r.status_code == 200:
                    self.t.completion_tokens += r.json()["usage"]["completion_tokens"]
                else:
                    error = r.json().get("error", {}).get("message", "")
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            if self.stop.is_set():
                status = "cancelled at the end"
            else:
                self.t.client_errors.append(f"{role}: {type(e).__name__}: {e}"[:300])
                status = type(e).__name__
        except asyncio.CancelledError:
            self.t.count(role, "cancelled at the end")
            raise
        self.t.count(role, status)
        if isinstance(status, int) and status >= 500:
            if error and error.startswith(OOM_PREFIX):
                self.t.oom_victims += 1
            else:
                self.t.unexpected_5xx.append({"at_s": self.now(), "role": role, "status": status, "error": error})
        elif status == 200:
            self.t.ok += 1

    async def hostile(self, c: httpx.AsyncClient, k: int) -> None:
        label, path, fragment, authorized, expected = HOSTILE[k % len(HOSTILE)]
        status: int | str = "cancelled at the end"
        try:
            if fragment is None and path.startswith("/v1/chat"):
                body = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]})
                r = await c.post(f"{self.url}{path}", content=body.encode(), headers={**auth(authorized), "content-type": "application/json"})
            elif fragment is None:
                r = await c.get(f"{self.url}{path}", headers=auth(authorized))
            else:
                body = ('{"model": "x", "messages": [' if fragment == "MALFORMED" else
                        f'{{"model": {json.dumps(self.model)}, "max_tokens": 4, '
                        f'"messages": [{{"role": "user", "content": "Hi"}}], {fragment}}}')
                r = await c.post(f"{self.url}{path}", content=body.encode(),
                                 headers={**auth(authorized), "content-type": "application/json"})
            status = r.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        finally:  # counted even when the soak ends while it is in flight (the server counts it too)
            self.t.count("hostile", status)
        if status != expected:
            self.t.unexpected_status.append({"at_s": self.now(), "label": label, "status": status, "expected": expected})
            if isinstance(status, int) and status >= 500:
                self.t.unexpected_5xx.append({"at_s": self.now(), "role": "hostile", "status": status, "error": label})

    async def oversized(self, c: httpx.AsyncClient, k: int) -> None:
        body = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}'
        headers = {**auth(), "content-type": "application/json"}
        status: int | str = "cancelled at the end"
        try:
            if k % 2:  # no Content-Length: the server must stop reading at its limit
                async def pieces():
                    for i in range(0, len(body), 1 << 16):
                        yield body[i:i + (1 << 16)]
                r = await c.post(f"{self.url}/v1/chat/completions", content=pieces(), headers=headers)
            else:
                r = await c.post(f"{self.url}/v1/chat/completions", content=body, headers=headers)
            status = r.status_code
        except httpx.HTTPError:
            status = 413  # the server answered 413 and closed while the client still sent (counted by the server)
        finally:
            self.t.count("oversized", status)
        if status != 413:
            self.t.unexpected_status.append({"at_s": self.now(), "label": "oversized", "status": status, "expected": 413})

    async def slow(self, k: int) -> None:
        host, port = self.url.split("//")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            if k % 2 == 0:  # headers that never end: not a request; the server must close the connection
                self.t.slow_header_connections += 1
                t0 = time.monotonic()
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                await writer.drain()
                closed = False
                while time.monotonic() - t0 < self.a.header_timeout + 15 and not self.stop.is_set():
                    writer.write(b"X")  # a byte now and then
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(100), timeout=1.0) == b"":
                            closed = True
                            break
                    except asyncio.TimeoutError:
                        pass
                if not closed and not self.stop.is_set():
                    self.t.slow_header_closed_late += 1
            else:  # a body that never ends: 408 at the body timeout
                status: int | str = "cancelled at the end"
                self.t.count("slow", "sent")  # once its headers are out, the server counts it
                writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                             "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"".encode())
                await writer.drain()
                reply = await asyncio.wait_for(reader.read(100), timeout=self.a.body_timeout + 15)
                status = int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else "closed"
                self.t.outcome("slow", status)
                if status != 408:
                    self.t.unexpected_status.append({"at_s": self.now(), "label": "slow body", "status": status, "expected": 408})
        except (OSError, asyncio.TimeoutError) as e:
            if not self.stop.is_set():
                self.t.client_errors.append(f"slow: {type(e).__name__}: {e}"[:300])
        finally:
            writer.close()

    async def worker(self, role: str) -> None:
        limits = httpx.Limits(max_connections=2)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as c:
            k = 0
            while not self.stop.is_set():
                k += 1
                if role == "normal":
                    await self.generate(c, role, self.chat(self.rng.randint(16, 256), stream=k % 3 != 0))
                elif role == "nonstream":
                    await self.generate(c, role, self.chat(self.rng.randint(16, 128), stream=False))
                elif role == "long":  # up to the context length (the prompt needs room too)
                    n = self.rng.randint(self.context // 2, self.context - 600)
                    self.t.longest_max_tokens = max(self.t.longest_max_tokens, n)
                    await self.generate(c, role, self.chat(n, stream=True))
                elif role == "dropped":
                    await self.generate(c, role, self.chat(200, stream=True), drop_after=2)
                elif role == "hostile":
                    await self.hostile(c, k)
                    await asyncio.sleep(1.0)
                elif role == "oversized":
                    await self.oversized(c, k)
                    await asyncio.sleep(2.0)
                elif role == "slow":
                    await self.slow(k)

    # ------------------------------------------------------------ the server's side
    async def injector(self) -> None:
        async with httpx.AsyncClient(timeout=600) as c:
            next_fault, next_oom, k = self.a.fault_every, self.a.oom_every, 0
            while not self.stop.is_set():
                await asyncio.sleep(1.0)
                elapsed = time.monotonic() - self.t0
                if elapsed >= self.a.duration - 30:
                    continue  # the last faults must have time to recover before the end
                kind = None
                if elapsed >= next_oom:
                    kind, next_oom = "oom", next_oom + self.a.oom_every
                elif elapsed >= next_fault:
                    kind, next_fault, k = ("step", "inbox")[k % 2], next_fault + self.a.fault_every, k + 1
                if kind:
                    await self.inject(c, kind)

    async def inject(self, c: httpx.AsyncClient, kind: str) -> None:
        f = Fault(kind, self.now())
        before = (await c.get(f"{self.url}/health")).json()["restarts"]
        (await c.post(f"{self.url}/debug/fault", params={"kind": kind}, headers=auth())).raise_for_status()
        while time.monotonic() - self.t0 - f.at_s < 600 and not self.stop.is_set():
            h = (await c.get(f"{self.url}/health")).json()
            if h["restarts"] > before:
                f.recovered_s = round(time.monotonic() - self.t0 - f.at_s, 2)
                break
            await asyncio.sleep(0.2)
        probe = {"model": self.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
        r = await c.post(f"{self.url}/v1/chat/completions", json=probe, headers=auth())
        self.t.count("probe", r.status_code)
        f.probe_ok = r.status_code == 200
        self.faults.append(f)

    async def health_monitor(self) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not self.stop.is_set():
                try:
                    r = await c.get(f"{self.url}/health")
                    h = r.json()
                    self.health.append((self.now(), r.status_code, h.get("engine", "?"), h.get("restarts", -1)))
                except httpx.HTTPError as e:
                    self.health.append((self.now(), 0, type(e).__name__, -1))
                await asyncio.sleep(1.0)

    async def rss_sampler(self) -> None:
        while not self.stop.is_set():
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.rss.append((self.now(), int(line.split()[1]) / 1024))
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=self.a.rss_every)
            except asyncio.TimeoutError:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "selfdraft", "serve", "--drafter", a.drafter, "--threads", "1", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--header-timeout", str(a.header_timeout),
           "--body-timeout", str(a.body_timeout), *a.server_arg]
    env = {**os.environ, "SELFDRAFT_SERVE_FAULTS": "1", "SELFDRAFT_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    log = open(a.log, "w")
    print("server:", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def rss_summary(rss: list[tuple[float, float]], warmup_s: float) -> dict:
    after = [(t, mb) for t, mb in rss if t >= warmup_s]
    if len(after) < 2:
        return {"rss_samples": len(rss)}
    first, last = after[0][1], after[-1][1]
    ts, ms = [t for t, _ in after], [m for _, m in after]
    tm, mm = statistics.fmean(ts), statistics.fmean(ms)
    slope = sum((t - tm) * (m - mm) for t, m in after) / max(1e-9, sum((t - tm) ** 2 for t in ts))
    return {"rss_samples": len(rss), "rss_mb_start": rss[0][1], "rss_mb_at_warmup": first, "rss_mb_end": last,
            "rss_mb_min_after_warmup": min(ms), "rss_mb_max_after_warmup": max(ms),
            "rss_growth_end_vs_warmup": last / first - 1, "rss_range_after_warmup": max(ms) / min(ms) - 1,
            "rss_slope_mb_per_hour": slope * 3600}


async def run(a) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(a, port)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}); see {a.log}")
            await asyncio.sleep(1.0)
        card = httpx.get(f"{url}/v1/models", headers=auth(), timeout=30).json()["data"][0]
        soak = Soak(a, url, proc.pid, card["id"], card["max_model_len"])
        async with httpx.AsyncClient(timeout=600) as c:  # warm-up, before the counters are read
            await soak.generate(c, "warmup", soak.chat(8, stream=False))
        before = scrape(url, auth())
        soak.t = Tally()
        soak.t0 = time.monotonic()
        roles = [ROLES[i % len(ROLES)] for i in range(a.clients)]
        tasks = [asyncio.create_task(soak.worker(r)) for r in roles]
        tasks += [asyncio.create_task(x()) for x in (soak.injector, soak.health_monitor, soak.rss_sampler)]
        await asyncio.sleep(a.duration)
        soak.stop.set()
        await asyncio.sleep(0.5)
        for t in tasks[: len(roles)]:
            t.cancel()  # requests still open are dropped (the server counts them as cancelled)
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(120):  # every dropped request reaches the engine and is counted
            if httpx.get(f"{url}/health", timeout=30).json()["in_flight"] == 0:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        after = scrape(url, auth())
        final = httpx.get(f"{url}/health", timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    counted = d.get("selfdraft_requests_total", 0) + d.get("selfdraft_rejected_requests_total", 0)
    reasons = {k.split("finish_reason=")[1].rstrip("}"): v for k, v in d.items()
               if k.startswith("selfdraft_requests_total{") and v}
    rejected = {k.split("status=")[1].rstrip("}"): v for k, v in d.items()
                if k.startswith("selfdraft_rejected_requests_total{") and v}
    t = soak.t
    fired = [f for f in soak.faults if f.recovered_s is not None]
    health_bad = [h for h in soak.health if h[1] != 200 or h[2] != "running"]
    warmup = a.warmup if a.warmup is not None else min(300.0, a.duration / 3)
    summary = {
        "duration_s": a.duration, "clients": a.clients, "roles": [ROLES[i % len(ROLES)] for i in range(a.clients)],
        "drafter": a.drafter, "model": soak.model, "context": soak.context, "longest_max_tokens": t.longest_max_tokens,
        "requests_sent": t.sent, "requests_counted": counted, "uncounted": t.sent - counted,
        "by_role": t.by_role, "by_role_status": t.by_role_status, "client_statuses": t.statuses, "server_finish_reasons": reasons,
        "server_rejected": rejected, "ok": t.ok, "completion_tokens_nonstream": t.completion_tokens,
        "faults_injected": len(soak.faults), "faults_by_kind": {k: sum(f.kind == k for f in soak.faults) for k in ("step", "inbox", "oom")},
        "faults_recovered": len(fired), "faults_probe_ok": sum(f.probe_ok for f in soak.faults),
        "recovery_s_max": max((f.recovered_s for f in fired), default=None),
        "oom_victims": t.oom_victims, "unexpected_5xx": t.unexpected_5xx, "unexpected_status": t.unexpected_status,
        "client_errors": t.client_errors[:20], "client_errors_total": len(t.client_errors),
        "health_polls": len(soak.health), "health_not_ok": len(health_bad), "health_not_ok_samples": health_bad[:10],
        "final_health": final.json(), "final_health_status": final.status_code,
        "restarts_reported": final.json().get("restarts"),
        "slow_header_connections": t.slow_header_connections, "slow_header_closed_late": t.slow_header_closed_late,
        "server_header_timeouts": d.get("selfdraft_header_timeouts_total", 0),
        "warmup_s": warmup, **rss_summary(soak.rss, warmup),
    }
    summary["passed"] = bool(
        not t.unexpected_5xx and not t.unexpected_status and summary["uncounted"] == 0 and not health_bad
        and len(fired) == len(soak.faults) and all(f.probe_ok for f in soak.faults)
        and t.oom_victims <= summary["faults_by_kind"]["oom"]
        and summary.get("rss_growth_end_vs_warmup", 1.0) <= 0.05)
    return {"summary": summary, "faults": [asdict(f) for f in soak.faults], "rss": soak.rss, "health": soak.health}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="hybrid:checkpoints/dspark")
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--fault-every", type=float, default=60.0, help="an engine exception every S seconds")
    ap.add_argument("--oom-every", type=float, default=300.0, help="an out-of-memory in a step every S seconds")
    ap.add_argument("--header-timeout", type=float, default=10.0)
    ap.add_argument("--body-timeout", type=float, default=30.0)
    ap.add_argument("--rss-every", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=None, help="seconds before RSS is judged (default: min(300, duration/3))")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for `selfdraft serve`")
    ap.add_argument("--log", type=Path, default=Path("/tmp/soak-server.log"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/soak.json"))
    a = ap.parse_args()
    result = asyncio.run(run(a))
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
