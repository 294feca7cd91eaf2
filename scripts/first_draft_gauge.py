"""How predictable the target is, and where a block drafter's first draft fails, on a validation split.

For every supervised position t of the split's conversations (teacher forced, one block per position):
the target's own top-1 probability max p_t, and whether draft 1 equals the target's greedy token
argmax p_t (what greedy verification accepts) and the data's token x_{t+1}. Reports the share of
positions with max p_t > 0.5 and > 0.8 and acc@1 in each confidence bin (JSON + Markdown), split by
whether the position is a copy: the pair (x_t, argmax p_t) already occurred earlier in the same sequence,
which an n-gram or suffix drafter would propose. --copy-bias B1,B2,.. also reports acc@1 with DSpark's
copy bias at each β (cfg.copy_bias: + β·log(1 + n) on each token that followed x_t n times before; with
--copy-context 2 each token that followed the pair x_{t-1} x_t), to fit it.

    python scripts/first_draft_gauge.py checkpoints/dspark --data data/regen --out gauge.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from selfdraft.checkpoint import load_module
from selfdraft.methods.dflash.drafter import add_follower_bias
from selfdraft.methods.dflash.train import draft_losses, teacher_forced_blocks
from selfdraft.target import Target, lm_logits
from selfdraft.training.trainer import load_sequences, make_batch
from selfdraft.vocab import DraftVocab, draft_columns

BINS = ((0.0, 0.5), (0.5, 0.8), (0.8, 1.01))


@torch.no_grad()
def gauge(ckpt: str, data: str, max_seq_len: int, batch_size: int, threads: int, limit: int, skip: int = 0,
          betas: tuple[float, ...] = (), context: int = 1, draft_vocab: str | None = None) -> dict:
    torch.set_num_threads(threads)
    target = Target.load(None, dtype="float32")
    model, cfg = load_module(ckpt, target, dtype=torch.float32)
    if cfg.method not in ("dflash", "dspark"):
        raise SystemExit(f"error: {ckpt} is a {cfg.method} drafter; this gauge reads block drafters (dflash, dspark)")
    cfg = replace(cfg, anchors_per_seq=100_000, dense_first=False)  # a block at every position, no extra queries
    p_top, hit_greedy, hit_data, copy = [], [], [], []
    hit_beta = {b: 0 for b in betas}
    # the copy-bias readings draft over the inference vocabulary when given (a checkpoint's draft_vocab.safetensors)
    ids = DraftVocab.load(draft_vocab).target_ids if draft_vocab else model.draft_ids
    seqs = load_sequences(data, "val", max_seq_len)[skip : skip + limit if limit else None]
    for i in range(0, len(seqs), batch_size):
        batch = make_batch(seqs[i : i + batch_size], target, cfg.feature_layers)
        tf = teacher_forced_blocks(model, batch, target, cfg, torch.Generator().manual_seed(0))
        first = torch.zeros_like(tf.valid)
        first[..., 0] = True
        tf.valid &= first  # draft 1 only: [B, A, γ]
        bias, e = None, None
        if getattr(model, "markov", None) is not None:
            e = model.heads(tf.h, tf.prev).e[tf.valid]  # [N, r]
            W2 = model.markov.W2.weight if model.draft_ids is None else model.markov.W2.weight[model.draft_ids]
            bias = F.linear(e, W2).float()
        d = draft_losses(model, target, batch, tf, bias, with_l1=False)
        pred = d.pred  # [N] target ids (a draft vocabulary maps back)
        logits = target.lm_head(tf.target_rows(batch.last_hidden)).float()  # [N, V] p_t for x_{t+1}
        greedy = logits.argmax(-1)  # [N]
        b = torch.arange(tf.src.shape[0])[:, None, None].expand_as(tf.src)[tf.valid]  # [N] sequence
        prefixes = [batch.input_ids[i, : t + 1].tolist() for i, t in zip(b.tolist(), tf.src[tf.valid].tolist())]
        follow = [followers(x) for x in prefixes]
        if betas:
            matched = follow if context == 1 else [followers(x, context) for x in prefixes]
            count_copy_hits(model, target, tf, e, ids, matched, greedy, hit_beta)
        p = torch.softmax(logits, -1)
        p_top.append(p.max(-1).values)
        hit_greedy.append(pred == greedy)
        hit_data.append(pred == tf.gold[tf.valid])
        copy.append(torch.tensor([int(g) in f for f, g in zip(follow, greedy)], dtype=torch.bool))
    p_top, hit_greedy, hit_data = torch.cat(p_top), torch.cat(hit_greedy).float(), torch.cat(hit_data).float()
    copy = torch.cat(copy)
    out = {"checkpoint": ckpt, "data": data, "positions": int(p_top.numel()),
           "share_p_gt_0.5": float((p_top > 0.5).float().mean()), "share_p_gt_0.8": float((p_top > 0.8).float().mean()),
           "acc1_greedy": float(hit_greedy.mean()), "acc1_data": float(hit_data.mean()), "bins": [],
           "copy_context": context, "copy_bias_vocab": None if ids is None else int(ids.numel()), "acc1_greedy_by_copy_bias": {str(b): n / p_top.numel() for b, n in hit_beta.items()}}
    for lo, hi in BINS:
        m = (p_top >= lo) & (p_top < hi)
        mean = lambda x, sel: float(x[sel].mean()) if sel.any() else None  # noqa: E731
        out["bins"].append({"p_top": f"[{lo:g}, {min(hi, 1):g}]", "share": float(m.float().mean()),
                            "acc1_greedy": mean(hit_greedy, m), "acc1_data": mean(hit_data, m),
                            "copy_share": mean(copy.float(), m), "acc1_greedy_copy": mean(hit_greedy, m & copy),
                            "acc1_greedy_other": mean(hit_greedy, m & ~copy)})
    return out


def count_copy_hits(model, target, tf, e, ids, follow: list[Counter], greedy: torch.Tensor, hits: dict) -> None:
    """Add to hits[β] the first drafts that equal argmax p_t once the copy bias β·log(1 + n) is added (n: how
    often each token followed x_t in x_0..x_t), as the drafter adds it at inference over its draft vocabulary
    `ids` [V'] (None: all V); e [N, r] the Markov features (None without a Markov head)."""
    ids = ids if ids is not None else torch.arange(target.vocab_size)
    column = draft_columns(ids, target.vocab_size)
    rows = target.model.get_output_embeddings().weight[ids].detach()
    bias = 0 if e is None else F.linear(e, model.markov.W2.weight[ids]).float()  # B_k over the V' columns
    U = lm_logits(target, tf.h[tf.valid], rows.t()).float() + bias  # [N, V']
    for j, f in enumerate(follow):
        for beta in hits:
            u = U[j].clone()
            if f:
                add_follower_bias(u, f, column, beta)
            hits[beta] += int(ids[u.argmax()] == greedy[j])


def followers(seq: list[int], o: int = 1) -> Counter:
    """How often each token followed the last o tokens of seq earlier in seq: [5, 7, 5] -> {7: 1}. A position
    is a copy when the target's greedy token is among its followers with o = 1."""
    tail = seq[-o:]
    return Counter(seq[i + o] for i in range(len(seq) - o) if seq[i : i + o] == tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--data", required=True, help="a regenerated dataset (selfdraft data regenerate) with a val split")
    ap.add_argument("--out", required=True, help="JSON file (a .md table is written beside it)")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="the first N val conversations (0 = all)")
    ap.add_argument("--skip", type=int, default=0, help="start after the first N val conversations (a second sample)")
    ap.add_argument("--copy-bias", default="", help="comma list of β: acc@1 with DSpark's copy bias at each")
    ap.add_argument("--copy-context", type=int, default=1, help="tokens the copy bias matches (cfg.copy_context)")
    ap.add_argument("--draft-vocab", default=None, help="the copy-bias readings draft among these ids (a draft_vocab.safetensors)")
    a = ap.parse_args()
    betas = tuple(float(x) for x in a.copy_bias.split(",") if x.strip())
    res = gauge(a.checkpoint, a.data, a.max_seq_len, a.batch_size, a.threads, a.limit, a.skip, betas, a.copy_context, a.draft_vocab)
    out = Path(a.out)
    out.write_text(json.dumps(res, indent=1) + "\n")
    rows = [f"| {b['p_top']} | {b['share']:.3f} | {b['acc1_greedy']:.3f} | {b['acc1_data']:.3f} | {b['copy_share']:.3f} | "
            f"{b['acc1_greedy_copy']:.3f} | {b['acc1_greedy_other']:.3f} |" for b in res["bins"]]
    out.with_suffix(".md").write_text(
        f"{res['positions']} val positions; max p_t > 0.5: {res['share_p_gt_0.5']:.3f}, > 0.8: {res['share_p_gt_0.8']:.3f}; "
        f"acc@1 vs argmax p_t {res['acc1_greedy']:.3f}, vs the data {res['acc1_data']:.3f}\n\n"
        "| max p_t | share | acc@1 (argmax p_t) | acc@1 (data) | copies | acc@1 on copies | acc@1 elsewhere |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    if betas:
        with out.with_suffix(".md").open("a") as f:
            f.write(f"\n| copy bias β (context {a.copy_context}, drafting among {res['copy_bias_vocab'] or 'all'} tokens) | " + " | ".join(f"{b:g}" for b in betas) + " |\n|---|" + "---:|" * len(betas)
                    + "\n| acc@1 (argmax p_t) | " + " | ".join(f"{v:.3f}" for v in res["acc1_greedy_by_copy_bias"].values())
                    + " |\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
