"""Target engine benchmark: HF vs native backend x weight formats on one target, interleaved.

Prints, per variant: ms per decode-1 and verify-8 forward at each context, plain-decoding tokens/s
(selfdraft's loop with drafter none; HF generate() for the hf rows too), the bytes of weights a
forward streams, and the machine's floors: weight bytes / measured memory bandwidth and FLOPs /
measured fp32 matmul rate. Every variant is timed in the same round-robin, medians over repeats,
so a busy spell on a shared machine slows all of them alike.

    python scripts/bench_engine.py --threads 2 --repeats 5          # embedded target, CPU
    python scripts/bench_engine.py --device cuda --variants hf-bf16,native-bf16,native-int4
    # --compile, eager vs compiled: forwards, plain and DSpark decoding on a few prompts (outputs checked equal)
    python scripts/bench_engine.py --threads 1 --variants native-fp32,native-fp32-compiled --verify 2,4,8 \
        --drafter checkpoints/dspark --prompts 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from selfdraft.bench import load_prompt_set
from selfdraft.config import DEFAULT_GAMMA, GenerationConfig
from selfdraft.decode import generate
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.loader import load_drafter
from selfdraft.profile import scheduler_for
from selfdraft.target import Target

VARIANTS = ("hf-fp32", "hf-bf16", "native-fp32", "native-fp16", "native-bf16", "native-int8", "native-int4")  # + "-compiled" (native)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def memory_bandwidth(device: torch.device, mb: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write), the best of a few."""
    src = torch.empty(mb * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def matmul_rate(device: torch.device, dtype=torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in dtype, the best of a few."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def build(variant: str, models: dict, device: str, compile_tokens: int) -> Target:
    backend, weights, *compiled = variant.split("-")
    dtype = "bfloat16" if weights == "bf16" else "float32"
    if dtype not in models:
        models[dtype] = Target.load(dtype=dtype, device=device)  # the HF model, shared by the variants
    if backend == "hf":
        return models[dtype]
    return models[dtype].with_backend("native", weights, compile=compile_tokens if compiled else 0)


def filled_cache(target: Target, length: int):
    """A cache holding `length` positions of random keys/values: a forward's time does not depend
    on the cached values, and a real prefill of 1024 tokens per variant costs minutes on a loaded CPU."""
    cache = target.new_cache()
    cfg = target.model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = lambda: torch.randn(1, n_kv, length, d, dtype=target.model.dtype, device=target.device) * 0.1  # noqa: E731
    if target.native is not None:
        cache.reserve(1, length)
        for i in range(cfg.num_hidden_layers):
            cache.keys[i][:, :, :length], cache.values[i][:, :, :length] = kv(), kv()
        cache.lengths = [length]
    else:
        for i in range(cfg.num_hidden_layers):
            cache.update(kv(), kv(), i)
    return cache


def params_count(target: Target) -> int:
    """Parameters multiplied per token (decoder linears + LM head; the embedding is a lookup)."""
    return sum(p.numel() for n, p in target.model.named_parameters() if "embed_tokens" not in n) + (
        target.model.get_output_embeddings().weight.numel() if target.model.config.tie_word_embeddings else 0)


def weight_bytes(target: Target) -> int:
    if target.native is not None:
        return target.native.weight_bytes()
    return params_count(target) * target.model.dtype.itemsize


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--verify", default="8", help="comma list: tokens of the verify forwards")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="plain decoding: new tokens per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default=None, help="also decode speculatively with this drafter (scheduler auto)")
    ap.add_argument("--prompts", type=int, default=1, help="mt-bench prompts for the decoding rounds (1: a story prompt)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    contexts = [int(c) for c in args.contexts.split(",")]
    verify = [int(v) for v in args.verify.split(",")]
    forwards = [("decode-1", 1)] + [(f"verify-{v}", v) for v in verify]

    models: dict = {}
    targets = {}
    for v in variants:
        t0 = time.perf_counter()
        targets[v] = build(v, models, args.device, max(verify + [DEFAULT_GAMMA + 1]))
        print(f"built {v} in {time.perf_counter() - t0:.1f}s", flush=True)
    any_t = next(iter(targets.values()))
    g = torch.Generator().manual_seed(0)
    block = torch.randint(0, any_t.vocab_size, (1, max(verify)), generator=g)

    # forward times: every (variant, context) holds a cache of c positions; each timed forward is rolled back
    times: dict[tuple, list[float]] = {}
    caches = {(v, c): filled_cache(t, c) for v, t in targets.items() for c in contexts}
    for v, t in targets.items():  # warm-up: one verify forward each (first-call allocations, kernel selection)
        t.forward(block, caches[v, contexts[0]])
        t.rollback(caches[v, contexts[0]], contexts[0])
    for rep in range(1, args.repeats + 1):
        for c in contexts:
            for v, t in targets.items():
                for name, n in forwards:
                    ids = block[:, :n]
                    sync(device)
                    t0 = time.perf_counter()
                    t.forward(ids, caches[v, c])
                    sync(device)
                    if rep:
                        times.setdefault((v, c, name), []).append(time.perf_counter() - t0)
                    t.rollback(caches[v, c], c)
        print(f"forward round {rep}/{args.repeats} done", flush=True)
    del caches

    # plain (and speculative) decoding tokens/s, interleaved; HF generate() beside the hf rows
    if args.prompts > 1:
        prompts = [any_t.encode_prompt(x) for x in load_prompt_set("mt-bench", args.prompts).texts]
    else:
        prompts = [any_t.encode_prompt("Write a short story about a robot who learns to paint.")]
    cfg = GenerationConfig(max_new_tokens=args.tokens, stop_on_eos=False)
    tps: dict[str, list[float]] = {}
    drafters = {v: {"none": NoDrafter()} for v in targets}
    scheds = {v: {"none": None} for v in targets}
    if args.drafter:
        for v, t in targets.items():  # loaded as in the CLI, outside inference mode (drafters track weight versions)
            with torch.inference_mode(False):
                drafters[v]["spec"] = load_drafter(args.drafter, t)
            scheds[v]["spec"] = scheduler_for("auto", t, drafters[v]["spec"], cfg.gamma, log=print)
    outputs: dict[tuple, list[int]] = {}
    all_equal = True
    for rep in range(1, max(1, args.repeats // 2) + 1):  # the forward rounds above warmed every variant up
        for p, prompt in enumerate(prompts):
            for v, t in targets.items():
                for d, drafter in drafters[v].items():
                    res = generate(t, drafter, prompt, config=cfg, scheduler=scheds[v][d])
                    tps.setdefault(v if d == "none" else f"{v} {args.drafter}", []).append(len(res.token_ids) / res.elapsed_s)
                    if outputs.setdefault((p, d), res.token_ids) != res.token_ids:
                        all_equal = False
                        print(f"outputs differ: prompt {p}, {v}, {d}", flush=True)
                if t.backend == "hf":
                    sync(device)
                    t0 = time.perf_counter()
                    t.model.generate(torch.tensor([prompt], device=t.device), max_new_tokens=args.tokens,
                                     min_new_tokens=args.tokens, do_sample=False)
                    sync(device)
                    tps.setdefault(v + " generate()", []).append(args.tokens / (time.perf_counter() - t0))
        print(f"decoding round {rep} done", flush=True)

    bw = memory_bandwidth(device)
    rate = matmul_rate(device)
    n_params = params_count(any_t)
    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731  ms
    print(f"\nmachine: {os.cpu_count()} cpus, {args.threads} torch threads, device {device}, load average "
          f"{os.getloadavg()[0]:.1f}; memory bandwidth {bw / 1e9:.1f} GB/s (copy), fp32 matmul {rate / 1e9:.1f} GFLOP/s")
    head = " | ".join(f"{n} @{c} ms" for c in contexts for n, _ in forwards)
    print(f"\n| variant | weights MB | {head} | plain tok/s |")
    print("|---|---:|" + "---:|" * (len(forwards) * len(contexts)) + "---:|")
    rows = {}
    for v, t in targets.items():
        cells = [med(times[v, c, n]) for c in contexts for n, _ in forwards]
        rows[v] = {"weights_mb": weight_bytes(t) / 1e6, "ms": cells, "tokens_per_s": statistics.median(tps[v])}
        print(f"| {v} | {weight_bytes(t) / 1e6:.0f} | " + " | ".join(f"{x:.1f}" for x in cells)
              + f" | {statistics.median(tps[v]):.1f} |")
        if v + " generate()" in tps:
            print(f"| {v} HF generate() | | " + " | ".join("" for _ in cells) + f" | {statistics.median(tps[v + ' generate()']):.1f} |")
            rows[v + " generate()"] = {"tokens_per_s": statistics.median(tps[v + " generate()"])}
        if f"{v} {args.drafter}" in tps:
            print(f"| {v} {args.drafter} (scheduler auto) | | " + " | ".join("" for _ in cells)
                  + f" | {statistics.median(tps[f'{v} {args.drafter}']):.1f} |")
            rows[f"{v} {args.drafter}"] = {"tokens_per_s": statistics.median(tps[f"{v} {args.drafter}"])}
    print(f"\noutputs equal across variants: {all_equal}")
    print("\nfloors (per forward): weights / bandwidth, and 2 x params x tokens / fp32 matmul rate")
    for v, t in targets.items():
        print(f"  {v}: {weight_bytes(t) / bw * 1000:.1f} ms memory; "
              f"decode-1 {2 * n_params / rate * 1000:.1f} ms, verify-{max(verify)} {2 * n_params * max(verify) / rate * 1000:.1f} ms compute")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bandwidth": bw, "matmul_flops": rate, "params": n_params, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
