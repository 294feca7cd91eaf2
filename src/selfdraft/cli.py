"""`selfdraft` command line. Each subcommand builds a config and calls one library function."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.config import DEFAULT_THREADS, EMBEDDED_TARGET, ConfigError, GenerationConfig, SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

TargetOpt = typer.Option(None, "--target", help=f"HF model dir or .gguf file (default: embedded {EMBEDDED_TARGET})")
DtypeOpt = typer.Option("bfloat16", "--dtype", help="bfloat16 (CPU default) or float32 (exactness)")
ThreadsOpt = typer.Option(
    DEFAULT_THREADS, "--threads", help="torch CPU threads (1 is safe on a shared machine; an idle one may gain from its cores)")

# Commands that run the target (generate, demo, bench, profile, calibrate, serve): backend options
EngineDtypeOpt = typer.Option(None, "--dtype", help="bfloat16 | float32 (exactness); default: float32 on the native "
                              "backend on CPU (its fastest kernels), bfloat16 otherwise")
BackendOpt = typer.Option("auto", "--backend", help="auto (native for Llama/Mistral/Qwen2/Qwen3, else hf) | native | hf")
WeightsOpt = typer.Option("auto", "--weights", help="native weights: auto (the fastest measured on CPU; dense in --dtype "
                          "when --dtype is given, and on CUDA) | bf16 | fp32 | int8 (per row) | int4 (groups of 32; a "
                          "GGUF's Q4 blocks exactly)")
DeviceOpt = typer.Option("auto", "--device", help="auto (cuda if available) | cpu | cuda")


def _load_target(target, dtype, backend, weights, device):
    """Target.load with the backend options (--backend, --weights, --dtype, --device)."""
    from selfdraft.target import Target

    return Target.load(target, dtype=dtype, backend=backend, weights=weights, device=device)


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(2)


def _warn(msg: str) -> None:
    typer.secho(f"warning: {msg}", fg="yellow", err=True)


def _set_threads(threads: int) -> None:
    """Every command takes --threads with the same default (config.DEFAULT_THREADS); exit 2 below 1."""
    import torch

    if threads < 1:
        _fail(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def _check_gamma(gamma: int) -> None:
    """γ = 0 drafts nothing: plain decoding under another name. Say how to ask for that instead."""
    if gamma < 1:
        raise ConfigError(f"--gamma must be >= 1 (draft tokens per round), got {gamma}; for plain decoding use --drafter none")


class TextStream:
    """Prints decoded text as tokens are committed (re-decodes so multi-byte tokens render right)."""

    def __init__(self, target, enabled: bool = True) -> None:
        self.target, self.enabled, self.ids, self.shown = target, enabled, [], 0

    def __call__(self, new: list[int]) -> None:
        self.ids.extend(new)
        if not self.enabled:
            return
        text = self.target.decode(self.ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[self.shown :])
            sys.stdout.flush()
            self.shown = len(text)


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="prompt text"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="file holding the prompt"),
    target: Optional[str] = TargetOpt,
    drafter: str = typer.Option("ngram", "--drafter", "-d", help="registry name (none, ngram) or a checkpoint dir"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="wrap the prompt in the chat template"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    gamma: int = typer.Option(7, "--gamma", help="draft tokens per round (γ)"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    threads: int = ThreadsOpt,
    dtype: Optional[str] = EngineDtypeOpt,
    backend: str = BackendOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="print exactly one JSON object"),
) -> None:
    """Generate an answer with speculative decoding (lossless: same output as the target alone)."""
    from selfdraft.decode import generate as run
    from selfdraft.loader import load_drafter
    from selfdraft.target import TargetError

    _set_threads(threads)
    try:
        if (prompt is None) == (prompt_file is None):
            raise ConfigError("give exactly one of --prompt or --prompt-file")
        text = prompt if prompt is not None else read_prompt_file(prompt_file)
        if not text.strip():
            raise ConfigError(f"the prompt is empty ({'--prompt' if prompt is not None else prompt_file}): give the text to answer")
        _check_gamma(gamma)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
        tgt = _load_target(target, dtype, backend, weights, device)
        draft = load_drafter(drafter, tgt)
        ids = tgt.encode_prompt(text, chat=chat)
        stream = TextStream(tgt, enabled=not as_json)
        res = run(tgt, draft, ids, params, cfg, on_tokens=stream)
    except (ConfigError, TargetError, OSError) as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(result_json(tgt, res)))
    else:
        print(f"\n\n[{len(res.token_ids)} tokens, {res.elapsed_s:.2f}s, {res.tokens_per_s:.1f} tok/s, "
              f"τ={res.tau:.2f} over {len(res.rounds)} rounds, drafter={drafter}]", file=sys.stderr)


def read_prompt_file(path: Path) -> str:
    """A prompt file's text; a binary or non-UTF-8 file is a ConfigError naming it."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                          "save the prompt as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: holds NUL bytes, so it is a binary file, not a prompt")
    return text


def result_json(target, res) -> dict:
    return {
        "text": target.decode(res.token_ids),
        "token_ids": res.token_ids,
        "prompt_token_ids": res.prompt_token_ids,
        "finish_reason": res.finish_reason,
        "num_rounds": len(res.rounds),
        "accepted_lengths": res.accepted_lengths,
        "tau": res.tau,
        "elapsed_s": res.elapsed_s,
        "tokens_per_s": res.tokens_per_s,
        "draft_s": sum(r.draft_s for r in res.rounds),
        "verify_s": sum(r.verify_s for r in res.rounds),
    }


SHIPPED_DSPARK = Path(__file__).resolve().parents[2] / "checkpoints" / "dspark"  # repo checkout (editable install)
DEMO_PROMPT = (
    "Here is a Python function:\n\n```python\ndef moving_average(values, window):\n"
    "    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n"
    "    return result\n```\n\nRewrite it with type hints and a docstring, then explain how it works."
)


@app.command()
def demo(
    target: Optional[str] = TargetOpt,
    drafter: str = typer.Option(
        "auto", "--drafter", "-d", help=f"auto = the shipped DSpark drafter ({SHIPPED_DSPARK}) if present, else ngram"
    ),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens", "-n"),
    threads: int = ThreadsOpt,
    dtype: Optional[str] = EngineDtypeOpt,
    backend: str = BackendOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
) -> None:
    """Measure the speedup of speculative over plain decoding on one prompt; lead with it, then show the answer."""
    import torch

    from selfdraft.decode import generate as run
    from selfdraft.loader import load_drafter
    from selfdraft.target import TargetError

    _set_threads(threads)
    torch.manual_seed(0)
    if drafter == "auto":
        drafter = str(SHIPPED_DSPARK) if (target is None and SHIPPED_DSPARK.is_dir()) else "ngram"
    try:
        tgt = _load_target(target, dtype, backend, weights, device)
        draft, plain = load_drafter(drafter, tgt), load_drafter("none", tgt)
        ids = tgt.encode_prompt(DEMO_PROMPT)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    except (ConfigError, TargetError, OSError) as e:
        _fail(str(e))
    print(f"measuring {max_new_tokens} greedy tokens ({tgt.format}, {str(tgt.model.dtype).removeprefix('torch.')}, "
          f"{threads} thread{'s' * (threads != 1)}): {draft.name} drafting, then plain decoding ...", file=sys.stderr, flush=True)
    run(tgt, draft, ids[:16] or ids, config=GenerationConfig(max_new_tokens=4))  # warm-up
    spec = run(tgt, draft, ids, config=cfg)
    base = run(tgt, plain, ids, config=cfg)
    print(demo_headline(draft.name, spec, base, os.getloadavg()[0], os.cpu_count() or 1))
    print(f"\n--- prompt ---\n{DEMO_PROMPT}\n\n--- answer ({drafter} drafting) ---")
    print(tgt.decode(spec.token_ids))


def demo_headline(name: str, spec, base, load: float, cores: int) -> str:
    """What the demo user came for, first: the measured speedup, and plainly why when it is below 1."""
    ratio = spec.tokens_per_s / base.tokens_per_s
    agree = next((i for i, (a, b) in enumerate(zip(base.token_ids, spec.token_ids)) if a != b), len(base.token_ids))
    same = "identical outputs" if base.token_ids == spec.token_ids else (
        f"outputs equal for the first {agree} tokens, then a near-tie flipped (block verify vs 1-token "
        "decode numerics; --weights fp32 gives bit-identical output)")
    lines = [f"speedup {ratio:.2f}x: {name} {spec.tokens_per_s:.1f} tok/s (τ={spec.tau:.2f} tokens per target "
             f"forward) vs plain decoding {base.tokens_per_s:.1f} tok/s; {same}"]
    if ratio < 1:
        busy = load >= 0.75 * cores
        lines.append(
            f"speculative decoding was SLOWER than plain decoding in this run. The machine is "
            f"{'busy' if busy else 'not busy'}: load average {load:.1f} on {cores} cores. "
            + ("With other processes competing for the CPU, timings of one prompt are unreliable: "
               "rerun `selfdraft demo` on an idle machine." if busy else
               f"The drafter's cost outweighed the {spec.tau:.2f} tokens per forward here: try another "
               "--drafter or --threads.")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- data (training data pipeline)
data_app = typer.Typer(no_args_is_help=True, help="Training data: prompts, target-regenerated answers, features, draft vocab.")
app.add_typer(data_app, name="data")

SourcesArg = typer.Argument(..., help="prompt sources: sharegpt | FILE.jsonl | FILE.json | hf:NAME[:SPLIT]")


def _select_prompts(tgt, sources, num_turns, val_fraction, max_prompt_tokens, limit):
    from selfdraft.training.data import collect_prompts, select_prompts

    prompts, stats = collect_prompts(list(sources), num_turns=num_turns, val_fraction=val_fraction)
    chosen = select_prompts(prompts, lambda p: len(tgt.encode_prompt(p.turns[0])), max_prompt_tokens, limit, stats,
                            min_val=1 if val_fraction > 0 else 0)  # a small --limit still gets a val split
    return chosen, stats


@data_app.command("prompts")
def data_prompts(
    sources: list[str] = SourcesArg,
    target: Optional[str] = TargetOpt,
    num_turns: int = typer.Option(1, "--turns", help="user turns per conversation"),
    val_fraction: float = typer.Option(0.02, "--val-fraction"),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", help="filter longer templated prompts"),
    limit: Optional[int] = typer.Option(None, "--limit", help="keep the first N prompts (stable hash order)"),
) -> None:
    """Count the usable prompts of the sources (kept / malformed / empty / duplicate / too long)."""
    from selfdraft.target import Target, TargetError
    from selfdraft.training.data import DataError

    try:
        tgt = Target.load(target)
        chosen, stats = _select_prompts(tgt, sources, num_turns, val_fraction, max_prompt_tokens, limit)
    except (ConfigError, TargetError, DataError, OSError) as e:
        _fail(str(e))
    val = sum(p.split == "val" for p in chosen)
    print(json.dumps({**stats.as_dict(), "train": len(chosen) - val, "val": val}))


@data_app.command("regenerate")
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
    threads: int = ThreadsOpt,
    dtype: str = DtypeOpt,
) -> None:
    """Have the target answer prompts through its chat template; write JSONL shards + manifest."""
    import shlex

    from selfdraft.target import Target, TargetError
    from selfdraft.training.data import DataError, RegenConfig, recommended_sampling, regenerate

    _set_threads(threads)
    try:
        tgt = Target.load(target, dtype=dtype)
        rec = {"temperature": 0.7, "top_p": 0.9, **recommended_sampling(tgt)}
        cfg = RegenConfig(
            temperature=rec["temperature"] if temperature is None else temperature,
            top_p=rec["top_p"] if top_p is None else top_p,
            top_k=top_k, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
            num_turns=num_turns, batch_size=batch_size, seed=seed,
        )
        chosen, stats = _select_prompts(tgt, sources, num_turns, val_fraction, max_prompt_tokens, limit)
        print(f"prompts: {json.dumps(stats.as_dict())}", file=sys.stderr)
        provenance = {"command": shlex.join(["selfdraft", *sys.argv[1:]]), "sources": list(sources),
                      "limit": limit, "val_fraction": val_fraction, "prompt_stats": stats.as_dict(),
                      "dtype": dtype, "threads": threads}
        summary = regenerate(tgt, chosen, out, cfg, provenance=provenance)
    except (ConfigError, TargetError, DataError, OSError) as e:
        _fail(str(e))
    print(f"wrote {summary.written} conversations ({summary.skipped_done} already done), "
          f"{summary.generated_tokens} tokens in {summary.wall_s:.0f}s = {summary.tokens_per_s:.1f} tok/s, "
          f"peak RSS {summary.peak_rss_mb:.0f} MB -> {out}", file=sys.stderr)
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    print(f"dataset: {totals['train']['records']} train + {totals['val']['records']} val conversations", file=sys.stderr)
    if totals["train"]["records"] + totals["val"]["records"] and not totals["val"]["records"]:
        _warn(f"{out} has no validation conversations: `train` reports no val loss and `calibrate --split val` has "
              "nothing to read; regenerate into a new --out with a larger --limit or --val-fraction")


@data_app.command("original")
def data_original(
    out: Path = typer.Option(..., "--out", "-o", help="dataset directory (records as from `data regenerate`)"),
    source: str = typer.Option("sharegpt", "--source", help="sharegpt (the bundled file) or a ShareGPT-style .json"),
    limit: int = typer.Option(5000, "--limit", help="conversations to import"),
    max_seq_len: int = typer.Option(512, "--max-seq-len", help="truncate each conversation to N tokens"),
    val_fraction: float = typer.Option(0.02, "--val-fraction"),
    target: Optional[str] = TargetOpt,
) -> None:
    """Original ShareGPT answers as contexts (no generation); `data features` then adds the target's labels."""
    from selfdraft.target import Target, TargetError
    from selfdraft.training.data import DataError
    from selfdraft.training.original import import_original

    try:
        tgt = Target.load(target)
        s = import_original(tgt, out, limit, source, max_seq_len, val_fraction)
    except (ConfigError, TargetError, DataError, OSError) as e:
        _fail(str(e))
    print(f"{s.written} conversations written ({s.skipped_existing} already there, {s.too_long_prompt} prompts too long, "
          f"{s.duplicates} duplicates, {s.malformed} malformed) in {s.wall_s:.0f}s -> {out}\n"
          f"next: selfdraft data features {out} --out FEATS", file=sys.stderr)


@data_app.command("features")
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
    dtype: str = typer.Option("float32", "--dtype", help="target dtype while computing (float32 is faster on CPU)"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before writing"),
) -> None:
    """Cache the target's feature-layer and final hidden states per token (bf16 safetensors)."""
    from selfdraft.target import Target, TargetError
    from selfdraft.training.data import DataError
    from selfdraft.training.features import FeatureSpec, estimate_bytes, write_feature_cache

    _set_threads(threads)
    try:
        tgt = Target.load(target, dtype=dtype)
        layers = tuple(int(x) for x in feature_layers.split(",")) if feature_layers else tgt.default_feature_layers()
        spec = FeatureSpec(feature_layers=layers, max_seq_len=max_seq_len, shard_tokens=shard_tokens, batch_size=batch_size)
        size = estimate_bytes(data, tgt, spec, split)
        print(f"feature cache for layers {layers}: about {size / 1e9:.2f} GB in {out}", file=sys.stderr)
        if not yes and sys.stdin.isatty() and not typer.confirm("continue?", default=True):
            raise typer.Exit(1)
        index = write_feature_cache(tgt, data, out, spec, split)
    except (ConfigError, TargetError, DataError, OSError) as e:
        _fail(str(e))
    print(f"{index['records']} conversations, {index['tokens']} tokens, {len(index['shards'])} shards -> {out}",
          file=sys.stderr)


@data_app.command("vocab")
def data_vocab(
    data: Path = typer.Argument(..., help="regenerated dataset directory"),
    size: int = typer.Option(8192, "--size", help="draft vocabulary size"),
    target: Optional[str] = TargetOpt,
) -> None:
    """Build the draft vocabulary (most frequent assistant tokens) -> DIR/draft_vocab_SIZE.safetensors."""
    from selfdraft.target import Target, TargetError
    from selfdraft.training.data import DataError, build_draft_vocab

    try:
        manifest = data / "manifest.json"
        vocab_size = (json.loads(manifest.read_text())["target"]["vocab_size"] if manifest.exists() and target is None
                      else Target.load(target).vocab_size)
        vocab = build_draft_vocab(data, size, vocab_size)
    except (ConfigError, TargetError, DataError, OSError) as e:
        _fail(str(e))
    print(f"draft vocab {size}/{vocab_size} covers {vocab.coverage:.2%} of assistant tokens -> "
          f"{data / f'draft_vocab_{size}.safetensors'}", file=sys.stderr)

# ---------------------------------------------------------------- train (the generic training loop)
def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated integers, e.g. 1,8,14,20,27; got {text!r}") from None


def _config_arg(text: str | None) -> dict:
    """--config: a JSON file path, or the JSON object itself (`--config '{"drafter": {"qk_norm": true}}'`)."""
    if not text:
        return {}
    inline = text.lstrip().startswith("{")
    try:
        data = json.loads(text if inline else Path(text).read_text())
    except OSError as e:
        raise ConfigError(f"--config {text}: cannot read it ({e.strerror}); give a JSON file or an inline JSON object") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {'(inline)' if inline else text}: invalid JSON ({e})") from None
    if not isinstance(data, dict) or set(data) - {"drafter", "train"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--config: expected an object with keys 'drafter' and/or 'train', got {keys}")
    return data


def _train_configs(config: str | None, drafter_opts: dict, train_opts: dict):
    """--config {"drafter": {...}, "train": {...}} (a file or inline JSON) overlaid with the options actually given.

    Unknown keys raise (config.from_dict), in the file as on the command line.
    """
    from selfdraft.config import DrafterConfig, TrainConfig, from_dict

    file = _config_arg(config)
    given = lambda opts: {k: v for k, v in opts.items() if v is not None}  # noqa: E731
    dcfg = from_dict(DrafterConfig, {**file.get("drafter", {}), **given(drafter_opts)})
    tcfg = from_dict(TrainConfig, {**file.get("train", {}), **given(train_opts)})
    if not tcfg.data:
        raise ConfigError("no training data: pass --data DIR (from `selfdraft data regenerate`) or set train.data in --config")
    return dcfg, tcfg


@app.command("train")
def train_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="checkpoint directory (then: --drafter OUT)"),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="dflash | dspark | eagle3 | mtp (default: dspark)"),
    target: Optional[str] = TargetOpt,
    data: Optional[str] = typer.Option(None, "--data", help="regenerated dataset directory"),
    config: Optional[str] = typer.Option(
        None, "--config", help='JSON file or inline JSON {"drafter": {...}, "train": {...}}; options override it'
    ),
    gamma: Optional[int] = typer.Option(None, "--gamma", help="block size γ (draft tokens per round)"),
    layers: Optional[int] = typer.Option(None, "--layers", help="draft decoder layers"),
    feature_layers: Optional[str] = typer.Option(None, "--feature-layers", help="target layers, e.g. 1,8,14,20,27"),
    anchor_as_first: Optional[bool] = typer.Option(None, "--anchor-as-first/--anchor-plus-masks", help="DSpark / DFlash block layout"),
    markov_rank: Optional[int] = typer.Option(None, "--markov-rank", help="Markov head rank r (0 = off)"),
    markov_head: Optional[str] = typer.Option(None, "--markov-head", help="vanilla | gated | rnn"),
    confidence_head: Optional[bool] = typer.Option(None, "--confidence-head/--no-confidence-head"),
    w_ce: Optional[float] = typer.Option(None, "--w-ce", help="cross-entropy loss weight"),
    w_tv: Optional[float] = typer.Option(None, "--w-tv", help="total-variation loss weight"),
    w_conf: Optional[float] = typer.Option(None, "--w-conf", help="confidence (BCE) loss weight"),
    loss_decay: Optional[float] = typer.Option(None, "--loss-decay", help="position weight exp(-(k-1)/decay)"),
    anchors_per_seq: Optional[int] = typer.Option(None, "--anchors-per-seq"),
    init_from_target: Optional[bool] = typer.Option(None, "--init-from-target/--random-init", help="DFlash/DSpark: start from the target's last layers"),
    draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size", help="EAGLE-3 draft vocab (0 = full)"),
    mtp_modules: Optional[int] = typer.Option(None, "--mtp-modules", help="MTP: D stacked modules"),
    mtp_recursive: Optional[bool] = typer.Option(None, "--mtp-recursive/--mtp-stacked", help="MTP: reuse the last module up to γ"),
    lr: Optional[float] = typer.Option(None, "--lr"),
    steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps (the schedule's length)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="sequences per micro-batch, all ranks together (torchrun splits it)"),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum"),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len"),
    token_budget: Optional[int] = typer.Option(None, "--token-budget", help="stop after N sequence tokens (0 = off)"),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps"),
    min_lr_ratio: Optional[float] = typer.Option(None, "--min-lr-ratio"),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay"),
    grad_clip: Optional[float] = typer.Option(None, "--grad-clip", help="0 = off"),
    val_every: Optional[int] = typer.Option(None, "--val-every", help="0 = only at the end"),
    val_batches: Optional[int] = typer.Option(None, "--val-batches"),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="0 = only at the end"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default off: fp32 is faster on CPUs without bf16 units)"),
    features: Optional[str] = typer.Option(None, "--features", help="online (target runs during training)"),
    fsdp: Optional[bool] = typer.Option(None, "--fsdp/--ddp", help="under torchrun: shard the drafter (FSDP) or replicate it (DDP, default)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="continue the run saved in --out"),
    final_only: bool = typer.Option(
        False, "--final-only", help="when the run finishes, delete trainer_state.pt (optimizer state, 2x the weights): "
        "keeps only the drafter; the run can no longer be resumed or extended"),
    threads: int = ThreadsOpt,
    dtype: str = typer.Option("float32", "--dtype", help="target dtype: float32 (CPU default: faster here) or bfloat16"),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="DFlash/DSpark: mask slots use this target embedding row (-1 = learned)"),
    loss_vocab_size: Optional[int] = typer.Option(None, "--loss-vocab-size", help="DFlash/DSpark: train and draft over the N most frequent answer tokens (0 = all)"),
    qk_norm: Optional[bool] = typer.Option(None, "--qk-norm/--no-qk-norm", help="per-head q/k RMSNorm (the layout vLLM builds)"),
) -> None:
    """Train a self-drafter on the target's own answers; the checkpoint loads with `--drafter OUT`."""
    from selfdraft.target import Target, TargetError
    from selfdraft.training.data import DataError, iter_records
    from selfdraft.training.trainer import STATE_FILE, strategy_for
    from selfdraft.training.trainer import train as run_training

    _set_threads(threads)
    try:
        layer_ids = _int_list(feature_layers, "--feature-layers") if feature_layers else None
        dcfg, tcfg = _train_configs(
            config,
            dict(method=method, gamma=gamma, num_layers=layers, feature_layers=layer_ids, anchor_as_first=anchor_as_first,
                 markov_rank=markov_rank, markov_head=markov_head, confidence_head=confidence_head, w_ce=w_ce,
                 w_tv=w_tv, w_conf=w_conf, loss_decay=loss_decay, anchors_per_seq=anchors_per_seq, init_from_target=init_from_target,
                 draft_vocab_size=draft_vocab_size, mtp_modules=mtp_modules, mtp_recursive=mtp_recursive,
                 mask_token_id=mask_token_id, loss_vocab_size=loss_vocab_size, qk_norm=qk_norm),
            dict(data=data, features=features, steps=steps, token_budget=token_budget, batch_size=batch_size,
                 grad_accum=grad_accum, max_seq_len=max_seq_len, lr=lr, warmup_steps=warmup_steps,
                 min_lr_ratio=min_lr_ratio, weight_decay=weight_decay, grad_clip=grad_clip, bf16=bf16,
                 val_every=val_every, val_batches=val_batches, save_every=save_every, seed=seed, fsdp=fsdp),
        )  # fmt: skip
        strategy_for(dcfg.method)  # fail on an unknown method before loading the target
        rank0 = os.environ.get("RANK", "0") == "0"
        if rank0 and not any(True for _ in iter_records(tcfg.data, "val")):
            _warn(f"{tcfg.data} has no validation conversations (split val): training runs without a val loss; "
                  "regenerate with a larger --limit or --val-fraction to have one")
        tgt = Target.load(target, dtype=dtype)
        res = run_training(tgt, dcfg, tcfg, out, resume=resume)
    except (ConfigError, TargetError, DataError, OSError, json.JSONDecodeError) as e:
        _fail(str(e))
    if not rank0:
        return  # torchrun: rank 0 reports (train() returns once every rank is done and the checkpoint written)
    state = res.out_dir / STATE_FILE
    if final_only and state.exists():
        state.unlink()
    val = f", val loss {res.final_val.loss:.4f}" if res.final_val else ""
    print(f"{dcfg.method}: {res.steps} steps, {res.tokens} tokens (stopped by {res.stopped_by}){val}, "
          f"{res.elapsed_s:.0f}s -> {res.out_dir} ({checkpoint_sizes(res.out_dir)})\n"
          f"use it: selfdraft generate --drafter {res.out_dir} -p '...'", file=sys.stderr)


def checkpoint_sizes(out: Path) -> str:
    """'model.safetensors 46.1 MB, trainer_state.pt 92.3 MB (resume only; --final-only drops it)'."""
    from selfdraft.checkpoint import WEIGHTS_FILE
    from selfdraft.training.trainer import STATE_FILE

    parts = [f"{WEIGHTS_FILE} {(out / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB"]
    if (out / STATE_FILE).exists():
        parts.append(f"{STATE_FILE} {(out / STATE_FILE).stat().st_size / 1e6:.1f} MB (resume only; --final-only drops it)")
    return ", ".join(parts)


# ---------------------------------------------------------------- bench (drafters vs plain decoding vs HF peers)
@app.command("bench")
def bench_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="output dir: results.json, report.md, PNG plots"),
    target: Optional[str] = TargetOpt,
    drafters: str = typer.Option("none,ngram", "--drafters", help="comma list: NAME | LABEL:DIR | DIR (checkpoint)"),
    datasets: str = typer.Option("mt-bench,humaneval,gsm8k", "--datasets", help="comma list of bundled names or JSONL paths"),
    num_prompts: int = typer.Option(10, "--num-prompts", help="first N prompts of each dataset"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    gamma: int = typer.Option(7, "--gamma", help="draft tokens per round (γ); also HF prompt_lookup_num_tokens"),
    repeats: int = typer.Option(1, "--repeats", help="passes over the prompts; tokens/s = median"),
    seed: int = typer.Option(0, "--seed"),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="also run HF generate() and HF prompt lookup"),
    threads: int = ThreadsOpt,
    dtype: Optional[str] = EngineDtypeOpt,
    backend: str = BackendOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="print results.json to stdout"),
) -> None:
    """Benchmark drafters on bundled prompt sets, interleaved in one run; writes a report with plots."""
    import shlex

    from selfdraft.bench import BenchConfig, load_prompt_set, markdown_table, parse_drafter_spec, run_bench, write_report
    from selfdraft.target import TargetError

    _set_threads(threads)
    try:
        _check_gamma(gamma)
        cfg = BenchConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, gamma=gamma,
                          repeats=repeats, seed=seed, peers=peers,
                          command=shlex.join(["selfdraft", *sys.argv[1:]]))
        sets = [load_prompt_set(s.strip(), num_prompts) for s in datasets.split(",") if s.strip()]
        specs = [parse_drafter_spec(s) for s in drafters.split(",") if s.strip()]
        tgt = _load_target(target, dtype, backend, weights, device)
        results = run_bench(tgt, specs, sets, cfg)
        paths = write_report(results, out)
    except (ConfigError, TargetError, OSError) as e:
        _fail(str(e))
    if as_json:
        print(paths["json"].read_text(), end="")
    else:
        print(markdown_table(results), end="")
        print(f"wall {results.wall_s:.0f}s -> {out}/ ({', '.join(p.name for p in paths.values())})", file=sys.stderr)


# ---------------------------------------------------------------- profile (SPS(B) cost table) and engine throughput
@app.command("profile")
def profile_cmd(
    target: Optional[str] = TargetOpt,
    dtype: Optional[str] = EngineDtypeOpt,
    backend: str = BackendOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", help="largest B measured (the engine sees up to R_max·(γ+1))"),
    kv_len: int = typer.Option(256, "--kv-len", help="cached tokens each measured forward attends to"),
    repeats: int = typer.Option(5, "--repeats", help="timed forwards per B (the fastest is kept)"),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="--no-measure: reuse the stored profile"),
    threads: int = ThreadsOpt,
    engine: Optional[str] = typer.Option(None, "--engine", help="also measure engine throughput with this drafter (name or DIR)"),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="engine: comma list of concurrent requests"),
    schedulers: str = typer.Option("fixed,threshold,hardware", "--schedulers", help="engine: comma list"),
    threshold: float = typer.Option(0.5, "--threshold", help="engine: a_j threshold of the threshold scheduler"),
    prompts: str = typer.Option("mt-bench", "--prompts", help="engine: bundled prompt set name or JSONL path"),
    num_prompts: int = typer.Option(16, "--num-prompts", help="engine: requests per run"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="engine: tokens per request"),
    gamma: int = typer.Option(7, "--gamma", help="engine: draft tokens per round (γ)"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="engine: 0 = greedy"),
) -> None:
    """Measure SPS(B) (target forwards/s with B tokens per forward), store it beside the target cache,
    print it and plot it; with --engine, also serve prompts at each concurrency with each scheduler."""
    from selfdraft.bench import load_prompt_set
    from selfdraft.engine import drafter_factory, engine_throughput
    from selfdraft.profile import geometric_batch_tokens, load_profile, measure_sps, plot_profile, profile_path, save_profile
    from selfdraft.scheduler import Scheduler
    from selfdraft.target import TargetError

    _set_threads(threads)
    try:
        if engine is not None:
            _check_gamma(gamma)
        tgt = _load_target(target, dtype, backend, weights, device)
        path = profile_path(tgt, tgt.profile_key)
        if measure:
            prof = measure_sps(tgt, tgt.profile_key, geometric_batch_tokens(max_tokens), kv_len, repeats)
            save_profile(prof, path)
            plot_profile(prof, path.with_suffix(".png"))
        else:
            prof = load_profile(tgt, tgt.profile_key)
        print(prof.table())
        print(f"-> {path} (+ .png)", file=sys.stderr)
        if engine is None:
            return
        ids = load_prompt_set(prompts, num_prompts).encode(tgt)
        make = drafter_factory(engine, tgt)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
        params = SamplingParams(temperature=temperature, seed=0 if temperature > 0 else None)
        print(f"\n{'scheduler':>10} {'R':>3} {'tok/s':>7} {'req tok/s':>9} {'tau':>5}")
        kinds = [k.strip() for k in schedulers.split(",") if k.strip()]
        for R in _int_list(concurrency, "--concurrency"):  # schedulers interleaved: drift hits all alike
            for kind in kinds:
                sched = Scheduler(kind, threshold=threshold, cost=prof.cost_table())
                r = engine_throughput(tgt, make, ids, R, sched, params, cfg)
                print(f"{kind:>10} {R:>3} {r.tokens_per_s:>7.1f} {r.mean_request_tokens_per_s:>9.2f} {r.tau:>5.2f}", flush=True)
    except (ConfigError, TargetError, OSError) as e:
        _fail(str(e))


# ---------------------------------------------------------------- calibrate (Sequential Temperature Scaling)
@app.command("calibrate")
def calibrate_cmd(
    drafter: Path = typer.Option(..., "--drafter", "-d", help="DSpark checkpoint dir (updated in place, atomically)"),
    target: Optional[str] = TargetOpt,
    data: Optional[Path] = typer.Option(None, "--data", help="regenerated dataset dir: prompts of its --split"),
    split: str = typer.Option("val", "--split", help="dataset split used with --data"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="or: a JSONL of {\"turns\": [...]} lines"),
    num_prompts: int = typer.Option(64, "--num-prompts", help="first N prompts"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="tokens decoded per prompt"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy acceptance; > 0 = chain rule"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    seed: int = typer.Option(0, "--seed"),
    threads: int = ThreadsOpt,
    dtype: Optional[str] = EngineDtypeOpt,
    backend: str = BackendOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
) -> None:
    """Fit T_k (Sequential Temperature Scaling) on held-out rounds; store them in the checkpoint with
    calibration.json and a reliability diagram per position (ECE and ROC-AUC before/after)."""
    from selfdraft.bench import load_prompt_set
    from selfdraft.target import TargetError
    from selfdraft.training.calibrate import calibrate_checkpoint
    from selfdraft.training.data import DataError, iter_records

    _set_threads(threads)
    try:
        if (data is None) == (prompts is None):
            raise ConfigError("give exactly one of --data DIR (held-out split) or --prompts FILE.jsonl")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        tgt = _load_target(target, dtype, backend, weights, device)
        if data is not None:
            recs = (r for r in iter_records(data, split) if 1 in r["loss_mask"])
            ids = [r["input_ids"][: r["loss_mask"].index(1)] for r, _ in zip(recs, range(num_prompts))]
            if not ids:
                raise ConfigError(f"{data} has no {split!r} conversations to calibrate on (the {split} split is empty): "
                                  f"regenerate with a larger --limit or --val-fraction, or pass --split train")
        else:
            ids = load_prompt_set(prompts, num_prompts).encode(tgt)
        reports = calibrate_checkpoint(drafter, tgt, ids, params, max_new_tokens, seed)
    except (ConfigError, TargetError, DataError, OSError) as e:
        _fail(str(e))
    print(f"{'k':>2} {'T_k':>6} {'rounds':>6} {'reached':>7} {'accept':>6} {'ECE before':>10} {'ECE after':>9} "
          f"{'AUC before':>10} {'AUC after':>9}")
    for r in reports:
        print(f"{r.k:>2} {r.temperature:>6.3f} {r.rounds_reached:>6} {r.reached:>7.3f} {r.acceptance:>6.3f} "
              f"{r.ece_before:>10.4f} {r.ece_after:>9.4f} {r.auc_before:>10.4f} {r.auc_after:>9.4f}"
              + (f"  {r.note}" if r.note else ""))
    unfit = [r.k for r in reports if r.note]
    if unfit:
        _warn(f"{len(unfit)} of {len(reports)} positions ({', '.join(map(str, unfit))}) had too few rounds or one class "
              f"to fit T_k or score the AUC (nan): calibrate on more prompts (--num-prompts; {len(ids)} used) "
              f"or longer answers (--max-new-tokens)")
    print(f"-> {drafter}/calibration.json, {drafter}/calibration/reliability_k*.png", file=sys.stderr)


# ---------------------------------------------------------------- export (speculators format, for vLLM)
@app.command("export")
def export_cmd(
    src: Path = typer.Argument(..., help="selfdraft drafter checkpoint directory (from `selfdraft train`)"),
    out: Path = typer.Argument(..., help="output directory (written atomically)"),
    fmt: str = typer.Option("speculators", "--format", help="speculators (what vLLM's speculative decoding loads)"),
    target: Optional[str] = TargetOpt,
    verifier: Optional[str] = typer.Option(
        None, "--verifier", help="the verifier as you will serve it: hub id or local model dir (default: the target's hub id)"
    ),
    dtype: str = DtypeOpt,
) -> None:
    """Export a trained drafter as a speculators checkpoint (config.json + model.safetensors) for vLLM."""
    from selfdraft.export import export_speculators
    from selfdraft.target import Target, TargetError

    try:
        if fmt != "speculators":
            raise ConfigError(f"--format {fmt!r}: the only export format is 'speculators'")
        tgt = Target.load(target, dtype=dtype)
        rep = export_speculators(src, out, tgt, verifier=verifier)
    except (ConfigError, TargetError, OSError) as e:
        _fail(str(e))
    files = ", ".join(f"{name} ({size / 1e6:.1f} MB)" for name, size in rep.files.items())
    print(f"-> {rep.path}: {files}\nserve it: vllm serve {rep.verifier} --speculative-config "
          f"'{{\"model\": \"{rep.path}\", \"method\": \"{rep.method}\", "
          f"\"num_speculative_tokens\": {rep.speculative_tokens}}}'\nor here: selfdraft generate --drafter {rep.path} -p '...'",
          file=sys.stderr)  # fmt: skip


# ---------------------------------------------------------------- serve (OpenAI-compatible HTTP server)
@app.command("serve")
def serve_cmd(
    target: Optional[str] = TargetOpt,
    drafter: str = typer.Option("ngram", "--drafter", "-d", help="registry name (none, ngram) or a checkpoint dir"),
    scheduler: str = typer.Option("fixed", "--scheduler", help="fixed | threshold | hardware (needs `selfdraft profile`)"),
    threshold: float = typer.Option(0.5, "--threshold", help="a_j threshold of the threshold scheduler"),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (loopback by default)"),
    port: int = typer.Option(8000, "--port"),
    max_concurrency: int = typer.Option(16, "--max-concurrency", help="requests in flight (running + queued); more get 429"),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="requests decoded together (default: --max-concurrency)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SELFDRAFT_API_KEY", help="require 'Authorization: Bearer KEY'"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the `model` clients send (default: the target's name)"),
    gamma: int = typer.Option(7, "--gamma", help="draft tokens per round (γ)"),
    shutdown_grace: float = typer.Option(10.0, "--shutdown-grace", help="seconds in-flight requests get to finish on SIGINT/SIGTERM"),
    max_body_size: int = typer.Option(1 << 20, "--max-body-size", help="largest request body in bytes (larger: 413)"),
    threads: int = ThreadsOpt,
    dtype: Optional[str] = EngineDtypeOpt,
    backend: str = BackendOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, streaming) on the batched speculative engine."""
    from selfdraft.engine import drafter_factory
    from selfdraft.profile import load_cost_table
    from selfdraft.scheduler import Scheduler
    from selfdraft.serve import EngineLoop, ServerMetrics, create_app, run_server
    from selfdraft.target import TargetError

    _set_threads(threads)
    try:
        if max_concurrency < 1 or (max_batch is not None and max_batch < 1) or max_body_size < 1:
            raise ConfigError("--max-concurrency, --max-batch and --max-body-size must be >= 1")
        _check_gamma(gamma)
        tgt = _load_target(target, dtype, backend, weights, device)
        sched = Scheduler(scheduler, threshold=threshold,
                          cost=load_cost_table(tgt, tgt.profile_key) if scheduler == "hardware" else None)
        make = drafter_factory(drafter, tgt)
        name = model_name or Path(tgt.name).name
        runner = EngineLoop(tgt, make, make().name, sched, max_batch or max_concurrency, max_concurrency,
                            ServerMetrics(gamma))
    except (ConfigError, TargetError, OSError) as e:
        _fail(str(e))
    print(f"serving {name!r} with drafter {runner.drafter_name} ({drafter}), scheduler {scheduler}, on "
          f"http://{host}:{port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr)
    run_server(create_app(runner, name, api_key, gamma=gamma, shutdown_grace_s=shutdown_grace,
                          max_body_bytes=max_body_size), host, port, shutdown_grace, log_level)


if __name__ == "__main__":
    app()
