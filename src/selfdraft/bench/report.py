"""Benchmark outputs: results.json, report.md (comparison table) and PNG plots.

The plots mirror how the papers present drafters: τ per dataset with the physical ceiling γ + 1
(a chain of γ drafts cannot commit more than γ + 1 tokens per round), position-wise conditional
acceptance curves (DSpark paper, Figure 2: where in the block a drafter loses the chain), and
speedups measured in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path

from selfdraft.bench.harness import BASELINE, HF_GENERATE, BenchResults

RESULTS_JSON, REPORT_MD = "results.json", "report.md"
TAU_PNG, ACCEPTANCE_PNG, SPEEDUP_PNG = "tau.png", "acceptance.png", "speedup.png"


def write_report(results: BenchResults, out_dir: str | Path) -> dict[str, Path]:
    """Write every output into out_dir (created if needed); returns {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / RESULTS_JSON, "markdown": out / REPORT_MD, "tau": out / TAU_PNG,
             "acceptance": out / ACCEPTANCE_PNG, "speedup": out / SPEEDUP_PNG}
    paths["json"].write_text(json.dumps(results.to_dict(), indent=1) + "\n")
    paths["markdown"].write_text(markdown_report(results))
    _plot_tau(results, paths["tau"])
    _plot_acceptance(results, paths["acceptance"])
    _plot_speedup(results, paths["speedup"])
    return paths


# ---------------------------------------------------------------------------------- markdown
def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown_table(results: BenchResults) -> str:
    """One row per runner × dataset: τ, tokens/s, speedups, acc@1..γ, rounds, time shares, greedy match."""
    g = results.config.gamma
    head = (["dataset", "runner", "τ", "drafts acc", "tok/s", "× none", "× HF gen"] + [f"acc@{k}" for k in range(1, g + 1)]
            + ["rounds", "draft %", "verify %"] + (["= none", "prefix = none"] if results.config.greedy else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ds in results.dataset_names:
        for label in results.labels:
            c = results.cell(label, ds)
            if c is None:
                continue
            acc = c.acceptance or [None] * g
            row = [ds, label, _num(c.tau), _num(_pct(c.draft_acceptance), "{:.1f}%"), _num(c.tokens_per_s, "{:.1f}"), _num(c.speedup_vs_none),
                   _num(c.speedup_vs_hf)] + [_num(a) for a in acc]
            row += [_num(c.rounds, "{:.0f}"), _num(_pct(c.draft_share), "{:.0f}"), _num(_pct(c.verify_share), "{:.0f}")]
            if results.config.greedy:
                row += [_num(_pct(c.greedy_match), "{:.0f}%"), _num(_pct(c.greedy_prefix), "{:.0f}%")]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def markdown_report(results: BenchResults) -> str:
    cfg, m, t = results.config, results.machine, results.target
    mode = "greedy (T = 0)" if cfg.greedy else f"sampled (T = {cfg.temperature}, top-p {cfg.top_p})"
    sets = ", ".join(f"{d['name']} ({d['num_prompts']} prompts"
                     + (f", {d['malformed_lines']} malformed lines skipped" if d["malformed_lines"] else "") + ")"
                     for d in results.datasets)
    parts = [
        "# selfdraft benchmark\n",
        f"- command: `{cfg.command}`" if cfg.command else "- command: (library call)",
        f"- target: {t['name']} ({t['num_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}), "
        f"dtype {m['dtype']}",
        f"- machine: {m['cpu']}" + (f" (family/model {m['cpu_family_model']})" if m.get("cpu_family_model") else "")
        + f", {m['cores']} cores, {m['torch_threads']} torch threads, load average {m['load_average_1m']} at the start; "
        f"flags {' '.join(m.get('cpu_flags') or ['-'])}; torch {m['torch']}, transformers {m['transformers']}",
        f"- decoding: {mode}, γ = {cfg.gamma}, max {cfg.max_new_tokens} new tokens, {cfg.repeats} pass(es) "
        f"(tokens/s = median over passes), wall {results.wall_s:.0f} s",
        f"- datasets: {sets}",
        *([f"- the hardware scheduler's cost table, measured at the start (ms per forward of B tokens): "
           + ", ".join(f"{b}: {ms}" for b, ms in m["cost_table_ms"].items())] if m.get("cost_table_ms") else []),
        "",
        f"τ = mean accepted length per round incl. the bonus token (ceiling γ + 1 = {cfg.gamma + 1}); "
        "acc@k = P(draft k accepted | drafts 1..k−1 accepted), pooled over rounds; speedups are tokens/s "
        f"ratios to `{BASELINE}` (our plain decoding) and to `{HF_GENERATE}` measured in this run"
        + ("; `= none`: share of generations whose tokens equal `none`'s, `prefix = none`: mean share of "
           "`none`'s tokens reproduced before the first difference (bf16 verification of a block can flip "
           "near-ties that single-token decoding resolves the other way; float32 matches exactly)."
           if cfg.greedy else "."),
        "",
        markdown_table(results),
        f"![τ per dataset]({TAU_PNG})\n",
        f"![position-wise conditional acceptance]({ACCEPTANCE_PNG})\n",
        f"![speedup]({SPEEDUP_PNG})\n",
    ]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(results: BenchResults, label: str) -> str:
    """One color per runner across all plots."""
    return f"C{results.labels.index(label) % 10}"


def _grouped_bars(ax, results: BenchResults, labels: list[str], value) -> None:
    """Bars of value(cell) for each label, grouped by dataset, with the value printed on top."""
    names = results.dataset_names
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs, ys = [], []
        for i, ds in enumerate(names):
            c = results.cell(label, ds)
            y = value(c) if c is not None else None
            if y is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(y)
        bars = ax.bar(xs, ys, width, label=label, color=_color(results, label))
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _plot_tau(results: BenchResults, path: Path) -> None:
    plt = _pyplot()
    labels = [lb for lb in results.labels if any(c.tau is not None for c in results.metrics if c.label == lb)]
    ceiling = results.config.gamma + 1
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(results.dataset_names) * max(1, len(labels)) ** 0.5, 3.6))
    _grouped_bars(ax, results, labels, lambda c: c.tau)
    ax.axhline(ceiling, color="black", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[0], ceiling, f" ceiling γ+1 = {ceiling}", va="bottom", fontsize=8)
    ax.set_ylim(0, ceiling * 1.12)
    ax.set_ylabel("τ (accepted length per round, incl. bonus)")
    ax.set_title(f"τ per dataset ({_mode(results)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_acceptance(results: BenchResults, path: Path) -> None:
    plt = _pyplot()
    names = results.dataset_names
    ks = list(range(1, results.config.gamma + 1))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 1.4, 3.2), sharey=True, squeeze=False)
    for ax, ds in zip(axes[0], names):
        for label in results.labels:
            c = results.cell(label, ds)
            if c is None or not c.acceptance or all(a is None for a in c.acceptance):
                continue  # `none` and HF peers have no per-position statistics
            pts = [(k, a) for k, a in zip(ks, c.acceptance) if a is not None]
            ax.plot(*zip(*pts), marker="o", markersize=3, label=label, color=_color(results, label))
        ax.set_title(ds, fontsize=10)
        ax.set_xticks(ks)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(k accepted | 1..k−1 accepted)")
    handles, lbls = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, lbls, fontsize=8, loc="upper right")
    fig.suptitle(f"Position-wise conditional acceptance ({_mode(results)})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9 if handles else 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_speedup(results: BenchResults, path: Path) -> None:
    """One panel per baseline present in the run: vs our `none`, vs HF generate()."""
    plt = _pyplot()
    panels = [(BASELINE, lambda c: c.speedup_vs_none), (HF_GENERATE, lambda c: c.speedup_vs_hf)]
    panels = [(b, f) for b, f in panels if any(f(c) is not None for c in results.metrics)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)) + 1.0, 3.6), squeeze=False)
    for ax, (base, value) in zip(axes[0], panels):
        labels = [lb for lb in results.labels if lb != base]
        _grouped_bars(ax, results, labels, value)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_ylabel(f"tokens/s ÷ {base} tokens/s")
        ax.set_title(f"speedup vs {base} ({_mode(results)})", fontsize=10)
    if not panels:
        axes[0][0].text(0.5, 0.5, f"no baseline in this run (add `{BASELINE}` or the HF peers)", ha="center")
        axes[0][0].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mode(results: BenchResults) -> str:
    cfg = results.config
    return f"T={cfg.temperature:g}, γ={cfg.gamma}"

