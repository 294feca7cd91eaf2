"""The campaign's curve: val acc@1..γ and loss against the fresh tokens seen (PNG + Markdown table).

    python scripts/campaign_curve.py work/campaign/dspark --baseline work/baseline-val --out docs/bench/campaign
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def val_points(run: Path) -> list[dict]:
    """[{tokens, step, loss, acc: [..]}] of a run's validations, tokens = sequence tokens trained on by then."""
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if x.strip()]
    tokens = {x["step"]: x["tokens"] for x in log if x["kind"] == "train"}
    out = []
    for v in (x for x in log if x["kind"] == "val"):
        accs = [v["metrics"][k] for k in sorted((k for k in v["metrics"] if k.startswith("acc@")), key=lambda k: int(k[4:]))]
        out.append({"tokens": tokens.get(v["step"], 0), "step": v["step"], "loss": v["loss"], "acc": accs})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--baseline", type=Path, help="a 1-step, lr ~0 run from the warm-start checkpoint: its val = tokens 0")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    points = val_points(args.run)
    if args.baseline:
        base = val_points(args.baseline)[-1]
        points = [dict(base, tokens=0, step=0)] + points
    args.out.mkdir(parents=True, exist_ok=True)
    k = len(points[-1]["acc"])
    rows = ["| fresh tokens | step | val loss | " + " | ".join(f"acc@{i}" for i in range(1, k + 1)) + " |",
            "|---:|---:|---:|" + "---:|" * k]
    rows += [f"| {p['tokens']:,} | {p['step']} | {p['loss']:.4f} | " + " | ".join(f"{a:.3f}" for a in p["acc"]) + " |"
             for p in points]
    (args.out / "curve.md").write_text("\n".join(rows) + "\n")
    (args.out / "curve.json").write_text(json.dumps(points, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [p["tokens"] / 1e6 for p in points]
    for i in range(k):
        a1.plot(xs, [p["acc"][i] for p in points], "o-", ms=3, label=f"acc@{i + 1}")
    a1.set_xlabel("fresh sequence tokens (M)")
    a1.set_ylabel("val accuracy")
    a1.legend(ncol=2, fontsize=8)
    a2.plot(xs, [p["loss"] for p in points], "o-", ms=3)
    a2.set_xlabel("fresh sequence tokens (M)")
    a2.set_ylabel("val loss")
    fig.suptitle(f"{args.run.name}: the campaign on fresh data (0 = the warm-start checkpoint)")
    fig.tight_layout()
    fig.savefig(args.out / "curve.png", dpi=110)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
