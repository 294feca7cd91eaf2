"""τ of the training-free drafters, replayed on recorded greedy outputs (no target forwards).

At T = 0 a round accepts the longest prefix of its drafts that equals the target's own continuation,
so with the plain greedy output of each prompt recorded once, any n-gram / suffix configuration's τ
(fixed γ, every draft verified) is recomputed exactly in seconds. Prompts are replayed in order, so a
suffix drafter's global tree warms across them as in `selfdraft bench`.

    python scripts/suffix_replay.py record --datasets mt-bench,humaneval,gsm8k,alpaca,cnn-dm --num-prompts 10 --out runs/replay/outputs.json
    python scripts/suffix_replay.py replay runs/replay/outputs.json --suffix max_spec_factor=2,min_token_prob=0.05
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from selfdraft.config import GenerationConfig, SamplingParams


def record(args) -> None:
    import torch

    from selfdraft.bench import load_prompt_set
    from selfdraft.decode import generate
    from selfdraft.loader import load_drafter
    from selfdraft.target import Target

    torch.set_num_threads(args.threads)
    target = Target.load(None)
    none = load_drafter("none", target)
    out = []
    for name in args.datasets.split(","):
        for i, ids in enumerate(load_prompt_set(name, args.num_prompts).encode(target)):
            res = generate(target, none, ids, SamplingParams(), GenerationConfig(max_new_tokens=args.max_new_tokens))
            out.append({"dataset": name, "index": i, "prompt": ids, "output": res.token_ids})
            print(f"{name} {i}: {len(res.token_ids)} tokens", file=sys.stderr)
    json.dump(out, open(args.out, "w"))


def replay_tau(drafter, records, gamma: int) -> dict[str, float]:
    """Per dataset: τ = committed tokens / rounds, replaying each record's greedy output."""
    rounds, tokens = {}, {}
    for r in records:
        drafter.prompt_len = len(r["prompt"])
        drafter.begin(r["prompt"], None)
        out, seq, n = r["output"], list(r["prompt"]) + r["output"][:1], 1  # the prefill's token
        while n < len(out):
            budget = min(gamma, len(out) - n - 1)
            drafts = drafter.propose(seq, budget, SamplingParams(), None).tokens.tolist() if budget > 0 else []
            k = 0
            while k < len(drafts) and drafts[k] == out[n + k]:
                k += 1
            step = k + 1
            seq += out[n : n + step]
            n += step
            d = r["dataset"]
            rounds[d], tokens[d] = rounds.get(d, 0) + 1, tokens.get(d, 0) + step
        drafter.end(out)
    return {d: tokens[d] / rounds[d] for d in rounds}


def replay(args) -> None:
    from selfdraft.loader import load_drafter
    from selfdraft.methods.suffix.config import SuffixConfig

    records = json.load(open(args.outputs))
    types = {f.name: f.type for f in fields(SuffixConfig)}
    conv = {"int": int, "float": float, "bool": lambda v: v in ("1", "true", "True")}
    kw = dict(kv.split("=") for kv in args.suffix.split(",") if kv) if args.suffix else {}
    cfg = SuffixConfig(**{k: conv[types[k]](v) for k, v in kw.items()})
    for spec in args.drafters.split(","):
        taus = replay_tau(load_drafter(spec, None, suffix=cfg), records, args.gamma)
        print(f"{spec:<12} {args.suffix or 'defaults':<40} " + " ".join(f"{d} {t:.2f}" for d, t in taus.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--datasets", default="mt-bench,humaneval,gsm8k,alpaca,cnn-dm")
    r.add_argument("--num-prompts", type=int, default=10)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay")
    p.add_argument("outputs")
    p.add_argument("--drafters", default="ngram,suffix")
    p.add_argument("--suffix", default="", help="SuffixConfig overrides, e.g. max_spec_factor=2,min_token_prob=0.05")
    p.add_argument("--gamma", type=int, default=7)
    args = ap.parse_args()
    record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    main()
