"""The `--spec-draft-p-min` / `--spec-draft-n-max` llama.cpp should run our DSpark with (docs/llamacpp.md#recommended-settings).

llama.cpp's DSpark rule is a threshold, not our scheduler: a round drafts the leading positions whose
raw confidence σ(z_k) >= p_min, at most n_max of them, then verifies them in one target pass. Which
threshold pays depends on what llama.cpp's passes cost on this machine, so we carry DSpark's
hardware-aware insight over as a choice of those two flags:

    L(p, n)    = #{leading k <= n with σ(z_k) >= p}                     drafts a round verifies
    a          = min(L, #{leading k with draft k accepted})             accepted drafts
    tokens/s   = Σ_rounds (a + 1) / Σ_rounds (t_draft + t_target(L + 1))

over held-out rounds (z_k, accepted_k) recorded at full blocks (training/calibrate.collect_rounds), with
t_target(k) = llama.cpp's forward over k tokens (llama-bench, at a typical depth) and t_draft(n) = its
draft pass at n_max n (llama-server with and without the drafter, every draft refused). Then
(p, n) = argmax. A round that drafts nothing still pays its draft pass: llama.cpp runs the drafter
before it reads the confidences.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfdraft.config import ConfigError

P_GRID = [round(0.05 * i, 2) for i in range(20)]  # 0 .. 0.95


@dataclass
class LlamaCppCosts:
    """Seconds llama.cpp spends on this machine (measured by `measure_costs`)."""

    target_s: list[float]  # index k-1: the target's forward over k tokens, k = 1..γ+1
    draft_s: list[float]  # index n-1: one draft pass of the drafter at --spec-draft-n-max n, n = 1..γ
    threads: int
    machine: str = ""


@dataclass
class Setting:
    p_min: float
    n_max: int
    tokens_per_round: float  # E[a + 1]
    seconds_per_round: float
    tokens_per_s: float


@dataclass
class Recommendation:
    best: Setting
    default: Setting  # llama.cpp's defaults: n_max 3, p_min 0
    plain_tokens_per_s: float  # 1 / t_target(1)
    grid: list[Setting]
    costs: LlamaCppCosts
    rounds: int

    def to_dict(self) -> dict:
        return asdict(self)


def expected(z: torch.Tensor, accepted: torch.Tensor, costs: LlamaCppCosts, p_min: float, n_max: int) -> Setting:
    """z, accepted: [N, γ] held-out rounds -> the expected rate of llama.cpp's threshold rule at (p_min, n_max)."""
    n_max = min(n_max, z.shape[1], len(costs.target_s) - 1)
    keep = torch.cumprod((torch.sigmoid(z[:, :n_max].double()) >= p_min).long(), 1)  # [N, n]: leading run
    L = keep.sum(1)  # [N]
    a = torch.minimum(L, torch.cumprod(accepted[:, :n_max].long(), 1).sum(1))  # [N]
    t = torch.tensor(costs.target_s, dtype=torch.float64)
    tokens = float((a + 1).double().mean())
    seconds = costs.draft_s[n_max - 1] + float(t[L].mean())
    return Setting(p_min, n_max, tokens, seconds, tokens / seconds)


def recommend(z: torch.Tensor, accepted: torch.Tensor, costs: LlamaCppCosts) -> Recommendation:
    """argmax over p_min in P_GRID and n_max in 1..γ of the expected tokens per second."""
    if z.ndim != 2 or z.shape != accepted.shape or z.shape[0] == 0:
        raise ConfigError(f"need held-out rounds z, accepted of one shape [N, γ] (got {tuple(z.shape)}, {tuple(accepted.shape)})")
    gamma = min(z.shape[1], len(costs.target_s) - 1, len(costs.draft_s))
    grid = [expected(z, accepted, costs, p, n) for p in P_GRID for n in range(1, gamma + 1)]
    best = max(grid, key=lambda s: s.tokens_per_s)
    return Recommendation(best, expected(z, accepted, costs, 0.0, 3), 1.0 / costs.target_s[0], grid, costs, int(z.shape[0]))


# ------------------------------------------------------------------ measuring llama.cpp
def target_forward_s(bench: str, target_gguf: Path, ks: list[int], threads: int, depth: int = 256, reps: int = 5) -> list[float]:
    """llama-bench: seconds for the target's forward over k tokens after `depth` cached ones, per k. Weight
    repacking follows llama-server's LLAMA_ARG_REPACK, so both time the same kernels (0 where ggml's repacked
    CPU kernels crash, as on an Intel Xeon VM with AMX)."""
    cmd = [bench, "-m", str(target_gguf), "-p", ",".join(map(str, ks)), "-n", "0", "-d", str(depth),
           "-r", str(reps), "-t", str(threads), "-o", "json"]  # fmt: skip
    if os.environ.get("LLAMA_ARG_REPACK", "").lower() in ("0", "false", "off", "disabled"):
        cmd += ["--repack", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    rows = {int(r["n_prompt"]): float(r["avg_ns"]) / 1e9 for r in json.loads(out.stdout)}
    return [rows[k] for k in ks]


def draft_pass_s(target_gguf: Path, drafter_gguf: Path, spec_type: str, gamma: int, threads: int,
                 prompt: list[int], tokens: int = 64) -> list[float]:
    """One draft pass per n_max = 1..γ: llama-server's time per token with the drafter at p_min 1 (every
    draft refused, so a round = draft pass + one-token decode) minus its time per token without it
    (median of 3 each)."""
    from statistics import median

    from selfdraft.bench.llamacpp import LlamaServer, drafter_args, find_server

    binary = find_server()
    if binary is None:
        raise RuntimeError("llama-server not found")
    per_token = []
    for spec in [[]] + [drafter_args(drafter_gguf, spec_type, threads, n, 1.0) for n in range(1, gamma + 1)]:
        srv = LlamaServer(binary, target_gguf, threads, spec=spec).start()
        try:
            runs = []
            for _ in range(4):
                t = srv.complete(prompt, tokens, 0.0, 1.0, 0)["timings"]
                runs.append(t["predicted_ms"] / 1e3 / max(1, t["predicted_n"]))
            per_token.append(median(runs[1:]))  # the first warms the server
        finally:
            srv.close()
    return [max(0.0, t - per_token[0]) for t in per_token[1:]]


def measure_costs(target_gguf: Path, drafter_gguf: Path, spec_type: str, gamma: int, threads: int,
                  prompt: list[int]) -> LlamaCppCosts:
    from selfdraft.bench.llamacpp import find_tool

    bench = find_tool("llama-bench")
    if bench is None:
        raise RuntimeError("llama-bench not found (make test-llamacpp builds llama.cpp into .venv-llamacpp)")
    ks = list(range(1, gamma + 2))
    return LlamaCppCosts(target_forward_s(bench, target_gguf, ks, threads),
                         draft_pass_s(target_gguf, drafter_gguf, spec_type, gamma, threads, prompt),
                         threads, platform.processor() or platform.machine())  # fmt: skip


def table(rec: Recommendation) -> str:
    """Markdown: the best setting, llama.cpp's default, and plain decoding, as expected on this machine."""
    rows = [("recommended", rec.best), ("llama.cpp default (n_max 3, p_min 0)", rec.default)]
    lines = ["| setting | --spec-draft-p-min | --spec-draft-n-max | tokens/round | ms/round | expected tok/s | × plain |",
             "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s.p_min:g} | {s.n_max} | {s.tokens_per_round:.2f} | {1e3 * s.seconds_per_round:.1f} | "
                     f"{s.tokens_per_s:.1f} | {s.tokens_per_s / rec.plain_tokens_per_s:.2f} |")
    lines.append(f"| plain decoding | – | – | 1.00 | {1e3 * rec.costs.target_s[0]:.1f} | {rec.plain_tokens_per_s:.1f} | 1.00 |")
    return "\n".join(lines) + "\n"


def recommend_for(src_dir: str | Path, report, target, threads: int) -> Recommendation | None:
    """Measure llama.cpp's costs here and recommend (p_min, n_max) for the exported DSpark `report`;
    writes OUT.settings.json / .md beside the GGUF. None (with the reason printed) when it cannot."""
    import sys

    from selfdraft.bench.llamacpp import find_tool
    from selfdraft.training.calibrate import load_rounds

    rounds = load_rounds(src_dir)
    if rounds is None:
        print(f"no recommended llama.cpp settings: {src_dir} keeps no calibration rounds; run "
              f"`selfdraft calibrate --drafter {src_dir} --prompts ...` first (docs/llamacpp.md#recommended-settings)",
              file=sys.stderr)  # fmt: skip
        return None
    if find_tool("llama-bench") is None or find_tool("llama-server") is None:
        print("no recommended llama.cpp settings: llama.cpp is not installed here (make test-llamacpp builds it)", file=sys.stderr)
        return None
    prompt = target.encode_prompt("Explain how a hash map works, with an example.")
    costs = measure_costs(report.target_gguf, report.path, report.spec_type, report.draft_tokens, threads, prompt)
    rec = recommend(rounds.z, rounds.accepted, costs)
    base = Path(str(report.path).removesuffix(".gguf"))
    Path(f"{base}.settings.json").write_text(json.dumps(rec.to_dict(), indent=1) + "\n")
    Path(f"{base}.settings.md").write_text(table(rec))
    print(table(rec), file=sys.stderr)
    if rec.best.tokens_per_s < rec.plain_tokens_per_s:  # say so: the flags are the best with this drafter, not a win
        print(f"note: even at these settings llama.cpp is expected slower with this drafter than without it here "
              f"({rec.best.tokens_per_s:.1f} vs {rec.plain_tokens_per_s:.1f} tok/s): its draft pass and verify-k cost "
              f"too much for the drafter's acceptance (docs/llamacpp.md#recommended-settings)", file=sys.stderr)  # fmt: skip
    return rec
