"""A training source that costs no generation: ShareGPT's original answers, target-labelled.

Regenerating answers with the target (data.regenerate) runs it once per answer token; on a CPU that
is ~100 tokens/s. Here the first exchange of each ShareGPT conversation (user turn + the original
assistant answer) is used verbatim as the context, and the labels come from the target itself: the
feature cache (`selfdraft data features`) stores its final hidden state and the log-partition of p_t
at every position, so the distillation losses (TV against p_t) teach the drafter the target's own
next-token distribution on these contexts. Only a forward pass per token is paid, once.

The hard tokens of these answers are not the target's (they were written by another model): the
cross-entropy part of a loss then fits the source's tokens, which is why DSpark's loss weighs the
TV term (against p_t) most. Records follow the data.py contract, with source "sharegpt-original".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from selfdraft.config import ConfigError
from selfdraft.training.records import DataError, ShardWriter, _write_json, dataset_totals, tokenize_conversation
from selfdraft.training.sources import SHAREGPT, SourceStats, check_not_eval, prompt_id, read_json_array, sharegpt_path, split_of

SOURCE = "sharegpt-original"


def first_exchange(obj: object) -> tuple[str, str] | None:
    """The first (user, assistant) pair of a ShareGPT record, or None when it has none."""
    conv = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    a, b = conv[0], conv[1]
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    if a.get("from") not in ("human", "user") or b.get("from") not in ("gpt", "assistant"):
        return None
    user, answer = a.get("value"), b.get("value")
    if not (isinstance(user, str) and isinstance(answer, str) and user.strip() and answer.strip()):
        return None
    return user, answer


@dataclass
class ImportSummary:
    written: int  # records added by this run
    skipped_existing: int  # records an earlier (interrupted) run already wrote
    too_long_prompt: int  # the user turn alone fills max_seq_len: nothing left to supervise
    duplicates: int
    malformed: int
    wall_s: float


def import_original(
    target, out_dir: str | Path, limit: int, source: str = SHAREGPT, max_seq_len: int = 512,
    val_fraction: float = 0.02, progress: bool = True,
) -> ImportSummary:
    """Write up to `limit` first exchanges of `source` (ShareGPT JSON) as training records (resumable).

    Conversations are taken in prompt-id order (a uniform, stable sample) and split by the same
    prompt-hash rule as regenerated data, so a prompt is in the same split in both kinds of dataset.
    Each record is truncated to max_seq_len tokens.
    """
    from selfdraft.progress import progress_bar

    if limit < 1 or max_seq_len < 8:
        raise ConfigError(f"limit must be >= 1 and max_seq_len >= 8 (got {limit}, {max_seq_len})")
    if target.tokenizer is None:
        raise ConfigError("importing conversations needs the target's tokenizer")
    path = sharegpt_path() if source == SHAREGPT else Path(source).expanduser()
    check_not_eval(path)
    if not path.is_file():
        raise DataError(f"{source}: not a ShareGPT-style JSON file")
    out_dir = Path(out_dir)
    t0, stats = time.perf_counter(), SourceStats()
    pairs: dict[str, tuple[str, str]] = {}
    duplicates = 0
    for pair in read_json_array(path, stats, parse=first_exchange):
        pid = prompt_id([pair[0]])
        if pid in pairs:
            duplicates += 1
        else:
            pairs[pid] = pair
    writer = ShardWriter(out_dir)
    existing = len(writer.done)
    chosen, too_long = [], 0
    ordered = sorted(pairs)
    bar = progress_bar(total=limit, unit="conv", disable=not progress)
    bar.update(min(limit, sum(1 for pid in ordered if pid in writer.done)))
    for pid in ordered:
        if len(chosen) + len(writer.done) >= limit:
            break
        if pid in writer.done:
            continue
        user, answer = pairs[pid]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        try:
            conv = tokenize_conversation(target.tokenizer, messages)
        except DataError:
            stats.malformed += 1
            continue
        ids, mask = conv.input_ids[:max_seq_len], conv.loss_mask[:max_seq_len]
        if sum(mask[1:]) == 0:
            too_long += 1
            continue
        chosen.append({"id": pid, "split": split_of(pid, val_fraction), "source": SOURCE,
                       "messages": messages, "input_ids": ids, "loss_mask": mask})
        bar.update(1)
        if len(chosen) >= 200:
            writer.write(chosen)
            chosen = []
    writer.write(chosen)
    bar.close()
    summary = ImportSummary(len(writer.done) - existing, existing, too_long, duplicates, stats.malformed, time.perf_counter() - t0)
    _write_json(out_dir / "manifest.json", {
        "source": SOURCE, "from": str(source), "target": target.identity(), "limit": limit,
        "max_seq_len": max_seq_len, "val_fraction": val_fraction,
        "note": "contexts are the source's original answers; labels (p_t) come from the target via the feature cache",
        "summary": summary.__dict__, "totals": dataset_totals(out_dir, target.eos_ids),
    })
    return summary
