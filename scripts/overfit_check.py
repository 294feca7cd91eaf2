"""Sanity overfit on the real target: a drafter that cannot memorise 8 sequences has a hidden cap.

Trains a fresh DSpark (the campaign's recipe, every anchor) on 8 conversations of data/reference for
a few hundred steps (75 epochs) and checks that train acc@1 passes 0.9 (issue 27).

    python scripts/overfit_check.py --out work/overfit [--steps 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "work" / "overfit")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--goal", type=float, default=0.9)
    ap.add_argument("--ce-only", action="store_true", help="train on cross-entropy against the data's tokens alone "
                    "(the default loss is 0.9 TV to the target's distribution, whose argmax is not always the sampled token)")
    args = ap.parse_args()
    data = args.out / "data"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    src = ROOT / "data" / "reference"
    lines = (src / "shard-00000.jsonl").read_text().splitlines()
    train = [json.loads(x) for x in lines if json.loads(x)["split"] == "train"][:8]
    val = [dict(r, split="val") for r in train[:1]]  # validation on a memorised sequence: it must pass too
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + val))
    shutil.copy(src / "manifest.json", data / "manifest.json")
    shutil.copy(src / "draft_vocab_8192.safetensors", data / "draft_vocab_8192.safetensors")
    feats, ckpt = args.out / "feats", args.out / "dspark"
    # the target's features once (8 sequences), so each of the many steps pays only for the drafter
    subprocess.run([sys.executable, "-m", "selfdraft", "data", "features", str(data), "--out", str(feats),
                    "--feature-layers", "1,8,14,20,27", "--threads", str(args.threads)], check=True)
    cmd = [sys.executable, "-m", "selfdraft", "train", "--method", "dspark", "--data", str(data), "--out", str(ckpt),
           "--features", str(feats),
           "--no-resume", "--feature-layers", "1,8,14,20,27", "--loss-vocab-size", "8192", "--mask-token-id", "16",
           "--qk-norm", "--random-init", "--anchors-per-seq", "512", "--batch-size", "2", "--lr", "2e-3",
           "--warmup-steps", "20", "--steps", str(args.steps), "--val-every", "0", "--save-every", "0",
           "--val-batches", "1", "--threads", str(args.threads)] + (["--w-ce", "1", "--w-tv", "0"] if args.ce_only else [])
    print("$", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    log = [json.loads(x) for x in (ckpt / "train_log.jsonl").read_text().splitlines()]
    last = [x for x in log if x["kind"] == "train"][-10:]
    acc = sum(x["metrics"]["acc@1"] for x in last) / len(last)
    ok = acc >= args.goal
    print(f"train acc@1 over the last {len(last)} steps: {acc:.3f} ({'>=' if ok else '<'} {args.goal}): "
          f"{'no hidden cap' if ok else 'the drafter cannot memorise 8 sequences: look for a cap'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
