"""Benchmarks: bundled prompt sets, the interleaved harness, and the report (table + plots)."""

from selfdraft.bench.datasets import DatasetError, PromptSet, bundled_names, load_prompt_set
from selfdraft.bench.harness import (
    BenchConfig,
    BenchResults,
    CellMetrics,
    DrafterSpec,
    Sample,
    compute_metrics,
    parse_drafter_spec,
    run_bench,
)
from selfdraft.bench.report import markdown_table, write_report

__all__ = [
    "BenchConfig", "BenchResults", "CellMetrics", "DatasetError", "DrafterSpec", "PromptSet", "Sample",
    "bundled_names", "compute_metrics", "load_prompt_set", "markdown_table", "parse_drafter_spec",
    "run_bench", "write_report",
]
