"""The campaign's data: a ledger of every record its weights trained on, and segments of what is left.

The campaign never trains on a token twice while fresh ones exist. Its committed weights carry a
ledger (`ledger.json` beside them: the "source:id" of every training record they drew, over all
segments), so any machine can build the next segment from the same sources without the old runs:

  segment  a dataset directory: the val records of the first --from (the val curve stays comparable
           from segment to segment), then every train record of each --from that the ledger does not
           hold and whose first prompt no --from holds out as val (DIR:N keeps a seeded sample of N of
           them), and the first source's draft vocabulary (--vocab-size; the target's own answers:
           original answers would pull in tokens it rarely emits).
  ledger   the ledger plus the records a run drew from its segment: the trainer visits a segment in a
           seeded order (training/checkpointing.py DataCursor), so seed, steps, batch size, gradient
           accumulation and world size in the run's provenance say exactly which records it drew.

    python scripts/campaign/campaign_data.py segment --from work/data/regen-v1 --from work/data/original:2200 \\
        --ledger checkpoints/dspark/ledger.json --out work/data/seg-x
    python scripts/campaign/campaign_data.py ledger --run work/campaign/seg-x --ledger checkpoints/dspark/ledger.json \\
        --out work/ledger.json
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
from selfdraft.training.sources import ledger_key, read_ledger
from selfdraft.training.trainer import trainable


def key(rec: dict) -> str:
    """A record's ledger key: ids are prompt hashes, shared by the regenerated and original answers of one prompt."""
    return ledger_key(rec["source"], rec["id"])


def usable(rec: dict, max_seq_len: int) -> bool:
    """A record the trainer keeps after truncation (trainer.load_sequences)."""
    return trainable(rec["input_ids"][:max_seq_len], rec["loss_mask"][:max_seq_len])


def first_prompt(rec: dict) -> str | None:
    """A record's first user turn: a two-turn answer to a val prompt is that val prompt seen in training."""
    return next((m["content"] for m in rec["messages"] if m.get("role") == "user"), None)


def ledger_records(path: Path | None) -> set[str]:
    """The "source:id" keys of the records drawn; an absent path is an empty ledger."""
    return read_ledger(path) if path and path.exists() else set()


def drawn(run: Path, data: Path) -> tuple[list[dict], dict]:
    """The train records of `data` the run saved in `run` drew, its data cursor replayed from its provenance."""
    prov = read_config(run)["provenance"]
    train = prov["train"]
    seqs = [r for r in load_records(data, "train") if usable(r, train["max_seq_len"])]
    n = prov["steps"] * train["batch_size"] * train["grad_accum"] * prov.get("world_size", 1)
    cursor = DataCursor()
    idx = cursor.take(len(seqs), n, train["seed"])
    if n > len(seqs):
        print(f"warning: {run} went past one epoch of {data}: some records were drawn twice", file=sys.stderr)
    info = {"run": str(run), "data": str(data), "seed": train["seed"], "steps": prov["steps"], "drawn": n,
            "tokens": prov["tokens"], "cursor": [cursor.epoch, cursor.index]}
    return [seqs[i] for i in dict.fromkeys(idx)], info


def segment(args) -> int:
    if args.out.exists():
        print(f"error: {args.out} exists; pick a new --out (a segment's data never changes under a run)", file=sys.stderr)
        return 2
    if args.ledger and not args.ledger.exists():  # a typo must not turn into "nothing trained yet"
        print(f"error: no ledger at {args.ledger} (omit --ledger when the weights trained on none of these sources)", file=sys.stderr)
        return 2
    ledger = ledger_records(args.ledger)
    sources = [(Path(d), int(n or 0)) for d, _, n in (s.partition(":") for s in args.sources)]
    val = load_records(sources[0][0], "val")
    # Held out by first prompt, not by id: `regenerate --turns 2` gives a val prompt a new id once a second turn follows it.
    held_out = {first_prompt(r) for r in val} | {first_prompt(r) for src, _ in sources[1:] for r in load_records(src, "val")}
    held_out.discard(None)
    rows, seen, summary = list(val), set(ledger), []
    for src, limit in sources:
        recs = [r for r in load_records(src, "train") if key(r) not in seen and usable(r, args.max_seq_len)]
        n = len(recs)
        recs = [r for r in recs if first_prompt(r) not in held_out]
        recs = list({key(r): r for r in recs}.values())  # a source may repeat a record (a copied dataset)
        if limit and len(recs) > limit:
            recs = random.Random(0).sample(recs, limit)
        seen |= {key(r) for r in recs}
        rows += recs
        summary.append({"dir": str(src), "train": len(recs), "limit": limit or None, "held_out": n - len(recs)})
    if len(rows) == len(val):
        print(f"error: the ledger holds every train record of {[str(s) for s, _ in sources]}: add a source "
              "(`selfdraft data regenerate` with a larger --limit, or `data original`)", file=sys.stderr)
        return 2
    ShardWriter(args.out).write(rows)
    first = sources[0][0]
    vocab = draft_vocab_of(first, args.vocab_size, json.loads((first / "manifest.json").read_text())["target"]["vocab_size"])
    vocab.save(args.out / f"draft_vocab_{args.vocab_size}.safetensors")
    train = [r for r in rows if r["split"] == "train"]
    tokens = {"train": sum(len(r["input_ids"]) for r in train), "val": sum(len(r["input_ids"]) for r in val),
              # what one epoch costs the trainer (truncated to max_seq_len): the largest fresh --token-budget
              "epoch": sum(min(len(r["input_ids"]), args.max_seq_len) for r in train)}
    manifest = {"kind": "campaign segment", "command": sys.argv, "ledger": str(args.ledger), "ledger_records": len(ledger),
                "val": {"dir": str(first), "records": len(val)}, "sources": summary, "tokens": tokens,
                "draft_vocab": {"from": str(first), "size": args.vocab_size, "coverage_of_its_answers": vocab.coverage}}
    _write_json(args.out / "manifest.json", manifest)
    print(json.dumps({k: manifest[k] for k in ("sources", "tokens")}))
    return 0


def ledger(args) -> int:
    records = ledger_records(args.ledger)
    data = args.data or Path(read_config(args.run)["provenance"]["data"])
    recs, info = drawn(args.run, data)
    new = {key(r) for r in recs} - records
    runs = (json.loads(args.ledger.read_text())["runs"] if args.ledger and args.ledger.exists() else []) + [{**info, "new": len(new)}]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = {"what": "every training record the campaign's weights drew (source:id)", "runs": runs,
            "records": sorted(records | new)}
    args.out.write_text(json.dumps(body, separators=(",", ":")) + "\n")  # compact: it is committed beside the weights
    print(f"{len(new)} records added ({info['drawn']} drawn by {args.run}); {len(records) + len(new)} in {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("segment", help="a dataset of what the ledger does not hold")
    s.add_argument("--from", dest="sources", action="append", required=True, help="DIR or DIR:N (repeatable; the first gives val)")
    s.add_argument("--ledger", type=Path, help="the committed weights' ledger (absent: nothing trained yet)")
    s.add_argument("--vocab-size", type=int, default=16384)
    s.add_argument("--max-seq-len", type=int, default=512)
    s.add_argument("--out", type=Path, required=True)
    g = sub.add_parser("ledger", help="a ledger plus what a run drew")
    g.add_argument("--run", type=Path, required=True, help="a checkpoint the trainer saved (its provenance names the data)")
    g.add_argument("--data", type=Path, help="the run's data directory (default: the one in its provenance)")
    g.add_argument("--ledger", type=Path, help="the ledger of the weights the run started from")
    g.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    return segment(args) if args.cmd == "segment" else ledger(args)


if __name__ == "__main__":
    raise SystemExit(main())
