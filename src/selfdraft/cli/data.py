"""`selfdraft data ...`: the training data pipeline (prompts, target-regenerated answers, original
answers, the feature cache, the draft vocabulary; docs/data.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import (ComputeDtypeOpt, DeviceOpt, DtypeOpt, TargetOpt, ThreadsOpt, command, default_of,
                                  note, set_threads, warn)
from selfdraft.training.synthesize.config import GateConfig, SynthConfig


def register(app: typer.Typer) -> None:
    """Add the `data` group to the root app."""
    data_app = typer.Typer(no_args_is_help=True, help="Training data: prompts, target-regenerated answers, features, draft vocab.")
    for name, fn in (("prompts", data_prompts), ("regenerate", data_regenerate), ("synthesize", data_synthesize),
                     ("overlap", data_overlap), ("original", data_original), ("features", data_features), ("vocab", data_vocab)):
        command(data_app, name)(fn)
    app.add_typer(data_app, name="data")


SourcesArg = typer.Argument(..., help="prompt sources: sharegpt | FILE.jsonl | FILE.json | hf:NAME[:SPLIT]")


def _select_prompts(tgt, sources, num_turns, val_fraction, max_prompt_tokens, limit):
    from selfdraft.training.sources import collect_prompts, select_prompts

    prompts, stats = collect_prompts(list(sources), num_turns=num_turns, val_fraction=val_fraction)
    chosen = select_prompts(prompts, lambda p: len(tgt.encode_prompt(p.turns[0])), max_prompt_tokens, limit, stats,
                            min_val=1 if val_fraction > 0 else 0)  # a small --limit still gets a val split
    return chosen, stats


def data_prompts(
    sources: list[str] = SourcesArg,
    target: Optional[str] = TargetOpt,
    num_turns: int = typer.Option(1, "--turns", help="user turns per conversation"),
    val_fraction: float = typer.Option(0.02, "--val-fraction"),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", help="filter longer templated prompts"),
    limit: Optional[int] = typer.Option(None, "--limit", help="keep the first N prompts (stable hash order)"),
) -> None:
    """Count the usable prompts of the sources (kept / malformed / empty / duplicate / too long)."""
    from selfdraft.target import Target

    tgt = Target.load(target)
    chosen, stats = _select_prompts(tgt, sources, num_turns, val_fraction, max_prompt_tokens, limit)
    val = sum(p.split == "val" for p in chosen)
    print(json.dumps({**stats.as_dict(), "train": len(chosen) - val, "val": val}))


def data_regenerate(
    sources: list[str] = SourcesArg,
    out: Path = typer.Option(..., "--out", "-o", help="dataset directory (rerun the same command to resume)"),
    target: Optional[str] = TargetOpt,
    limit: Optional[int] = typer.Option(None, "--limit", help="answer the first N prompts (stable hash order)"),
    num_turns: int = typer.Option(1, "--turns", help="answer up to N user turns with the target's own answers"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens"),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="default: target's, else 0.7"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="default: target's, else 0.9"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    batch_size: int = typer.Option(16, "--batch-size", "-b"),
    val_fraction: float = typer.Option(0.02, "--val-fraction"),
    seed: int = typer.Option(0, "--seed"),
    exclude: list[Path] = typer.Option([], "--exclude", help="a campaign ledger (ledger.json) or a dataset directory "
                                       "(repeatable): skip the prompts it holds, so every answer is fresh (--limit "
                                       "still counts them)"),
    part: Optional[str] = typer.Option(None, "--part", help="I/N: answer the prompts whose id is I modulo N, so N "
                                       "processes (each its own --out) share one selection"),
    threads: int = ThreadsOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
) -> None:
    """Have the target answer prompts through its chat template; write JSONL shards + manifest."""
    import shlex

    from selfdraft.target import Target
    from selfdraft.training.regenerate import RegenConfig, recommended_sampling, regenerate
    from selfdraft.training.sources import drop_trained, parse_part, read_ledger, take_part

    part = part or "0/1"
    parse_part(part)  # a bad --part or ledger fails before the target loads
    held = set().union(*(read_ledger(p) for p in exclude))
    set_threads(threads)
    tgt = Target.load(target, dtype=dtype, device=device)
    rec = {"temperature": 0.7, "top_p": 0.9, **recommended_sampling(tgt)}
    cfg = RegenConfig(
        temperature=rec["temperature"] if temperature is None else temperature,
        top_p=rec["top_p"] if top_p is None else top_p,
        top_k=top_k, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
        num_turns=num_turns, batch_size=batch_size, seed=seed,
    )
    chosen, stats = _select_prompts(tgt, sources, num_turns, val_fraction, max_prompt_tokens, limit)
    chosen, dropped = drop_trained(chosen, held)
    chosen = take_part(chosen, part)
    print(f"prompts: {json.dumps(stats.as_dict())}" + (f", {dropped} skipped (in {', '.join(map(str, exclude))})" if exclude else ""),
          file=sys.stderr)
    provenance = {"command": shlex.join(["selfdraft", *sys.argv[1:]]), "sources": list(sources),
                  "limit": limit, "exclude": [str(p) for p in exclude], "excluded": dropped, "part": part,
                  "val_fraction": val_fraction, "prompt_stats": stats.as_dict(),
                  "dtype": dtype, "threads": threads, "device": str(tgt.device)}
    summary = regenerate(tgt, chosen, out, cfg, provenance=provenance)
    print(f"wrote {summary.written} conversations ({summary.skipped_done} already done), "
          f"{summary.generated_tokens} tokens in {summary.wall_s:.0f}s = {summary.tokens_per_s:.1f} tok/s, "
          f"peak RSS {summary.peak_rss_mb:.0f} MB -> {out}", file=sys.stderr)
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    print(f"dataset: {totals['train']['records']} train + {totals['val']['records']} val conversations", file=sys.stderr)
    if totals["train"]["records"] + totals["val"]["records"] and not totals["val"]["records"]:
        warn(f"{out} has no validation conversations: `train` reports no val loss and `calibrate --split val` has "
              "nothing to read; regenerate into a new --out with a larger --limit or --val-fraction")


def data_synthesize(
    out: Path = typer.Option(..., "--out", "-o", help="dataset directory (rerun the same command to resume; a larger "
                             "--limit extends it)"),
    limit: int = typer.Option(..., "--limit", help="conversations to keep (prompts that pass every gate)"),
    domain: list[str] = typer.Option(["chat"], "--domain", help="chat (the template's user header alone) | code | "
                                     "math (steered by a system prompt and seed topics); repeatable: round robin"),
    topics: Optional[Path] = typer.Option(None, "--topics", help="your own seed topics, one a line (`#` comments): "
                                          "each prompt is steered towards one of them"),
    system: Optional[str] = typer.Option(None, "--system", help="your own steering system prompt ({topic} = the "
                                         "slot's topic); shown only while the target writes the prompt"),
    target: Optional[str] = TargetOpt,
    num_turns: int = typer.Option(1, "--turns", help="user turns per conversation: after each answer the target "
                                  "writes the next user turn too (only answers are trained, each once)"),
    extend: Optional[Path] = typer.Option(None, "--extend", help="a dataset directory: continue its conversations "
                                          "instead (in id order): the target writes --turns new user turns of each "
                                          "and answers them; the copied turns keep loss mask 0 (trained already)"),
    prompt_temperature: float = typer.Option(default_of(SynthConfig, "prompt_temperature"), "--prompt-temperature"),
    prompt_top_p: float = typer.Option(default_of(SynthConfig, "prompt_top_p"), "--prompt-top-p"),
    max_prompt_new_tokens: int = typer.Option(default_of(SynthConfig, "max_prompt_new_tokens"), "--max-prompt-new-tokens",
                                              help="a prompt still unfinished after N tokens is removed"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="answer tokens"),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", help="templated context before an answer"),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="answers; default: target's, else 0.7"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="answers; default: target's, else 0.9"),
    batch_size: int = typer.Option(16, "--batch-size", "-b", help="prompt slots sampled (and answered) together"),
    val_fraction: float = typer.Option(default_of(SynthConfig, "val_fraction"), "--val-fraction"),
    seed: int = typer.Option(0, "--seed"),
    min_prompt_tokens: int = typer.Option(default_of(GateConfig, "min_prompt_tokens"), "--min-prompt-tokens"),
    near_dup: float = typer.Option(default_of(GateConfig, "near_dup"), "--near-dup", help="word 3-gram Jaccard at or "
                                   "above which a prompt is a near-duplicate"),
    language: str = typer.Option(default_of(GateConfig, "language"), "--language", help="en | any (no language gate)"),
    exclude: list[str] = typer.Option([], "--exclude", help="a dataset directory, a campaign ledger (the sources its "
                                      "keys name) or a prompt source (sharegpt, FILE, hf:NAME), repeatable: prompts "
                                      "(near-)duplicating theirs are removed"),
    exclude_prompts: list[Path] = typer.Option([], "--exclude-prompts", help="an evaluation set (a prompt file or a "
                                               "directory of .jsonl/.json), repeatable: prompts matching it are "
                                               "removed, like the bundled benchmark prompts always are"),
    threads: int = ThreadsOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
) -> None:
    """The target writes user prompts from its chat template's user header, the gates remove bad,
    duplicate and evaluation prompts, the target answers: training data with no dataset at all."""
    import shlex
    import time

    from selfdraft.target import Target
    from selfdraft.training.records import DataError
    from selfdraft.training.regenerate import RegenConfig, recommended_sampling
    from selfdraft.training.synthesize.domains import resolve_domains
    from selfdraft.training.synthesize.gates import PromptGates
    from selfdraft.training.synthesize.loop import synthesize
    from selfdraft.training.synthesize.neardup import NearDupIndex
    from selfdraft.training.synthesize.references import eval_prompts, excluded_turns

    # 1. everything that can be wrong with the input, before the target loads
    domains = resolve_domains(domain, topics, system)
    gate_cfg = GateConfig(min_prompt_tokens=min_prompt_tokens, language=language, near_dup=near_dup)
    cfg = SynthConfig(domains=domains, prompt_temperature=prompt_temperature, prompt_top_p=prompt_top_p,
                      max_prompt_new_tokens=max_prompt_new_tokens, val_fraction=val_fraction, gates=gate_cfg,
                      extend=str(extend) if extend is not None else None)
    if extend is not None and not extend.is_dir():
        raise DataError(f"--extend {extend}: not a dataset directory")
    t0 = time.perf_counter()
    eval_texts, eval_labels = eval_prompts(exclude_prompts)
    eval_index = NearDupIndex(eval_texts, near_dup, gate_cfg.ngram, eval_labels)
    excluded = excluded_turns(list(exclude))
    dedup = NearDupIndex(excluded, near_dup, gate_cfg.ngram)
    note(f"gates: {len(eval_texts)} evaluation prompts, {len(excluded)} excluded prompts indexed in "
         f"{time.perf_counter() - t0:.0f}s")
    # 2. the target, and its answer sampling (as `data regenerate`)
    set_threads(threads)
    tgt = Target.load(target, dtype=dtype, device=device)
    rec = {"temperature": 0.7, "top_p": 0.9, **recommended_sampling(tgt)}
    regen = RegenConfig(temperature=rec["temperature"] if temperature is None else temperature,
                        top_p=rec["top_p"] if top_p is None else top_p, max_new_tokens=max_new_tokens,
                        max_prompt_tokens=max_prompt_tokens, num_turns=num_turns, batch_size=batch_size, seed=seed)
    sources = ["synth-extend"] if extend is not None else [f"synth-{d.name}" for d in domains]
    provenance = {"command": shlex.join(["selfdraft", *sys.argv[1:]]), "sources": sources,
                  "limit": limit, "exclude": list(exclude), "exclude_prompts": [str(p) for p in exclude_prompts],
                  "val_fraction": val_fraction, "dtype": dtype, "threads": threads, "device": str(tgt.device)}
    # 3. write, gate, answer
    s = synthesize(tgt, out, limit, cfg, regen, PromptGates(gate_cfg, eval_index, dedup), provenance=provenance)
    tables = ([] if extend is not None else [s.first.table("first turns")]) + \
        ([s.followup.table("follow-up turns")] if extend is not None or num_turns > 1 else [])
    note("\n".join(tables))
    note(f"wrote {s.written} conversations ({s.kept} in the dataset), {s.prompt_tokens} prompt + {s.answer_tokens} "
         f"answer tokens in {s.wall_s:.0f}s = {s.tokens_per_s:.1f} tok/s -> {out}")
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    note(f"dataset: {totals['train']['records']} train + {totals['val']['records']} val conversations")
    if s.kept < limit and extend is not None:
        warn(f"{extend} had {s.kept} conversations to continue that passed the gates, of the {limit} asked for")
    elif s.kept < limit:
        warn(f"the gates kept {s.kept} of the {limit} conversations asked for within {cfg.max_attempts} prompts per "
             f"conversation; see the counts above (--near-dup, --language, --max-prompt-new-tokens)")
    if totals["train"]["records"] + totals["val"]["records"] and not totals["val"]["records"]:
        warn(f"{out} has no validation conversations: synthesize into it with a larger --limit or a new --out with "
             f"a larger --val-fraction")


def data_overlap(
    data: Path = typer.Argument(..., help="a dataset directory (from `data synthesize` or `data regenerate`)"),
    against: list[str] = typer.Option(..., "--against", help="as `data synthesize --exclude`: a dataset directory, a "
                                      "campaign ledger or a prompt source (sharegpt, FILE, hf:NAME); repeatable"),
    near_dup: float = typer.Option(default_of(GateConfig, "near_dup"), "--near-dup"),
) -> None:
    """How many of a dataset's first prompts are exact or near-duplicates of another's (JSON). With a
    synthesis log, also over every sampled prompt that passed the quality gates, before deduplication."""
    from selfdraft.training.records import iter_records
    from selfdraft.training.synthesize.gates import near_duplicate_share
    from selfdraft.training.synthesize.loop import OVER_LIMIT, SynthesisLog
    from selfdraft.training.synthesize.neardup import NearDupIndex
    from selfdraft.training.synthesize.references import excluded_turns

    reference = NearDupIndex(excluded_turns(list(against)), near_dup)
    groups = {"records": [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in iter_records(data)
                          if any(m["role"] == "user" for m in r["messages"])]}
    log = SynthesisLog(data)
    if log.batches:
        groups["sampled_passing_quality_gates"] = [
            e["text"] for entries in log.batches.values() for e in entries
            if e["turn"] == 1 and e["gate"] in ("kept", "duplicate", "near_duplicate", OVER_LIMIT)]
    out = {"against": list(against), "reference_prompts": len(reference), "near_dup": near_dup}
    for name, texts in groups.items():
        near, exact = near_duplicate_share(texts, reference)
        out[name] = {"prompts": len(texts), "near_or_exact": near, "exact": exact,
                     "rate": round(near / len(texts), 4) if texts else 0.0}
    print(json.dumps(out))


def data_original(
    out: Path = typer.Option(..., "--out", "-o", help="dataset directory (records as from `data regenerate`)"),
    source: str = typer.Option("sharegpt", "--source", help="sharegpt (the bundled file) or a ShareGPT-style .json"),
    limit: int = typer.Option(5000, "--limit", help="conversations to import"),
    max_seq_len: int = typer.Option(512, "--max-seq-len", help="truncate each conversation to N tokens"),
    val_fraction: float = typer.Option(0.02, "--val-fraction"),
    target: Optional[str] = TargetOpt,
    device: str = DeviceOpt,
) -> None:
    """Original ShareGPT answers as contexts (no generation); `data features` then adds the target's labels."""
    from selfdraft.target import Target
    from selfdraft.training.original import import_original

    tgt = Target.load(target, device=device)
    s = import_original(tgt, out, limit, source, max_seq_len, val_fraction)
    print(f"{s.written} conversations written ({s.skipped_existing} already there, {s.too_long_prompt} prompts too long, "
          f"{s.duplicates} duplicates, {s.malformed} malformed) in {s.wall_s:.0f}s -> {out}\n"
          f"next: selfdraft data features {out} --out FEATS", file=sys.stderr)


def data_features(
    data: Path = typer.Argument(..., help="regenerated dataset directory"),
    out: Path = typer.Option(..., "--out", "-o", help="feature cache directory (rerun to resume)"),
    target: Optional[str] = TargetOpt,
    feature_layers: Optional[str] = typer.Option(None, "--feature-layers", help="e.g. 1,8,15,22,27 (default: target's 5)"),
    split: Optional[str] = typer.Option(None, "--split", help="train | val (default: both)"),
    max_seq_len: int = typer.Option(2048, "--max-seq-len", help="truncate longer conversations"),
    shard_tokens: int = typer.Option(65536, "--shard-tokens", help="tokens per safetensors shard"),
    batch_size: int = typer.Option(4, "--batch-size", "-b", help="sequences per target forward"),
    threads: int = ThreadsOpt,
    dtype: str = ComputeDtypeOpt,
    device: str = DeviceOpt,
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before writing"),
) -> None:
    """Cache the target's feature-layer and final hidden states per token (bf16 safetensors)."""
    from selfdraft.target import Target
    from selfdraft.training.features import FeatureSpec, estimate_bytes, write_feature_cache

    set_threads(threads)
    tgt = Target.load(target, dtype=dtype, device=device)
    layers = tuple(int(x) for x in feature_layers.split(",")) if feature_layers else tgt.default_feature_layers()
    spec = FeatureSpec(feature_layers=layers, max_seq_len=max_seq_len, shard_tokens=shard_tokens, batch_size=batch_size)
    size = estimate_bytes(data, tgt, spec, split)
    print(f"feature cache for layers {layers}: about {size / 1e9:.2f} GB in {out}", file=sys.stderr)
    if not yes and sys.stdin.isatty() and not typer.confirm("continue?", default=True):
        raise typer.Exit(1)
    index = write_feature_cache(tgt, data, out, spec, split)
    print(f"{index['records']} conversations, {index['tokens']} tokens, {len(index['shards'])} shards -> {out}",
          file=sys.stderr)


def data_vocab(
    data: Path = typer.Argument(..., help="regenerated dataset directory"),
    size: int = typer.Option(8192, "--size", help="draft vocabulary size"),
    target: Optional[str] = TargetOpt,
) -> None:
    """Build the draft vocabulary (most frequent assistant tokens) -> DIR/draft_vocab_SIZE.safetensors."""
    from selfdraft.target import Target
    from selfdraft.training.draft_vocab import build_draft_vocab

    manifest = data / "manifest.json"
    vocab_size = (json.loads(manifest.read_text())["target"]["vocab_size"] if manifest.exists() and target is None
                  else Target.load(target).vocab_size)
    vocab = build_draft_vocab(data, size, vocab_size)
    print(f"draft vocab {size}/{vocab_size} covers {vocab.coverage:.2%} of assistant tokens -> "
          f"{data / f'draft_vocab_{size}.safetensors'}", file=sys.stderr)
