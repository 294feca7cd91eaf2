"""Sequential Temperature Scaling of the DSpark confidence head (docs/calibration.md).

1. Collect held-out rounds with full-block verification: per round, the raw confidence logits
   z_k (k = 1..γ) and whether draft k is accepted given drafts 1..k-1 are (greedy: x_k equals the
   target's argmax at its drafted prefix; T > 0: a coin with the chain rule's probability
   min(1, p_k(x_k) / q_k(x_k))). The prefix label is y_k = Π_{i≤k} accepted_i.
2. For k = 1..γ in order, grid-search T_k minimising ECE(a_k, y_k) with a_k = a_{k-1} · σ(z_k / T_k),
   T_1..T_{k-1} fixed. Order preserving per position.
3. Store T_k as the model's `conf_temperature` buffer (model.safetensors, atomically) with
   calibration.json (ECE / ROC-AUC of a_k before and after), one reliability diagram per position and
   the rounds themselves (calibration_rounds.safetensors).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from selfdraft.checkpoint import FORMAT, WEIGHTS_FILE, CheckpointError, atomic_dir, load_checkpoint
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import Speculation
from selfdraft.drafters.base import Proposal
from selfdraft.target import lm_logits
from selfdraft.progress import progress_bar
from selfdraft.sampling import probs_from_logits, sample
from selfdraft.target import Target

TEMPERATURE_GRID = torch.logspace(-1.5, 1.5, 151).tolist()  # 0.03 .. 32, geometric
ROUNDS_FILE = "calibration_rounds.safetensors"  # the held-out (z_k, accepted_k) the fit used
MIN_REACHED = 20  # held-out rounds that must reach a position before its T_k is fitted


@dataclass
class HeldOutRounds:
    z: torch.Tensor  # [N, γ] float32 raw confidence logits z_k
    accepted: torch.Tensor  # [N, γ] bool: draft k accepted given drafts 1..k-1 accepted

    @property
    def survived(self) -> torch.Tensor:
        """[N, γ] float y_k = 1 if drafts 1..k are all accepted (the label of a_k)."""
        return torch.cumprod(self.accepted.float(), 1)


@dataclass
class PositionReport:
    k: int
    temperature: float
    reached: float  # fraction of rounds with drafts 1..k-1 accepted
    acceptance: float  # P(draft k accepted | 1..k-1 accepted) on those rounds
    ece_before: float
    ece_after: float
    auc_before: float
    auc_after: float
    rounds_reached: int = 0  # rounds with drafts 1..k-1 accepted (the evidence for T_k)
    note: str = ""  # why T_k was not fitted or the AUC is undefined; empty when both are sound


# ----------------------------------------------------------------------------- metrics
def ece(conf: torch.Tensor, label: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error, equal-width bins: Σ_b (n_b / N) |mean conf_b − mean label_b|."""
    idx = (conf.double() * bins).long().clamp(0, bins - 1)
    n = torch.bincount(idx, minlength=bins).double()
    gap = torch.bincount(idx, conf.double(), bins) - torch.bincount(idx, label.double(), bins)
    return float(gap.abs().sum() / n.sum())


def roc_auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Rank formula (Mann-Whitney U): (Σ ranks of positives − n₊(n₊+1)/2) / (n₊ n₋), ties averaged."""
    pos = label.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(score.double(), return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # 0-based rank of each distinct value's first element
    avg_rank = (first.double() + (counts + 1).double() / 2)[inverse]  # 1-based average rank per element
    return float((avg_rank[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def prefix_confidence(z: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """z: [N, γ], T: [γ] -> a: [N, γ], a_k = Π_{i≤k} σ(z_i / T_i)."""
    return torch.cumprod(torch.sigmoid(z.double() / torch.tensor(temperatures, dtype=torch.float64)), 1)


def unfit_reason(rounds: HeldOutRounds, k: int, min_reached: int = MIN_REACHED) -> str:
    """Why position k (0-based) gives no evidence for T_k, or "" when it does.

    Too few rounds reach it, or its label y_k has one class over all rounds (every round accepts
    drafts 1..k, or none does): then ECE is minimised at a grid extreme and ROC-AUC is undefined.
    """
    y = rounds.survived
    reached = y.shape[0] if k == 0 else int(y[:, k - 1].sum())
    if reached < min_reached:
        return f"too few rounds: {reached} reach position {k + 1} (< {min_reached})"
    survivors = int(y[:, k].sum())
    if survivors in (0, y.shape[0]):
        return f"one class only: {'no' if survivors == 0 else 'every'} round accepts drafts 1..{k + 1}"
    return ""


def sequential_temperature_scaling(
    rounds: HeldOutRounds, grid: list[float] = TEMPERATURE_GRID, min_reached: int = MIN_REACHED
) -> list[float]:
    """T_k = argmin_T ECE(a_{k-1} σ(z_k / T), y_k), for k = 1..γ in order (T_1..T_{k-1} fixed).

    A position without evidence (`unfit_reason`) keeps the previous position's temperature (1 for
    the first) instead of a degenerate grid extreme.
    """
    y, z = rounds.survived.double(), rounds.z.double()
    a_prev = torch.ones(z.shape[0], dtype=torch.float64)
    temps = []
    for k in range(z.shape[1]):
        if unfit_reason(rounds, k, min_reached):
            temps.append(temps[-1] if temps else 1.0)
            a_prev = a_prev * torch.sigmoid(z[:, k] / temps[-1])
            continue
        errs = [ece(a_prev * torch.sigmoid(z[:, k] / t), y[:, k]) for t in grid]
        temps.append(grid[min(range(len(grid)), key=errs.__getitem__)])
        a_prev = a_prev * torch.sigmoid(z[:, k] / temps[-1])
    return temps


def report(rounds: HeldOutRounds, temperatures: list[float]) -> list[PositionReport]:
    """Per position: T_k, how often it is reached and accepted, ECE and ROC-AUC of a_k before/after,
    and a note when T_k was not fitted (kept from k-1) or the AUC is undefined (nan)."""
    y = rounds.survived
    before, after = prefix_confidence(rounds.z, [1.0] * len(temperatures)), prefix_confidence(rounds.z, temperatures)
    out = []
    for k, t in enumerate(temperatures):
        reached = torch.ones_like(y[:, 0]).bool() if k == 0 else y[:, k - 1].bool()
        why = unfit_reason(rounds, k)
        note = f"{why}; T_{k + 1} {'= 1' if k == 0 else f'kept from position {k}'}" if why else ""
        out.append(PositionReport(
            k=k + 1, temperature=t, reached=float(reached.float().mean()),
            acceptance=float(rounds.accepted[reached, k].float().mean()) if reached.any() else float("nan"),
            ece_before=ece(before[:, k], y[:, k]), ece_after=ece(after[:, k], y[:, k]),
            auc_before=roc_auc(before[:, k], y[:, k]), auc_after=roc_auc(after[:, k], y[:, k]),
            rounds_reached=int(reached.sum()), note=note,
        ))  # fmt: skip
    return out


# ----------------------------------------------------------------------------- collection
@torch.inference_mode()
def collect_rounds(
    target: Target, drafter, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, seed: int = 0
) -> HeldOutRounds:
    """Decode each prompt with full-block verification and record (z_k, accepted_k) per round.

    drafter: a DSpark inference drafter (load_checkpoint) with a confidence head.
    """
    model, gamma = drafter.model, drafter.cfg.gamma
    gen = torch.Generator().manual_seed(seed)
    # Room for γ tokens past max_new_tokens keeps every round's budget at the full block.
    config = GenerationConfig(max_new_tokens=max_new_tokens + gamma, gamma=gamma)
    zs, accs = [], []
    for prompt in progress_bar(prompts, desc="calibration rounds", unit="prompt"):
        s = Speculation(target, drafter, prompt, params, config, generator=gen)
        cache = target.new_cache()
        s.prefill(cache)
        while not s.done and len(s.out) < max_new_tokens:
            tokens = s.tokens
            # 1. The whole block of γ drafts, and the raw z_k the head computes for them.
            h = drafter.draft_states(tokens, gamma)  # [γ, H]
            if params.greedy:
                pick = lambda k, logits: int(logits.argmax())  # noqa: E731
            else:
                pick = lambda k, logits: int(sample(probs_from_logits(logits, params), gen))  # noqa: E731
            block = model.decode_block(h, lm_logits(target, h), tokens[-1], pick)
            prev = torch.cat([torch.tensor([tokens[-1]], device=block.tokens.device), block.tokens[:-1]])  # x_{k-1}, x_0 = the anchor
            zs.append(model.heads(h[None], prev[None]).z[0].float().cpu())  # the fit runs on the host
            q = None if params.greedy else probs_from_logits(block.logits, params)
            # 2. One decoding round with that block (full-block verification, no scheduler):
            #    target forward over [anchor, x_1..x_γ], verify, commit, observe, roll back.
            out = s.round(cache, Proposal(block.tokens, q))
            # 3. Acceptance of draft k given 1..k-1 at its drafted prefix: greedy match, or the chain rule's coin.
            p = probs_from_logits(out.logits[:gamma], params)  # [γ, V]
            p_x = p.gather(1, block.tokens[:, None]).squeeze(1)
            if params.greedy:
                accs.append((p_x > 0.5).cpu())
            else:  # the coin comes from the CPU generator: the ratio goes to the host first
                ratio = (p_x / q.gather(1, block.tokens[:, None]).squeeze(1)).clamp(max=1.0).cpu()
                accs.append(torch.rand(gamma, generator=gen) < ratio)
    if not zs:
        raise CheckpointError("no calibration rounds: give more prompts or a larger max_new_tokens")
    return HeldOutRounds(torch.stack(zs), torch.stack(accs))


# ----------------------------------------------------------------------------- storing
def reliability_diagram(rounds: HeldOutRounds, temperatures: list[float], k: int, png: Path, bins: int = 10) -> None:
    """Observed P(drafts 1..k accepted) against predicted a_k, before (T = 1) and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y = rounds.survived[:, k - 1].double()
    rep = report(rounds, temperatures)[k - 1]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], ":", color="gray")
    for name, temps, e, auc in (("before", [1.0] * len(temperatures), rep.ece_before, rep.auc_before),
                                ("after", temperatures, rep.ece_after, rep.auc_after)):
        a = prefix_confidence(rounds.z, temps)[:, k - 1]
        idx = (a * bins).long().clamp(0, bins - 1)
        n = torch.bincount(idx, minlength=bins)
        keep = n > 0
        conf = (torch.bincount(idx, a, bins) / n.clamp(min=1))[keep]
        obs = (torch.bincount(idx, y, bins) / n.clamp(min=1))[keep]
        ax.plot(conf.tolist(), obs.tolist(), "o-", label=f"{name}: ECE {e:.3f}, AUC {auc:.3f}")
    ax.set_xlabel(f"predicted a_{k}")
    ax.set_ylabel(f"observed P(drafts 1..{k} accepted)")
    ax.set_title(f"position {k}: T_{k} = {temperatures[k - 1]:.3g}, {len(y)} rounds")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def store_calibration(dir: str | Path, rounds: HeldOutRounds, temperatures: list[float], meta: dict) -> list[PositionReport]:
    """Atomically rewrite the checkpoint: conf_temperature = T_k in model.safetensors, plus
    calibration.json and calibration/reliability_k{k}.png. Other files are carried over unchanged."""
    dir = Path(dir).resolve()
    reports = report(rounds, temperatures)
    state = load_file(str(dir / WEIGHTS_FILE))
    if "conf_temperature" not in state or state["conf_temperature"].numel() != len(temperatures):
        raise CheckpointError(f"{dir} has no conf_temperature buffer of size {len(temperatures)} (not a DSpark drafter?)")
    state["conf_temperature"] = torch.tensor(temperatures, dtype=state["conf_temperature"].dtype)
    with atomic_dir(dir) as tmp:
        for f in dir.iterdir():
            if f.name in (WEIGHTS_FILE, "calibration.json", "calibration", ROUNDS_FILE):
                continue
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            else:
                try:
                    os.link(f, tmp / f.name)  # never modified in place, so a hard link is a copy
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        body = {**meta, "rounds": int(rounds.z.shape[0]), "temperatures": temperatures,
                "positions": [asdict(r) for r in reports]}
        (tmp / "calibration.json").write_text(json.dumps(body, indent=2) + "\n")
        # the rounds themselves: llama.cpp's recommended threshold is chosen on them (llamacpp/settings.py)
        save_file({"z": rounds.z.float().contiguous(), "accepted": rounds.accepted.to(torch.uint8).contiguous()},
                  str(tmp / ROUNDS_FILE))
        (tmp / "calibration").mkdir()
        for k in range(1, len(temperatures) + 1):
            reliability_diagram(rounds, temperatures, k, tmp / "calibration" / f"reliability_k{k}.png")
    return reports


def calibrate_checkpoint(
    dir: str | Path,
    target: Target,
    prompts: list[list[int]],
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    seed: int = 0,
) -> list[PositionReport]:
    """Steps 1-3 on a DSpark checkpoint directory; returns the per-position report."""
    drafter = load_checkpoint(dir, target)
    if getattr(drafter.model, "confidence", None) is None:
        raise CheckpointError(f"{dir} has no confidence head to calibrate (train with --confidence-head)")
    rounds = collect_rounds(target, drafter, prompts, params, max_new_tokens, seed)
    temps = sequential_temperature_scaling(rounds)
    meta = {"prompts": len(prompts), "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "max_new_tokens": max_new_tokens, "seed": seed}
    return store_calibration(dir, rounds, temps, meta)


def load_rounds(dir: str | Path) -> HeldOutRounds | None:
    """The held-out rounds a calibration stored in `dir`, or None (calibrated before they were kept)."""
    path = Path(dir) / ROUNDS_FILE
    if not path.is_file():
        return None
    t = load_file(str(path))
    return HeldOutRounds(t["z"], t["accepted"].bool())
