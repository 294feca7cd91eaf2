"""The synthesis loop: the target writes user prompts, the gates filter them, the target answers.

Batch b holds the prompt slots b*B .. b*B + B - 1. Each slot's domain (round robin over the domains)
and topic (seeded) are fixed, and each batch's generator is seeded from the seed and b, so a batch
always samples the same prompts and answers. The records go to the dataset's JSONL shards (the
contract of training/records.py, the same as `data regenerate`), then one line per batch to
`synthesis.jsonl`: every prompt sampled, its gate verdict and its conversation id. A rerun replays
that log (gate counts, and the kept prompts into the dedup index, in order) and continues at the
first batch it lacks; records a killed batch already wrote are skipped by id, so nothing is lost
or duplicated.

With --extend the slots are the records of a dataset (in id order) instead of new prompts: the
target writes their next user turns and answers them, and the copied turns keep loss mask 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfdraft.config import ConfigError, SamplingParams
from selfdraft.training.records import DataError, ShardWriter, _cut_partial_line, iter_records, tokenize_conversation
from selfdraft.training.regenerate import (
    RegenConfig,
    RegenSummary,
    _close_manifest,
    _fits,
    _note_progress,
    _open_manifest,
    generate_answers,
    peak_rss_mb,
    sample_batch,
)
from selfdraft.training.sources import ledger_key, prompt_id, split_of
from selfdraft.training.synthesize.config import SynthConfig
from selfdraft.training.synthesize.domains import Domain
from selfdraft.training.synthesize.gates import GateCounts, PromptGates

LOG = "synthesis.jsonl"
SENTINEL = "SELFDRAFTUSERTURN"  # stands for the user turn's text while rendering the template around it
OVER_LIMIT = "over_limit"  # a prompt that passed the gates after --limit conversations were kept (not a gate)


class ChatTemplate:
    """The target's chat template, cut open at a user turn: the text before it (the user header, which
    the target continues to write a prompt) and the token that ends it (where the prompt stops)."""

    def __init__(self, tokenizer) -> None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataError("the target has no chat template: synthesis samples user prompts from the template's "
                            "user header; use an instruction-tuned target with a chat template")
        self.tokenizer = tokenizer
        text = self._render([{"role": "user", "content": SENTINEL}])
        tail = tokenizer(text[text.index(SENTINEL) + len(SENTINEL) :], add_special_tokens=False)["input_ids"]
        if not tail:
            raise DataError("the chat template closes a user turn with no token: cannot tell where a prompt ends")
        self.user_end = tail[0]  # e.g. <|im_end|>, <|eot_id|>

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as e:  # jinja raises its own errors, e.g. "System role not supported"
            raise DataError(f"the chat template cannot render this conversation: {e}") from e
        if messages and messages[-1]["content"] == SENTINEL and SENTINEL not in text:
            raise DataError("the chat template does not render the user's text verbatim; cannot write prompts with it")
        return text

    def header(self, messages: list[dict]) -> str:
        """The text of `messages` followed by the next user turn's header (up to where its text starts)."""
        text = self._render(messages + [{"role": "user", "content": SENTINEL}])
        return text[: text.index(SENTINEL)]

    def first_turn(self, system: str | None) -> list[int]:
        """A new conversation's user header, after the steering system prompt if any."""
        msgs = [{"role": "system", "content": system}] if system is not None else []
        return self.tokenizer(self.header(msgs), add_special_tokens=False)["input_ids"]

    def next_turn(self, messages: list[dict], answer_ids: dict[int, list[int]]) -> list[int]:
        """The conversation so far (the answers as the ids the target sampled), then the next user header."""
        ids = tokenize_conversation(self.tokenizer, messages, answer_ids).input_ids
        done, header = self._render(messages), self.header(messages)
        if not header.startswith(done):
            raise DataError("the chat template does not render conversations incrementally; cannot write follow-ups")
        return ids + self.tokenizer(header[len(done) :], add_special_tokens=False)["input_ids"]


@dataclass
class Conversation:
    """One synthesized conversation in the making."""

    slot: int
    domain: str
    topic: str | None
    messages: list[dict] = field(default_factory=list)
    answer_ids: dict[int, list[int]] = field(default_factory=dict)  # message index -> ids the target sampled
    open_last: bool = False  # the last answer was cut by max_new_tokens: the conversation ends there
    copied: list[int] = field(default_factory=list)  # --extend: the continued record's input_ids (trained already)
    copied_messages: int = 0  # --extend: its messages
    split: str | None = None  # --extend: the continued record's split (a val prompt stays val)
    origin: str | None = None  # --extend: the continued record's ledger key (source:id)

    @property
    def id(self) -> str:
        return prompt_id([m["content"] for m in self.messages if m["role"] == "user"])

    @property
    def user_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    @property
    def new_answers(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages[self.copied_messages :])


def continued(tokenizer, rec: dict, slot: int, eos_ids: set[int]) -> Conversation | None:
    """A record to continue (--extend), its answers as the ids it holds; None when it cannot be: its last
    answer was cut (no end of turn), or its messages through the template do not give its input_ids."""
    spans, cur = [], []
    for t, m in zip(rec["input_ids"], rec["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            spans, cur = spans + [cur], []
    spans += [cur] if cur else []
    answers = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
    if not answers or answers[-1] != len(rec["messages"]) - 1 or len(spans) != len(answers) or spans[-1][-1] not in eos_ids:
        return None
    answer_ids = {i: span[:-1] for i, span in zip(answers, spans)}
    try:
        again = tokenize_conversation(tokenizer, rec["messages"], answer_ids).input_ids
    except DataError:
        return None
    if again != rec["input_ids"]:
        return None
    return Conversation(slot, "extend", None, [dict(m) for m in rec["messages"]], answer_ids, copied=rec["input_ids"],
                        copied_messages=len(rec["messages"]), split=rec["split"], origin=ledger_key(rec["source"], rec["id"]))


@dataclass
class SynthSummary:
    written: int  # records written by this run
    kept: int  # conversations in the dataset
    batches: int  # batches run by this run
    prompt_tokens: int  # tokens of user turns sampled by this run (kept or not)
    answer_tokens: int  # tokens of answers sampled by this run
    wall_s: float
    tokens_per_s: float  # (prompt + answer tokens) / wall
    first: GateCounts  # first turns, over every run of the dataset
    followup: GateCounts  # target-written follow-up turns, over every run


def batch_seed(seed: int, batch: int) -> int:
    """A generator seed per (seed, batch) that no other pair shares (seed + batch would: (0, 1) = (1, 0))."""
    return int(hashlib.sha256(f"{seed}:{batch}".encode()).hexdigest()[:15], 16)


def slot_topic(domain: Domain, seed: int, slot: int) -> str | None:
    return random.Random(f"{seed}:{slot}").choice(domain.topics) if domain.topics else None


class SynthesisLog:
    """`synthesis.jsonl`: one line per finished batch, {"batch": b, "prompts": [{slot, domain, topic,
    turn, text, tokens, gate, id}, ...]}. A half-written last line (a kill) is skipped when reading,
    and cut off when opened to continue (`repair`: only the writer may, a reader could race it)."""

    def __init__(self, out_dir: Path, repair: bool = False) -> None:
        self.path = Path(out_dir) / LOG
        self.batches: dict[int, list[dict]] = {}
        if self.path.exists():
            if repair:
                _cut_partial_line(self.path)
            text = self.path.read_text(encoding="utf-8")
            for line in text[: text.rfind("\n") + 1].splitlines():
                entry = json.loads(line)
                self.batches[entry["batch"]] = entry["prompts"]

    def append(self, batch: int, prompts: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"batch": batch, "prompts": prompts}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.batches[batch] = prompts


def synthesize(
    target,
    out_dir: str | Path,
    limit: int,
    cfg: SynthConfig,
    regen: RegenConfig,
    gates: PromptGates,
    provenance: dict | None = None,
    progress: bool = True,
    stop_after_batches: int | None = None,
) -> SynthSummary:
    """Write `limit` synthesized conversations into out_dir (resumable: rerun the same call).

    gates holds the eval index and the dedup index (already loaded with the excluded datasets);
    the kept prompts of earlier runs are added to it from the log. stop_after_batches simulates a
    kill (tests) after that many batches.
    """
    from selfdraft.progress import progress_bar

    if limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    out_dir = Path(out_dir)
    template = ChatTemplate(target.tokenizer)
    stop_ids = {template.user_end} | set(target.eos_ids)
    prompt_params = SamplingParams(temperature=cfg.prompt_temperature, top_p=cfg.prompt_top_p)
    _check_same_synthesis(out_dir, cfg)
    manifest = _open_manifest(out_dir, target, regen, {**(provenance or {}), "synthesis": cfg.identity()})
    writer = ShardWriter(out_dir, regen.shard_size)
    log = SynthesisLog(out_dir, repair=True)

    # Replay the log: gate counts, and every kept first turn into the dedup index, in their order.
    first, followup, done = GateCounts(), GateCounts(), set()
    for b in sorted(log.batches):
        for e in log.batches[b]:
            if e["gate"] != OVER_LIMIT:
                (first if e["turn"] == 1 else followup).count(e["gate"])
            if e["turn"] == 1 and e["gate"] == "kept":
                gates.keep(e["text"], e["domain"])
            if e["id"] is not None:
                done.add(e["id"])
    kept = len(done)
    batch = max(log.batches, default=-1) + 1
    seeds = _seeds(target, cfg.extend) if cfg.extend else None
    max_batches = -(-(len(seeds) if seeds is not None else cfg.max_attempts * limit) // regen.batch_size)

    t0, written, ran, prompt_tokens, answer_tokens = time.perf_counter(), 0, 0, 0, 0
    bar = progress_bar(total=limit, initial=min(kept, limit), desc="synthesize", unit="conv", disable=not progress)
    while kept < limit and batch < max_batches:
        if stop_after_batches is not None and ran >= stop_after_batches:
            break
        generator = torch.Generator().manual_seed(batch_seed(regen.seed, batch))
        entries: list[dict] = []
        slots = range(batch * regen.batch_size, (batch + 1) * regen.batch_size)
        if seeds is not None:  # 1-3. --extend: the batch's records to continue
            convs = [c for c in seeds[slots.start : slots.stop] if c is not None]
        else:
            # 1. the batch's slots: domain by round robin, topic drawn per slot
            domains = [cfg.domains[s % len(cfg.domains)] for s in slots]
            topics = [slot_topic(d, regen.seed, s) for d, s in zip(domains, slots)]
            # 2. the target writes one user prompt per slot from the (steered) user header
            contexts = [template.first_turn(d.steering(t)) for d, t in zip(domains, topics)]
            rows = sample_batch(target, contexts, prompt_params, cfg.max_prompt_new_tokens, generator, stop_ids)
            prompt_tokens += sum(map(len, rows))
            # 3. the gates; a kept prompt joins the dedup index at once, so the rest of the batch is checked against it
            convs: list[Conversation] = []
            for s, d, t, row in zip(slots, domains, topics, rows):
                text, n, finished = _prompt_text(target.tokenizer, row, stop_ids)
                gate = gates.check(text, n, finished)
                if gate == "kept" and kept + len(convs) >= limit:
                    gate = OVER_LIMIT
                if gate == "kept":
                    gates.keep(text, d.name)
                    convs.append(Conversation(s, d.name, t, [{"role": "user", "content": text}]))
                entries.append({"slot": s, "domain": d.name, "topic": t, "turn": 1, "text": text, "tokens": n,
                                "gate": gate, "id": None})
                if gate != OVER_LIMIT:
                    first.count(gate)
        # 4. the target answers, turn by turn; after turn 1 (and at every turn of --extend) it first
        #    writes the follow-up user turn
        for turn in range(1, regen.num_turns + 1):
            if turn > 1 or seeds is not None:
                prompt_tokens += _write_followups(target, template, convs, cfg, regen, gates, prompt_params,
                                                  generator, stop_ids, entries, followup)
            pending = []  # (conversation, prompt ids ending in the assistant header)
            for c in convs:
                if c.messages[-1]["role"] != "user":
                    continue
                ids = tokenize_conversation(target.tokenizer, c.messages, c.answer_ids, generation_prompt=True).input_ids
                if c.user_turns > 1 and not _fits(target, ids, regen):  # the follow-up cannot be answered: end before it
                    c.messages.pop()
                    continue
                pending.append((c, ids))
            if not pending:
                break
            for (c, _), ans in zip(pending, generate_answers(target, [ids for _, ids in pending], regen, generator)):
                c.messages.append({"role": "assistant", "content": ans.text})
                c.answer_ids[len(c.messages) - 1] = ans.content_ids
                c.open_last = not ans.finished
                answer_tokens += ans.num_tokens
        # 5. the records (the regenerate contract), then the batch's log line: the log marks the batch done
        convs = [c for c in convs if c.new_answers][: limit - kept]
        records = [_record(target.tokenizer, c, cfg.val_fraction) for c in convs]
        ids = {c.slot: r["id"] for c, r in zip(convs, records)}
        for e in entries:
            e["id"] = ids.get(e["slot"]) if e["gate"] == "kept" else None
        writer.write([r for r in records if r["id"] not in writer.done])
        log.append(batch, entries)
        # 6. progress
        written, kept, batch, ran = written + len(records), kept + len(records), batch + 1, ran + 1
        _note_progress(out_dir, manifest, written, prompt_tokens + answer_tokens, time.perf_counter() - t0)
        bar.update(len(records))
        gated = followup if seeds is not None else first
        bar.set_postfix(kept=f"{gated.kept}/{gated.sampled}", tok_s=f"{(prompt_tokens + answer_tokens) / (time.perf_counter() - t0):.1f}")
    bar.close()
    wall = time.perf_counter() - t0
    tokens = prompt_tokens + answer_tokens
    manifest["gates"] = {"first_turn": first.as_dict(), "followup": followup.as_dict()}
    regen_summary = RegenSummary(written, 0, tokens, wall, tokens / wall if wall > 0 else 0.0, peak_rss_mb())
    _close_manifest(out_dir, manifest, regen_summary, complete=kept >= limit, eos_ids=target.eos_ids)
    return SynthSummary(written, kept, ran, prompt_tokens, answer_tokens, wall, regen_summary.tokens_per_s, first, followup)


def _write_followups(target, template, convs, cfg, regen, gates, params, generator, stop_ids, entries, counts) -> int:
    """The target writes the next user turn of every conversation whose last answer finished and whose
    context leaves room; kept ones are appended, the others end their conversation. Returns tokens sampled."""
    live = [c for c in convs if not c.open_last and c.messages[-1]["role"] == "assistant"]
    # the follow-up's context must fit the prompt budget; the answer's own fit is checked after it is written
    asks = [(c, template.next_turn(c.messages, c.answer_ids)) for c in live]
    asks = [(c, ids) for c, ids in asks if len(ids) <= regen.max_prompt_tokens]
    if not asks:
        return 0
    live = [c for c, _ in asks]
    rows = sample_batch(target, [ids for _, ids in asks], params, cfg.max_prompt_new_tokens, generator, stop_ids)
    for c, row in zip(live, rows):
        text, n, finished = _prompt_text(target.tokenizer, row, stop_ids)
        gate = gates.check(text, n, finished, first_turn=False)
        counts.count(gate)
        entries.append({"slot": c.slot, "domain": c.domain, "topic": c.topic, "turn": c.user_turns + 1, "text": text,
                        "tokens": n, "gate": gate, "id": None, **({"extends": c.origin} if c.origin else {})})
        if gate == "kept":
            c.messages.append({"role": "user", "content": text})
    return sum(map(len, rows))


def _prompt_text(tokenizer, row: list[int], stop_ids: set[int]) -> tuple[str, int, bool]:
    """A sampled user turn -> (text, content tokens, finished: it ended with an end-of-turn token)."""
    finished = bool(row) and row[-1] in stop_ids
    content = row[:-1] if finished else row
    return tokenizer.decode(content, skip_special_tokens=True).strip(), len(content), finished


def _record(tokenizer, c: Conversation, val_fraction: float) -> dict:
    """A conversation as a record: only the answers are supervised (loss_mask), never the prompts the
    target wrote (a drafter drafts answers), and each answer in one record only: a continued record's
    tokens were trained already, so its copy here keeps loss mask 0."""
    conv = tokenize_conversation(tokenizer, c.messages, c.answer_ids, open_last=c.open_last)
    mask = conv.loss_mask
    if c.copied:
        if conv.input_ids[: len(c.copied)] != c.copied:
            raise DataError("the chat template renders a continued conversation differently from its record")
        mask = [0] * len(c.copied) + mask[len(c.copied) :]
    split = c.split or split_of(c.id, val_fraction)
    return {"id": c.id, "split": split, "source": f"synth-{c.domain}", "messages": c.messages,
            "input_ids": conv.input_ids, "loss_mask": mask}


def _seeds(target, data_dir: str) -> list[Conversation | None]:
    """--extend: the records of data_dir in id order, each as a conversation to continue (None: it cannot be)."""
    recs = sorted(iter_records(data_dir), key=lambda r: (r["id"], r["source"]))
    return [continued(target.tokenizer, r, slot, target.eos_ids) for slot, r in enumerate(recs)]


def _check_same_synthesis(out_dir: Path, cfg: SynthConfig) -> None:
    path = out_dir / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text()).get("synthesis")
        if old != json.loads(json.dumps(cfg.identity())):
            raise DataError(f"{out_dir} was synthesized with other domains, topics or prompt settings ({old}); "
                            f"resume with the same settings or choose a new --out directory")
