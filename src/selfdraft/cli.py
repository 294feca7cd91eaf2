"""`selfdraft` command line. Each subcommand builds a config and calls one library function."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.config import EMBEDDED_TARGET, ConfigError, GenerationConfig, SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

TargetOpt = typer.Option(None, "--target", help=f"HF model dir or .gguf file (default: embedded {EMBEDDED_TARGET})")
DtypeOpt = typer.Option("bfloat16", "--dtype", help="bfloat16 (CPU default) or float32 (exactness)")


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(2)


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
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print exactly one JSON object"),
) -> None:
    """Generate an answer with speculative decoding (lossless: same output as the target alone)."""
    from selfdraft.decode import generate as run
    from selfdraft.drafters import load_drafter
    from selfdraft.target import Target, TargetError

    try:
        if (prompt is None) == (prompt_file is None):
            raise ConfigError("give exactly one of --prompt or --prompt-file")
        text = prompt if prompt is not None else prompt_file.read_text()
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
        tgt = Target.load(target, dtype=dtype)
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


@app.command()
def demo(
    target: Optional[str] = TargetOpt,
    drafter: str = typer.Option("ngram", "--drafter", "-d"),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens", "-n"),
    dtype: str = DtypeOpt,
) -> None:
    """Stream an answer with speculative decoding, then measure the speedup over plain decoding."""
    import torch

    from selfdraft.decode import generate as run
    from selfdraft.drafters import load_drafter
    from selfdraft.target import Target

    torch.manual_seed(0)
    tgt = Target.load(target, dtype=dtype)
    draft, plain = load_drafter(drafter, tgt), load_drafter("none", tgt)
    ids = tgt.encode_prompt(DEMO_PROMPT)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    print(f"prompt: {DEMO_PROMPT}\n\n--- answer ({drafter} drafting, greedy, {dtype}) ---")
    run(tgt, draft, ids[:16] or ids, config=GenerationConfig(max_new_tokens=4))  # warm-up
    spec = run(tgt, draft, ids, config=cfg, on_tokens=TextStream(tgt))
    print("\n--- same prompt, plain decoding (drafter none) for the speedup ---")
    base = run(tgt, plain, ids, config=cfg)
    same = "identical" if base.token_ids == spec.token_ids else "DIFFERENT (bf16 near-tie; use --dtype float32)"
    print(f"{drafter}: {spec.tokens_per_s:.1f} tok/s, τ={spec.tau:.2f} | none: {base.tokens_per_s:.1f} tok/s | "
          f"speedup {spec.tokens_per_s / base.tokens_per_s:.2f}x | outputs {same}")


if __name__ == "__main__":
    app()
