"""`selfdraft generate` and `selfdraft demo`: one request through the speculative decoding loop."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import (
    DrafterOpt,
    GammaOpt,
    SchedulerOpt,
    TargetOptions,
    check_gamma,
    command,
    default_of,
    note,
    resolve_drafter,
    with_suffix_options,
    with_target_options,
)
from selfdraft.config import ConfigError, GenerationConfig, SamplingParams


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
    command(app)(generate)
    command(app)(demo)


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


@with_target_options(compile=True)
@with_suffix_options
def generate(
    target_options: TargetOptions,
    suffix,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="prompt text"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="file holding the prompt"),
    drafter: str = DrafterOpt,
    chat: bool = typer.Option(True, "--chat/--no-chat", help="wrap the prompt in the chat template"),
    max_new_tokens: int = typer.Option(default_of(GenerationConfig, "max_new_tokens"), "--max-new-tokens", "-n"),
    gamma: int = GammaOpt,
    temperature: float = typer.Option(default_of(SamplingParams, "temperature"), "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(default_of(SamplingParams, "top_p"), "--top-p"),
    top_k: int = typer.Option(default_of(SamplingParams, "top_k"), "--top-k", help="0 = off"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    scheduler: str = SchedulerOpt,
    as_json: bool = typer.Option(False, "--json", help="print exactly one JSON object"),
) -> None:
    """Generate an answer with speculative decoding (lossless: same output as the target alone)."""
    from selfdraft.decode import generate as run
    from selfdraft.loader import load_drafter
    from selfdraft.profile import scheduler_for

    if (prompt is None) == (prompt_file is None):
        raise ConfigError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else read_prompt_file(prompt_file)
    if not text.strip():
        raise ConfigError(f"the prompt is empty ({'--prompt' if prompt is not None else prompt_file}): give the text to answer")
    check_gamma(gamma)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
    drafter = resolve_drafter(drafter, target_options)
    tgt = target_options.load(gamma)
    draft = load_drafter(drafter, tgt, suffix=suffix)
    sched = scheduler_for(scheduler, tgt, draft, gamma, log=note)
    ids = tgt.encode_prompt(text, chat=chat)
    stream = TextStream(tgt, enabled=not as_json)
    res = run(tgt, draft, ids, params, cfg, on_tokens=stream, scheduler=sched)
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


DEMO_PROMPT = (
    "Here is a Python function:\n\n```python\ndef moving_average(values, window):\n"
    "    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n"
    "    return result\n```\n\nRewrite it with type hints and a docstring, then explain how it works."
)


@with_target_options(compile=True)
def demo(
    target_options: TargetOptions,
    drafter: str = DrafterOpt,
    max_new_tokens: int = typer.Option(192, "--max-new-tokens", "-n"),
    scheduler: str = SchedulerOpt,
) -> None:
    """Measure the speedup of speculative over plain decoding on one prompt; lead with it, then show the answer."""
    import torch

    from selfdraft.decode import generate as run
    from selfdraft.loader import load_drafter
    from selfdraft.profile import scheduler_for

    torch.manual_seed(0)
    drafter = resolve_drafter(drafter, target_options)
    tgt = target_options.load()
    draft, plain = load_drafter(drafter, tgt), load_drafter("none", tgt)
    ids = tgt.encode_prompt(DEMO_PROMPT)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    sched = scheduler_for(scheduler, tgt, draft, cfg.gamma, log=note)
    print(f"measuring {max_new_tokens} greedy tokens ({tgt.format}, {str(tgt.model.dtype).removeprefix('torch.')}, "
          f"{target_options.threads} thread{'s' * (target_options.threads != 1)}): {draft.name} drafting, then plain decoding ...", file=sys.stderr, flush=True)
    run(tgt, draft, ids[:16] or ids, config=GenerationConfig(max_new_tokens=4), scheduler=sched)  # warm-up
    spec = run(tgt, draft, ids, config=cfg, scheduler=sched)
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
