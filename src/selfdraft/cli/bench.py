"""`selfdraft bench` (drafters vs plain decoding vs HF peers, interleaved) and `selfdraft profile`
(the SPS(B) cost table, and engine throughput per scheduler)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from selfdraft.cli.common import (
    SchedulerOpt,
    TargetOptions,
    ThresholdOpt,
    check_gamma,
    command,
    default_of,
    int_list,
    make_scheduler,
    with_suffix_options,
    with_target_options,
)
from selfdraft.config import DEFAULT_GAMMA, GenerationConfig, SamplingParams


def register(app: typer.Typer) -> None:
    command(app, "bench")(bench_cmd)
    command(app, "profile")(profile_cmd)


@with_target_options(compile=True)
@with_suffix_options
def bench_cmd(
    target_options: TargetOptions,
    suffix,
    out: Path = typer.Option(..., "--out", "-o", help="output dir: results.json, report.md, PNG plots"),
    drafters: str = typer.Option("none,ngram", "--drafters", help="comma list: NAME (none, ngram, suffix, suffix+tree, suffix+cold) | DIR (checkpoint) | hybrid[+RULE]:DIR | LABEL:any of these, each with an optional @SCHEDULER; llama.cpp:plain | llama.cpp:ngram | llama.cpp:DIR[@default|@rec|@P][+ngram] (llama.cpp's own decoding, docs/llamacpp.md)"),
    datasets: str = typer.Option("mt-bench,humaneval,gsm8k", "--datasets", help="comma list of bundled names or JSONL paths"),
    num_prompts: int = typer.Option(10, "--num-prompts", help="first N prompts of each dataset"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(default_of(SamplingParams, "temperature"), "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(default_of(SamplingParams, "top_p"), "--top-p"),
    gamma: int = typer.Option(DEFAULT_GAMMA, "--gamma", help="draft tokens per round (γ); also HF prompt_lookup_num_tokens"),
    repeats: int = typer.Option(1, "--repeats", help="passes over the prompts; tokens/s = median"),
    seed: int = typer.Option(0, "--seed"),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="also run HF generate(), HF prompt lookup and llama.cpp (plain, n-gram; when installed)"),
    scheduler: str = SchedulerOpt,
    as_json: bool = typer.Option(False, "--json", help="print results.json to stdout"),
) -> None:
    """Benchmark drafters on bundled prompt sets, interleaved in one run; writes a report with plots."""
    import shlex

    from selfdraft.bench import BenchConfig, load_prompt_set, markdown_table, parse_drafter_spec, run_bench, write_report

    check_gamma(gamma)
    cfg = BenchConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, gamma=gamma,
                      repeats=repeats, seed=seed, peers=peers, scheduler=scheduler,
                      command=shlex.join(["selfdraft", *sys.argv[1:]]), suffix=suffix)
    sets = [load_prompt_set(s.strip(), num_prompts) for s in datasets.split(",") if s.strip()]
    specs = [parse_drafter_spec(s) for s in drafters.split(",") if s.strip()]
    tgt = target_options.load(gamma)
    results = run_bench(tgt, specs, sets, cfg)
    paths = write_report(results, out)
    if as_json:
        print(paths["json"].read_text(), end="")
    else:
        print(markdown_table(results), end="")
        print(f"wall {results.wall_s:.0f}s -> {out}/ ({', '.join(p.name for p in paths.values())})", file=sys.stderr)


@with_target_options(compile=False)
def profile_cmd(
    target_options: TargetOptions,
    max_tokens: int = typer.Option(128, "--max-tokens", help="largest B measured (the engine sees up to R_max·(γ+1))"),
    kv_len: int = typer.Option(256, "--kv-len", help="cached tokens each measured forward attends to"),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1, help="timed rounds per B, the fastest kept (default: the quick profile's 10)"),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="--no-measure: reuse the stored profile"),
    engine: Optional[str] = typer.Option(None, "--engine", help="also measure engine throughput with this drafter (name or DIR)"),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="engine: comma list of concurrent requests"),
    schedulers: str = typer.Option("fixed,threshold,hardware", "--schedulers", help="engine: comma list"),
    threshold: Optional[float] = ThresholdOpt,
    prompts: str = typer.Option("mt-bench", "--prompts", help="engine: bundled prompt set name or JSONL path"),
    num_prompts: int = typer.Option(16, "--num-prompts", help="engine: requests per run"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="engine: tokens per request"),
    gamma: int = typer.Option(DEFAULT_GAMMA, "--gamma", help="engine: draft tokens per round (γ)"),
    temperature: float = typer.Option(default_of(SamplingParams, "temperature"), "--temperature", "-t", help="engine: 0 = greedy"),
) -> None:
    """Measure SPS(B) (target forwards/s with B tokens per forward), store it beside the target cache,
    print it and plot it; with --engine, also serve prompts at each concurrency with each scheduler."""
    from selfdraft.bench import load_prompt_set
    from selfdraft.engine import drafter_factory, engine_throughput
    from selfdraft.profile import (OTHER_WORK_LIMIT, QUICK_REPEATS, geometric_batch_tokens, load_profile, measure_sps, plot_profile,
                                   profile_path, save_profile)

    if engine is not None:
        check_gamma(gamma)
    tgt = target_options.load()
    path = profile_path(tgt, tgt.profile_key)
    if measure:
        prof = measure_sps(tgt, tgt.profile_key, geometric_batch_tokens(max_tokens), kv_len, repeats or QUICK_REPEATS)
        save_profile(prof, path)
        plot_profile(prof, path.with_suffix(".png"))
    else:
        prof = load_profile(tgt, tgt.profile_key)
    print(prof.table())
    print(f"-> {path} (+ .png)", file=sys.stderr)
    if (prof.other_cores or 0) > OTHER_WORK_LIMIT:
        print(f"warning: other processes kept {prof.other_cores:.1f} cores busy while this table was timed; the "
              "scheduler measures it again when the machine is quieter", file=sys.stderr)
    if engine is None:
        return
    ids = load_prompt_set(prompts, num_prompts).encode(tgt)
    make = drafter_factory(engine, tgt)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
    params = SamplingParams(temperature=temperature, seed=0 if temperature > 0 else None)
    print(f"\n{'scheduler':>10} {'R':>3} {'tok/s':>7} {'req tok/s':>9} {'tau':>5}")
    kinds = [k.strip() for k in schedulers.split(",") if k.strip()]
    for R in int_list(concurrency, "--concurrency"):  # schedulers interleaved: drift hits all alike
        for kind in kinds:
            sched = make_scheduler(kind, threshold, prof.cost_table())
            r = engine_throughput(tgt, make, ids, R, sched, params, cfg)
            print(f"{kind:>10} {R:>3} {r.tokens_per_s:>7.1f} {r.mean_request_tokens_per_s:>9.2f} {r.tau:>5.2f}", flush=True)
