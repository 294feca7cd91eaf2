"""The campaign's curve: val acc@1..γ and loss against the fresh tokens seen (PNG + Markdown table).

    python scripts/campaign/campaign_curve.py RUN --baseline work/baseline-val --out docs/bench/campaign/dspark-curve
    python scripts/campaign/campaign_curve.py SEG1 SEG2 ... --out docs/bench/campaign/dspark-curve   (segments in order, each warm-started
                                                                             from the one before: tokens add up)
    python scripts/campaign/campaign_curve.py SEG3 --prior docs/bench/campaign/dspark-curve/curve.json --out docs/bench/campaign/dspark-curve
                                         (new segments after the points of a committed curve: its logs may be gone)
    python scripts/campaign/campaign_curve.py --families work/families --out docs/bench/equal-budget/curve-150k
    python scripts/campaign/campaign_curve.py --families work/ablation --prior docs/bench/equal-budget/curve-800k/curve.json --window 20000 --out D
                                         (runs on the same tokens beside the committed families' curves, cut at the longest run)

--families: one run per method in DIR/METHOD, trained on the same tokens in the same order. Within one
epoch every training batch is new to the model when its step logs its accuracies, so windows of train
steps are held-out measurements (progressive validation): a curve per family without extra passes.
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


def last_tokens(run: Path) -> int:
    """Sequence tokens the run had trained on at its last logged step."""
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if x.strip()]
    return max((x["tokens"] for x in log if x["kind"] == "train"), default=0)


def train_windows(run: Path, window: int) -> list[dict]:
    """[{tokens, acc: [..]}]: mean train acc@k over consecutive steps of >= `window` tokens (the batch's
    accuracy before its update), tokens = the end of the window."""
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in log if x["kind"] == "train"]
    out, cur, start = [], [], 0
    for x in steps:
        cur.append(x)
        if x["tokens"] - start >= window or x is steps[-1]:
            keys = sorted((k for k in cur[0]["metrics"] if k.startswith("acc@")), key=lambda k: int(k[4:]))
            out.append({"tokens": x["tokens"], "acc": [sum(c["metrics"][k] for c in cur) / len(cur) for k in keys]})
            cur, start = [], x["tokens"]
    return out


def rewindow(points: list[dict], window: int, upto: int) -> list[dict]:
    """A committed curve's windows merged into windows of >= `window` tokens, up to `upto` tokens."""
    out, cur, start = [], [], 0
    for p in (p for p in points if p["tokens"] <= upto):
        cur.append(p)
        if p["tokens"] - start >= window:
            out.append({"tokens": p["tokens"], "acc": [sum(c["acc"][k] for c in cur) / len(cur) for k in range(len(p["acc"]))]})
            cur, start = [], p["tokens"]
    return out


def families(root: Path, out: Path, window: int, prior: Path | None = None) -> None:
    runs = sorted(d for d in root.iterdir() if (d / "train_log.jsonl").exists())
    curves = {d.name: train_windows(d, window) for d in runs}
    finals = {d.name: (val_points(d) or [None])[-1] for d in runs}
    if prior:  # the committed runs on the same tokens, cut where the longest new run stops
        upto = max(c[-1]["tokens"] for c in curves.values())
        for name, points in json.loads(prior.read_text())["windows"].items():
            curves[f"{name} ({prior.parent.name})"] = rewindow(points, window, upto)
            finals[f"{name} ({prior.parent.name})"] = None
    k = max(len(c[-1]["acc"]) for c in curves.values())
    head = " | ".join(f"acc@{i}" for i in range(1, k + 1))
    rows = [f"| family | tokens | last window: {head} | val: acc@1 | val acc@k mean |", "|---|---:|" + "---:|" * (k + 2)]
    for name, c in curves.items():
        acc = c[-1]["acc"] + [float("nan")] * (k - len(c[-1]["acc"]))
        v = finals[name]
        rows.append(f"| {name} | {c[-1]['tokens']:,} | " + " | ".join(f"{a:.3f}" for a in acc)
                    + (f" | {v['acc'][0]:.3f} | {sum(v['acc']) / len(v['acc']):.3f} |" if v else " | – | – |"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.md").write_text("\n".join(rows) + "\n")
    (out / "curve.json").write_text(json.dumps({"windows": curves, "final_val": finals}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = plt.get_cmap("tab20" if len(curves) > 10 else "tab10").colors  # tab10 repeats after 10 runs
    for i, (name, c) in enumerate(curves.items()):
        a1.plot([p["tokens"] / 1e3 for p in c], [p["acc"][0] for p in c], "-", color=colors[i % len(colors)], label=name)
        a2.plot(range(1, len(c[-1]["acc"]) + 1), c[-1]["acc"], "o-", color=colors[i % len(colors)])
    a1.set_xlabel("fresh sequence tokens (k)")
    a1.set_ylabel(f"acc@1 (held-out: windows of {window:,} tokens)")
    a2.set_xlabel("draft position k")
    a2.set_ylabel("acc@k, last window")
    fig.legend(loc="center right", fontsize=8)  # one legend beside both panels: inside, it hides the curves
    fig.suptitle(f"{len(curves)} runs on the same tokens in the same order ({root.name})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.76, 1))
    fig.savefig(out / "curve.png", dpi=110)
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="*", help="the campaign's runs (segments), in order")
    ap.add_argument("--families", type=Path, help="DIR/METHOD runs on the same data: one curve per family")
    ap.add_argument("--window", type=int, default=10_000, help="--families: tokens per point")
    ap.add_argument("--baseline", type=Path, help="a 1-step, lr ~0 run from the warm-start checkpoint: its val = tokens 0")
    ap.add_argument("--prior", type=Path, help="a curve.json this script wrote: its points come first, the runs continue it "
                    "(with --families: its families' windows are drawn beside the runs)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.families:
        return families(args.families, args.out, args.window, args.prior)
    if not args.runs:
        ap.error("give a run directory, or --families DIR")
    points = json.loads(args.prior.read_text()) if args.prior else []
    first = max((p.get("segment", 0) for p in points), default=-1) + 1
    offset = max((p["tokens"] for p in points), default=0)  # a segment ends with a validation at its last step
    starts = [max(p["tokens"] for p in points if p.get("segment") == s - 1) for s in range(1, first)]
    for seg, run in enumerate(args.runs, first):
        starts.append(offset)
        points += [dict(p, tokens=p["tokens"] + offset, segment=seg) for p in val_points(run)]
        offset += last_tokens(run)
    if args.baseline and not args.prior:
        base = val_points(args.baseline)[-1]
        points = [dict(base, tokens=0, step=0)] + points
    args.out.mkdir(parents=True, exist_ok=True)
    k = len(points[-1]["acc"])
    rows = ["| fresh tokens | segment | step | val loss | " + " | ".join(f"acc@{i}" for i in range(1, k + 1)) + " |",
            "|---:|---:|---:|---:|" + "---:|" * k]
    rows += [f"| {p['tokens']:,} | {p.get('segment', '–')} | {p['step']} | {p['loss']:.4f} | "
             + " | ".join(f"{a:.3f}" for a in p["acc"]) + " |" for p in points]
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
    for x in [x for x in starts if x > 0]:  # a new segment: a warm start with a fresh optimizer and schedule
        for a in (a1, a2):
            a.axvline(x / 1e6, color="grey", lw=0.6, ls=":")
    a2.set_ylabel("val loss (per segment: its CE label may differ)")
    names = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "EAGLE-3", "mtp": "MTP"}
    method = names.get(json.loads((args.runs[-1] / "config.json").read_text())["method"], "?") if args.runs else "DSpark"
    fig.suptitle(f"the {method} campaign on fresh data, {first + len(args.runs)} segment(s) (0 = the warm-start checkpoint)")
    fig.tight_layout()
    fig.savefig(args.out / "curve.png", dpi=110)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
