"""Regeneration: the target answers the training prompts through its chat template, turn by turn,
in batches; the records go to resumable JSONL shards with a manifest (docs/data.md).
"""

from __future__ import annotations

import json
import resource
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfdraft.config import ConfigError, SamplingParams
from selfdraft.sampling import sample_logits
from selfdraft.training.records import DataError, ShardWriter, _write_json, dataset_totals, tokenize_conversation
from selfdraft.training.sources import Prompt


@dataclass(frozen=True)
class RegenConfig:
    """How the target answers the prompts. Sampling defaults: the target's recommended ones, else these."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512  # longer (templated) prompts are filtered; also caps later-turn contexts
    num_turns: int = 1  # answer up to this many user turns, each with the target's own earlier answers
    batch_size: int = 16  # prompts sampled together (left padded, sorted by prompt length)
    shard_size: int = 1000  # records per JSONL shard
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("need temperature >= 0, top_p in (0, 1] and top_k >= 0")
        if min(self.max_new_tokens, self.max_prompt_tokens, self.num_turns, self.batch_size, self.shard_size) < 1:
            raise ConfigError("max_new_tokens, max_prompt_tokens, num_turns, batch_size and shard_size must be >= 1")

    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "seed": self.seed}


def recommended_sampling(target) -> dict:
    """The target's own sampling recommendation from its generation_config, if it makes one."""
    gc = getattr(target.model, "generation_config", None)
    if gc is None or not getattr(gc, "do_sample", False):
        return {}
    return {k: getattr(gc, k) for k in ("temperature", "top_p") if getattr(gc, k, None) is not None}


@dataclass
class Answer:
    text: str  # decoded content (special tokens dropped)
    content_ids: list[int]  # sampled ids before the end-of-turn token
    finished: bool  # the target emitted end-of-turn (else cut by max_new_tokens)

    @property
    def num_tokens(self) -> int:
        """Generated tokens, incl. the end-of-turn token when finished."""
        return len(self.content_ids) + self.finished


def generate_answers(
    target, prompts: list[list[int]], cfg: RegenConfig, generator: torch.Generator | None = None
) -> list[Answer]:
    """Answer a batch of templated prompts (token ids ending in the assistant header) together."""
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    answers = []
    for row in sample_batch(target, prompts, params, cfg.max_new_tokens, generator):
        finished = bool(row) and row[-1] in target.eos_ids
        content = row[:-1] if finished else row
        answers.append(Answer(target.tokenizer.decode(content, skip_special_tokens=True), content, finished))
    return answers


@torch.inference_mode()
def sample_batch(
    target, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
    generator: torch.Generator | None = None, stop_ids: set[int] | None = None,
) -> list[list[int]]:
    """Sample continuations of B prompts together: left padding + attention mask + one KV cache.

    Returns per prompt the generated ids, ending at (and including) the first end-of-turn token
    (stop_ids, default the target's eos_ids; a sampled user turn may end with another token)
    or after max_new_tokens. Finished rows leave the batch (cache rows dropped), so long answers
    do not make short ones pay. (HF `generate` measured several times slower per token on CPU.)
    """
    B, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((B, width), dtype=torch.long)  # [B, L] left padded
    mask = torch.zeros((B, width), dtype=torch.long)  # [B, L] 1 on real tokens
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, L] each prompt starts at position 0
    cache = target.new_cache()
    step = target.forward(ids, cache, position_ids=positions, attention_mask=mask, last_only=True)
    out: list[list[int]] = [[] for _ in prompts]
    alive = torch.arange(B)  # [B'] original row of each live batch row
    next_pos = mask.sum(-1)  # [B'] position of the token sampled next
    eos = torch.tensor(sorted(target.eos_ids if stop_ids is None else stop_ids), dtype=torch.long)
    for _ in range(max_new_tokens):
        # [B'] on the host (one copy per token): the bookkeeping below (alive rows, masks, EOS) is host-side
        tok = sample_logits(step.logits[:, -1], params, generator).cpu()
        for row, t in zip(alive.tolist(), tok.tolist()):
            out[row].append(t)
        keep = ~torch.isin(tok, eos)  # [B']
        if len(out[alive[0]]) == max_new_tokens or not keep.any():
            break
        if not keep.all():
            cache.batch_select_indices(keep.nonzero().squeeze(-1))
            alive, tok, mask, next_pos = alive[keep], tok[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # [B', past + 1]
        step = target.forward(tok[:, None], cache, position_ids=next_pos[:, None], attention_mask=mask, last_only=True)
        next_pos = next_pos + 1
    return out


def answer_batch(
    target, prompts: list[Prompt], cfg: RegenConfig, generator: torch.Generator | None = None
) -> tuple[list[dict], int]:
    """Regenerate the conversations of a batch turn by turn -> (records, generated tokens).

    Later turns are prompted with the target's own earlier answers, as the exact ids it sampled.
    A conversation stops early when an answer is cut by max_new_tokens (continuing after a
    truncated answer would train on a context the target never produces) or when its context
    gets too long.
    """
    tok = target.tokenizer
    convs: list[list[dict]] = [[] for _ in prompts]
    sampled: list[dict[int, list[int]]] = [{} for _ in prompts]
    open_last = [False] * len(prompts)
    generated = 0
    for turn in range(cfg.num_turns):
        todo = {}
        for i, p in enumerate(prompts):
            if turn < len(p.turns) and not open_last[i]:
                msgs = convs[i] + [{"role": "user", "content": p.turns[turn]}]
                ids = tokenize_conversation(tok, msgs, sampled[i], generation_prompt=True).input_ids
                if turn == 0 or _fits(target, ids, cfg):
                    todo[i] = (msgs, ids)
        if not todo:
            break
        for i, ans in zip(todo, generate_answers(target, [ids for _, ids in todo.values()], cfg, generator)):
            convs[i] = todo[i][0] + [{"role": "assistant", "content": ans.text}]
            sampled[i][len(convs[i]) - 1] = ans.content_ids
            open_last[i] = not ans.finished
            generated += ans.num_tokens
    records = []
    for p, msgs, ids, cut in zip(prompts, convs, sampled, open_last):
        conv = tokenize_conversation(tok, msgs, ids, open_last=cut)
        records.append({"id": p.id, "split": p.split, "source": p.source, "messages": msgs,
                        "input_ids": conv.input_ids, "loss_mask": conv.loss_mask})
    return records, generated


def _fits(target, prompt_ids: list[int], cfg: RegenConfig) -> bool:
    n = len(prompt_ids)
    return n <= cfg.max_prompt_tokens and n + cfg.max_new_tokens <= target.max_context


@dataclass
class RegenSummary:
    written: int  # records written by this run
    skipped_done: int  # prompts already present from an earlier run
    generated_tokens: int  # tokens generated by this run
    wall_s: float
    tokens_per_s: float
    peak_rss_mb: float


def regenerate(
    target,
    prompts: list[Prompt],
    out_dir: str | Path,
    cfg: RegenConfig,
    provenance: dict | None = None,
    progress: bool = True,
    stop_after_batches: int | None = None,
) -> RegenSummary:
    """Have the target answer `prompts`, appending records to out_dir's shards (resumable).

    provenance (command, source stats) goes into the manifest. stop_after_batches simulates a kill
    (tests) after that many batches. Batches are sorted by prompt length so padding stays small.
    """
    from selfdraft.progress import progress_bar

    out_dir = Path(out_dir)
    manifest = _open_manifest(out_dir, target, cfg, provenance or {})
    writer = ShardWriter(out_dir, cfg.shard_size)
    if writer.repaired:
        warnings.warn(f"{out_dir}: dropped {writer.repaired} half-written line(s) of an interrupted run; "
                      f"those conversations are regenerated", stacklevel=2)
    pending = [p for p in prompts if p.id not in writer.done]
    lengths = {p.id: len(target.encode_prompt(p.turns[0])) for p in pending}
    pending.sort(key=lambda p: (lengths[p.id], p.id))
    batches = [pending[i : i + cfg.batch_size] for i in range(0, len(pending), cfg.batch_size)]
    t0, generated, written = time.perf_counter(), 0, 0
    bar = progress_bar(total=len(pending), desc="regenerate", unit="conv", disable=not progress)
    for b, batch in enumerate(batches):
        if stop_after_batches is not None and b >= stop_after_batches:
            break
        generator = torch.Generator().manual_seed(cfg.seed + int(batch[0].id[:8], 16))  # same batch, same answers
        records, n = answer_batch(target, batch, cfg, generator)
        writer.write(records)
        generated, written = generated + n, written + len(records)
        _note_progress(out_dir, manifest, written, generated, time.perf_counter() - t0)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - t0):.1f}", tokens=generated)
    bar.close()
    wall = time.perf_counter() - t0
    summary = RegenSummary(written, len(prompts) - len(pending), generated, wall,
                           generated / wall if wall > 0 else 0.0, peak_rss_mb())
    _close_manifest(out_dir, manifest, summary, complete=written == len(pending), eos_ids=target.eos_ids)
    return summary


def peak_rss_mb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _open_manifest(out_dir: Path, target, cfg: RegenConfig, provenance: dict) -> dict:
    """Load (resume) or start the manifest; refuse to mix data from another target or sampling."""
    path = out_dir / "manifest.json"
    ident = target.identity()
    if path.exists():
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is damaged ({e}); restore it, or regenerate into a new directory") from e
        if manifest["target"]["fingerprint"] != ident["fingerprint"] or manifest["sampling"] != cfg.sampling():
            raise DataError(
                f"{out_dir} was regenerated with another target or sampling ({manifest['sampling']}); "
                f"resume with the same settings or choose a new --out directory"
            )
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        manifest = {"target": ident, "sampling": cfg.sampling(), "config": asdict(cfg), "runs": [],
                    "wall_time_s": 0.0}
    manifest.update(provenance)
    # A run is recorded when it starts and after every batch, so a killed run stays in the record
    # (with what it wrote); a "running" entry found here is such a run.
    for run in manifest["runs"]:
        if run.get("status") == "running":
            run["status"] = "killed"
    manifest["runs"].append({"command": manifest.get("command"), "status": "running", "complete": False,
                             "written": 0, "generated_tokens": 0, "wall_s": 0.0})
    _write_json(path, manifest)
    return manifest


def _note_progress(out_dir: Path, manifest: dict, written: int, generated: int, wall_s: float) -> None:
    manifest["runs"][-1].update(written=written, generated_tokens=generated, wall_s=wall_s)
    _write_json(out_dir / "manifest.json", manifest)


def _close_manifest(out_dir: Path, manifest: dict, summary: RegenSummary, complete: bool, eos_ids: set[int]) -> None:
    manifest["runs"][-1].update(**asdict(summary), complete=complete, status="finished")
    manifest["wall_time_s"] = sum(r["wall_s"] for r in manifest["runs"])
    manifest["complete"] = complete
    manifest["totals"] = dataset_totals(out_dir, eos_ids)
    _write_json(out_dir / "manifest.json", manifest)
