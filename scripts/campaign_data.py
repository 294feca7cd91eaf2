"""The next campaign segment's data: what a checkpoint has NOT trained on yet, plus more sources.

A campaign checkpoint trained `steps` optimizer steps on its data in the trainer's seeded order
(training/checkpointing.py DataCursor), so the sequences it saw are known exactly from its provenance:
seed, steps, batch size, gradient accumulation, world size. This writes a new dataset directory with

  - the validation records of the checkpoint's data, first (the campaign's val curve stays comparable),
  - its train records the checkpoint never drew (fresh tokens; none if it went past one epoch),
  - every train record of each --add dataset whose prompt+answer is not already in (e.g. `data original`),
  - the draft vocabulary of the checkpoint's data (--vocab-size), so a warm start keeps the target's
    own frequent tokens (another model's answers would pull in tokens the target rarely emits),

and a manifest saying where every record came from. Nothing is written when the output exists.

    python scripts/campaign_data.py --data work/data/regen-v1 --seen checkpoints/dspark-campaign \
        --add work/data/original --add-limit 2200 --out work/data/mix-v1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from selfdraft.checkpoint import read_config
from selfdraft.training.checkpointing import DataCursor
from selfdraft.training.draft_vocab import draft_vocab_of
from selfdraft.training.records import ShardWriter, _write_json, load_records


def usable(rec: dict, max_seq_len: int) -> bool:
    """The trainer's filter (trainer.load_sequences): >= 2 tokens and a supervised token after truncation."""
    ids, mask = rec["input_ids"][:max_seq_len], rec["loss_mask"][:max_seq_len]
    return len(ids) >= 2 and any(mask[1:])


def drawn_by(ckpt: Path) -> tuple[int, int, int]:
    """(seed, sequences drawn, max_seq_len) of a checkpoint's run, from its provenance."""
    prov = read_config(ckpt)["provenance"]
    train = prov["train"]
    return train["seed"], prov["steps"] * train["batch_size"] * train["grad_accum"] * prov.get("world_size", 1), train["max_seq_len"]


def seen_ids(data: Path, seed: int, drawn: int, max_seq_len: int = 512) -> tuple[set[str], dict]:
    """Ids of the first `drawn` train records a run with `seed` draws from `data` (its data cursor replayed)."""
    seqs = [r["id"] for r in load_records(data, "train") if usable(r, max_seq_len)]
    cursor = DataCursor()
    idx = cursor.take(len(seqs), drawn, seed)
    info = {"seed": seed, "sequences_drawn": drawn, "max_seq_len": max_seq_len, "epochs": drawn / len(seqs),
            "cursor": [cursor.epoch, cursor.index]}
    return {seqs[i] for i in idx}, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the data the campaign trained on so far")
    seen = ap.add_mutually_exclusive_group(required=True)
    seen.add_argument("--seen", type=Path, help="the campaign checkpoint (its provenance gives seed and sequences drawn)")
    seen.add_argument("--drawn", help="SEED:N: the run drew N sequences in the seed's order (the manifest's replay command uses it)")
    ap.add_argument("--add", type=Path, action="append", default=[], help="another dataset directory (repeatable)")
    ap.add_argument("--add-limit", type=int, default=0, help="at most N train records from each --add (0 = all; a seeded sample)")
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.out.exists():
        print(f"error: {args.out} exists; pick a new --out (a segment's data never changes under a run)", file=sys.stderr)
        return 2
    if args.seen:
        seed, drawn, max_seq_len = drawn_by(args.seen)
    else:
        seed, drawn = map(int, args.drawn.split(":"))
        max_seq_len = 512
    data = args.data
    seen, info = seen_ids(data, seed, drawn, max_seq_len)
    base = load_records(data)
    val = [r for r in base if r["split"] == "val"]
    fresh = [r for r in base if r["split"] == "train" and r["id"] not in seen]
    keys = {tuple(r["input_ids"]) for r in base}
    sources = [{"dir": str(data), "val": len(val), "train_fresh": len(fresh), "train_seen_excluded": len(seen),
                **({"checkpoint": str(args.seen)} if args.seen else {}), **info}]
    rows = val + fresh
    for extra in args.add:
        recs = [r for r in load_records(extra, "train") if tuple(r["input_ids"]) not in keys]
        if args.add_limit and len(recs) > args.add_limit:
            recs = random.Random(0).sample(recs, args.add_limit)
        sources.append({"dir": str(extra), "train": len(recs)})
        rows += recs
    writer = ShardWriter(args.out)
    writer.write(rows)
    vocab = draft_vocab_of(data, args.vocab_size, _vocab_size(data))
    vocab.save(args.out / f"draft_vocab_{args.vocab_size}.safetensors")
    tokens = {s: sum(len(r["input_ids"]) for r in rows if r["split"] == s) for s in ("train", "val")}
    # what one epoch costs the trainer (sequences truncated to max_seq_len): the largest fresh --token-budget
    tokens["epoch"] = sum(min(len(r["input_ids"]), max_seq_len) for r in rows if r["split"] == "train" and usable(r, max_seq_len))
    _write_json(args.out / "manifest.json", {
        "kind": "campaign segment", "command": sys.argv, "sources": sources, "tokens": tokens,
        "replay": replay_command(args, seed, drawn),
        "draft_vocab": {"from": str(data), "size": args.vocab_size, "coverage_of_its_answers": vocab.coverage},
    })
    print(json.dumps({"out": str(args.out), "sources": sources, "tokens": tokens}, indent=1))
    return 0


def replay_command(args, seed: int, drawn: int) -> str:
    """The command that rebuilds this directory from the same inputs without the checkpoint (which a
    later campaign commit replaces)."""
    adds = " ".join(f"--add {a}" for a in args.add)
    limit = f" --add-limit {args.add_limit}" if args.add_limit else ""
    return (f"python scripts/campaign_data.py --data {args.data} --drawn {seed}:{drawn} {adds}{limit} "
            f"--vocab-size {args.vocab_size} --out {args.out}")


def _vocab_size(data: Path) -> int:
    """The target's vocabulary size, from the dataset's manifest (`data regenerate` writes it)."""
    return json.loads((data / "manifest.json").read_text())["target"]["vocab_size"]


if __name__ == "__main__":
    raise SystemExit(main())
