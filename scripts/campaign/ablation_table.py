"""Runs trained on the same tokens in the same order, side by side: mean train acc@1 (and mean acc@1..γ) over
token windows, the last validation, and a curve (table.md, table.json, curve.png in --out).

Each training batch is new to the model when its step logs its accuracies (one epoch), so a window of
train steps is a held-out measurement. Committed curves (campaign_curve.py's curve.json, whose runs'
logs may be gone) join with --prior FILE:NAME=LABEL.

    python scripts/campaign/ablation_table.py RUN_DIR... --prior docs/bench/equal-budget/dspark-first-draft/curve.json:"dspark (families-800k)"=DSpark --out DIR

A run given as SEG1+SEG2+.. is one run trained in segments (warm restarts): their logs join, each segment's
tokens counted after the previous ones'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WINDOWS = ((40_000, 88_000), (88_000, 144_000), (144_000, 252_000))


def joined_log(spec: str) -> list[dict]:
    """The train log of RUN, or of SEG1+SEG2+.. with each segment's steps and tokens after the previous ones'."""
    out, step0, tokens0 = [], 0, 0
    for seg in spec.split("+"):
        log = [json.loads(x) for x in (Path(seg) / "train_log.jsonl").read_text().splitlines() if x.strip()]
        tokens = {x["step"]: x["tokens"] for x in log if x["kind"] == "train"}
        for x in log:
            x = {**x, "step": step0 + x["step"]}
            if x["kind"] == "train":
                x["tokens"] += tokens0
            out.append(x)
        step0, tokens0 = step0 + max(tokens), tokens0 + tokens[max(tokens)]
    return out


def run_points(run: str, window: int) -> tuple[list[dict], list[dict]]:
    """A run's train log -> ([{tokens, acc: [γ]}] per `window` tokens, [{tokens, loss, acc}] validations)."""
    log = joined_log(run)
    steps = [x for x in log if x["kind"] == "train"]
    keys = sorted((k for k in steps[0]["metrics"] if k.startswith("acc@")), key=lambda k: int(k[4:]))
    out, cur, start = [], [], 0
    for x in steps:
        cur.append(x)
        if x["tokens"] - start >= window:
            out.append({"tokens": x["tokens"], "acc": [sum(c["metrics"][k] for c in cur) / len(cur) for k in keys]})
            cur, start = [], x["tokens"]
    tokens = {x["step"]: x["tokens"] for x in steps}
    vals = [{"tokens": tokens.get(v["step"], 0), "loss": v["loss"], "acc": [v["metrics"][k] for k in keys]}
            for v in log if v["kind"] == "val"]
    return out, vals


def window_mean(points: list[dict], lo: int, hi: int, k: int | None) -> float | None:
    """Mean acc@(k+1) (k None: mean over positions) of the points ending in (lo, hi]."""
    sel = [p["acc"] for p in points if lo < p["tokens"] <= hi]
    if not sel:
        return None
    return sum((a[k] if k is not None else sum(a) / len(a)) for a in sel) / len(sel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="training output directories (their train_log.jsonl); SEG1+SEG2+.. joins segments")
    ap.add_argument("--prior", action="append", default=[], help="FILE:NAME=LABEL, a committed curve.json's windows")
    ap.add_argument("--window", type=int, default=20_000)
    ap.add_argument("--windows", default=",".join(f"{lo // 1000}-{hi // 1000}" for lo, hi in WINDOWS),
                    help="the table's token windows, in thousands: LO-HI,..")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    windows = [tuple(int(x) * 1000 for x in w.split("-")) for w in a.windows.split(",")]
    rows: list[tuple[str, list[dict], list[dict]]] = []
    for spec in a.prior:
        file, _, rest = spec.partition(":")
        name, _, label = rest.partition("=")
        rows.append((label or name, json.loads(Path(file).read_text())["windows"][name], []))
    rows += [("+".join(Path(seg).name for seg in run.split("+")), *run_points(run, a.window)) for run in a.runs]

    fmt = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    head = " | ".join(f"{lo // 1000}-{hi // 1000}k acc@1 / mean" for lo, hi in windows)
    lines = [f"| run | {head} | last val acc@1 (tokens) | val acc@1..γ |", "|---|" + "---:|" * (len(windows) + 1) + "---|"]
    table = []
    for label, pts, vals in rows:
        cells = [f"{fmt(window_mean(pts, lo, hi, 0))} / {fmt(window_mean(pts, lo, hi, None))}" for lo, hi in windows]
        v = vals[-1] if vals else None
        lines.append(f"| {label} | " + " | ".join(cells) + (f" | {v['acc'][0]:.3f} ({v['tokens']:,}) | "
                     + " ".join(f"{x:.2f}" for x in v["acc"]) + " |" if v else " | – | – |"))
        table.append({"run": label, "windows": {f"{lo}-{hi}": [window_mean(pts, lo, hi, 0), window_mean(pts, lo, hi, None)]
                                                for lo, hi in windows}, "val": vals})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    (a.out / "table.json").write_text(json.dumps(table, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    upto = max(p["tokens"] for _, pts, _ in rows[len(a.prior):] for p in pts) if a.runs else None
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (label, pts, _) in enumerate(rows):
        pts = [p for p in pts if upto is None or p["tokens"] <= upto * 1.02]
        style = "--" if i < len(a.prior) else "-"
        ax[0].plot([p["tokens"] for p in pts], [p["acc"][0] for p in pts], style, label=label)
        ax[1].plot([p["tokens"] for p in pts], [sum(p["acc"]) / len(p["acc"]) for p in pts], style, label=label)
    for axis, title in zip(ax, ("acc@1 (held-out train windows)", "mean acc@1..γ")):
        axis.set_xlabel("training tokens (same data, same order)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out / "curve.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
