"""Training throughput, before/after, side by side in one run (issue: fast drafter training).

Each configuration trains the same DSpark drafter from the same feature cache for a few optimizer
steps; configurations are interleaved and repeated, and the median sequence tokens/s over repeats
is reported (the first steps of each run are warm-up and not timed). The rows between "before"
and "after" add one change at a time, so the table also shows where the time went.

    python scripts/bench_train.py --data data/reference --features runs/feats-ref --out docs/bench/training/throughput
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from selfdraft.config import TrainConfig
from selfdraft.methods.dspark.config import DSparkConfig
from selfdraft.target import Target
from selfdraft.training.trainer import train


@dataclass(frozen=True)
class Setting:
    name: str
    target_dtype: str  # the target's weights (the frozen LM head runs in it)
    bf16: bool  # autocast of the drafter
    batch_size: int
    threads: int
    loss_vocab_size: int  # 0 = full-vocabulary LM head and losses


SETTINGS = [
    Setting("before: bf16, batch 1, 1 thread, full vocab", "bfloat16", True, 1, 1, 0),
    Setting("+ fp32", "float32", False, 1, 1, 0),
    Setting("+ draft vocab 8192 (cached lse)", "float32", False, 1, 1, 8192),
    Setting("+ batch 8", "float32", False, 8, 1, 8192),
    Setting("after: + 2 threads", "float32", False, 8, 2, 8192),
]


def run(setting: Setting, target: Target, args, out: Path) -> float:
    """Sequence tokens/s of `args.steps` optimizer steps after `args.warmup` untimed ones."""
    torch.set_num_threads(setting.threads)
    dcfg = DSparkConfig(feature_layers=(1, 8, 14, 20, 27), loss_vocab_size=setting.loss_vocab_size)
    # equal work per step whatever the batch: the token count decides tokens/s
    tcfg = TrainConfig(data=args.data, features=args.features, steps=args.warmup + args.steps, batch_size=setting.batch_size,
                       bf16=setting.bf16, val_every=0, val_batches=0, save_every=0, warmup_steps=1, max_seq_len=512)
    marks: list[tuple[float, int]] = []
    train(target, dcfg, tcfg, out, resume=False, on_step=lambda log: marks.append((time.perf_counter(), log.tokens)))
    (t0, n0), (t1, n1) = marks[args.warmup - 1], marks[-1]
    return (n1 - n0) / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--features", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    targets = {d: Target.load(dtype=d) for d in {s.target_dtype for s in SETTINGS}}
    rates: dict[str, list[float]] = {s.name: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, s in enumerate(SETTINGS):
                rate = run(s, targets[s.target_dtype], args, Path(tmp) / f"{r}-{i}")
                rates[s.name].append(rate)
                print(f"repeat {r}: {s.name}: {rate:.0f} seq tok/s", flush=True)
    base = statistics.median(rates[SETTINGS[0].name])
    rows = [{"setting": s.name, "tokens_per_s": statistics.median(rates[s.name]), "runs": rates[s.name],
             "speedup": statistics.median(rates[s.name]) / base} for s in SETTINGS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_speed.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    table = ["| setting | seq tokens/s (median) | × before |", "|---|---|---|"]
    table += [f"| {r['setting']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f} |" for r in rows]
    (out / "train_speed.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
