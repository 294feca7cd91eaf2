"""Benchmark harness: metric definitions, prompt sets, drafter specs, report files, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfdraft.bench import (
    BenchConfig,
    DatasetError,
    DrafterSpec,
    PromptSet,
    Sample,
    bundled_names,
    compute_metrics,
    load_prompt_set,
    markdown_table,
    parse_drafter_spec,
    run_bench,
    write_report,
)
from selfdraft.bench.datasets import bundled_dir
from selfdraft.config import ConfigError
from selfdraft.decode import GenerationResult, RoundStats
from tests.helpers import FAKE_LLAMA_SERVER  # noqa: F401

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- metrics
def _result(rounds: list[tuple[int, int]], tokens: list[int], elapsed: float) -> GenerationResult:
    """rounds: (proposed, accepted) per round; draft/verify times 0.01 / 0.02 s each."""
    return GenerationResult(prompt_token_ids=[1, 2], token_ids=tokens, elapsed_s=elapsed,
                            rounds=[RoundStats(p, a, 0.01, 0.02) for p, a in rounds])


def test_metrics_match_direct_computation():
    gamma = 3
    # Two prompts; `none` never drafts, `spec` drafts up to γ = 3.
    spec_rounds = [[(3, 3), (3, 1), (2, 0)], [(3, 2), (0, 0), (3, 3)]]
    none_tokens = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
    samples = []
    for repeat, scale in enumerate([1.0, 1.5]):  # the second pass is slower: tokens/s takes the median
        for i in range(2):
            base = _result([(0, 0)] * 9, none_tokens[i], elapsed=1.0 * scale)
            spec_tokens = none_tokens[i] if i == 0 else none_tokens[i][:-1] + [8]  # prompt 1 differs
            spec = _result(spec_rounds[i], spec_tokens, elapsed=0.4 * scale)
            samples += [Sample.from_result(base, gamma, "none", "ds", i, repeat),
                        Sample.from_result(spec, gamma, "spec", "ds", i, repeat)]
    cells = {c.label: c for c in compute_metrics(samples, gamma, greedy=True)}
    none, spec = cells["none"], cells["spec"]

    # τ pooled over all rounds: Σ(accepted + 1) / #rounds, over both passes.
    flat = [a for r in spec_rounds for _, a in r] * 2
    assert spec.tau == pytest.approx(sum(a + 1 for a in flat) / len(flat))
    assert none.tau == 1.0 and spec.rounds == 6 and none.rounds == 18
    # Conditional acceptance by a direct loop over rounds.
    all_rounds = [r for rs in spec_rounds for r in rs] * 2
    for k in range(1, gamma + 1):
        tried = [(p, a) for p, a in all_rounds if p >= k and a >= k - 1]
        expect = sum(a >= k for _, a in tried) / len(tried)
        assert spec.acceptance[k - 1] == pytest.approx(expect)
        assert spec.acceptance_counts[k - 1] == (len(tried), sum(a >= k for _, a in tried))
    # Round by hand: k=1 tried in 5 rounds (not the 0-proposal one), accepted in 4.
    assert spec.acceptance_counts[0] == (10, 8)
    assert none.acceptance == [None] * gamma
    # tokens/s per pass = Σ tokens / Σ seconds; the median over 2 passes is their mean.
    tps = [(10 + 10) / (0.8 * s) for s in (1.0, 1.5)]
    assert spec.tokens_per_s_passes == pytest.approx(tps)
    assert spec.tokens_per_s == pytest.approx(sum(tps) / 2)
    assert spec.speedup_vs_none == pytest.approx(spec.tokens_per_s / none.tokens_per_s) == pytest.approx(2.5)
    assert none.speedup_vs_none == 1.0 and spec.speedup_vs_hf is None  # no HF peer in this run
    # Time shares and the greedy match rate (prompt 1 differs in both passes).
    assert spec.draft_share == pytest.approx((12 * 0.01) / (2 * 0.4 + 2 * 0.6))  # 12 rounds, 2.0 s
    assert spec.verify_share == pytest.approx(2 * spec.draft_share)
    assert spec.greedy_match == 0.5 and none.greedy_match is None
    assert spec.greedy_prefix == pytest.approx((1.0 + 9 / 10) / 2)  # prompt 1 differs at its 10th token


def test_sampled_runs_have_no_greedy_match():
    res = _result([(2, 1)], [1, 2, 3], 1.0)
    samples = [Sample.from_result(res, 2, lb, "ds", 0, 0) for lb in ("none", "ngram")]
    assert all(c.greedy_match is None for c in compute_metrics(samples, 2, greedy=False))


# ---------------------------------------------------------------------------------- datasets
def test_bundled_prompt_sets_load():
    names = bundled_names()
    assert {"mt-bench", "humaneval", "gsm8k"} <= set(names)
    assert (bundled_dir() / "README.md").exists()
    for name in names:
        ps = load_prompt_set(name, num_prompts=2)
        assert ps.name == name and len(ps.texts) == 2 and ps.malformed == 0
        assert all(isinstance(t, str) and t.strip() for t in ps.texts)
    assert len(load_prompt_set("mt-bench").texts) == 80


def test_jsonl_path_skips_and_counts_malformed_lines(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join([
        json.dumps({"turns": ["first prompt", "second turn is ignored"]}),
        "{not json",
        json.dumps({"prompt": "no turns key"}),
        json.dumps({"turns": []}),
        json.dumps({"turns": ["   "]}),
        json.dumps(["a list"]),
        "",
        json.dumps({"turns": ["second prompt"]}),
        json.dumps({"turns": ["third prompt"]}),
    ]) + "\n")
    ps = load_prompt_set(str(f), num_prompts=2)
    assert ps.name == "mine" and ps.texts == ["first prompt", "second prompt"]
    assert ps.malformed == 5 and ps.info()["malformed_lines"] == 5


def test_unknown_dataset_lists_valid_names(tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset 'mtbench'.*gsm8k.*humaneval.*mt-bench"):
        load_prompt_set("mtbench")
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    with pytest.raises(DatasetError, match="no usable prompt.*1 malformed"):
        load_prompt_set(str(bad))


# ---------------------------------------------------------------------------------- drafter specs
def test_drafter_specs(tmp_path):
    assert parse_drafter_spec("ngram") == DrafterSpec("ngram", "ngram")
    ck = tmp_path / "run7"
    ck.mkdir()
    assert parse_drafter_spec(str(ck)).label == "run7"  # no config.json: the dir name
    (ck / "config.json").write_text(json.dumps({"method": "dspark"}))
    assert parse_drafter_spec(str(ck)) == DrafterSpec("dspark", str(ck))
    assert parse_drafter_spec(f"mine:{ck}") == DrafterSpec("mine", str(ck))
    assert parse_drafter_spec("plain:none") == DrafterSpec("plain", "none")
    assert parse_drafter_spec(f"all:{ck}@fixed") == DrafterSpec("all", str(ck), "fixed")  # per-runner scheduler
    assert parse_drafter_spec("ngram@hardware") == DrafterSpec("ngram", "ngram", "hardware")
    with pytest.raises(ConfigError, match="unknown drafter 'ngram@psychic'"):
        parse_drafter_spec("ngram@psychic")
    with pytest.raises(ConfigError, match="unknown drafter 'eagle'"):
        parse_drafter_spec("eagle")
    with pytest.raises(ConfigError, match="neither a drafter name"):
        parse_drafter_spec(f"x:{tmp_path / 'nowhere'}")


# ---------------------------------------------------------------------------------- harness + report
@pytest.fixture
def tiny_results(tiny_target):
    sets = [PromptSet.from_token_ids("rep", [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5]]),
            PromptSet.from_token_ids("mix", [[9, 8, 7, 6]])]
    cfg = BenchConfig(max_new_tokens=10, gamma=4, repeats=2, progress=False, command="test")
    return run_bench(tiny_target, [parse_drafter_spec("none"), parse_drafter_spec("ngram")], sets, cfg)


def test_run_bench_runs_everyone_on_every_prompt(tiny_results):
    r = tiny_results
    assert r.labels == ["none", "ngram", "hf-generate", "hf-prompt-lookup"]
    assert len(r.samples) == 2 * 3 * 4  # passes × prompts × runners
    for c in r.metrics:
        assert c.tokens_per_s > 0 and len(c.tokens_per_s_passes) == 2
        assert c.speedup_vs_hf is not None and c.speedup_vs_none is not None
        # float32 tiny target: every runner, HF's included, reproduces plain greedy decoding.
        assert c.label == "none" or c.greedy_match == c.greedy_prefix == 1.0
    ngram = r.cell("ngram", "rep")
    assert 1.0 <= ngram.tau <= 5 and len(ngram.acceptance) == 4
    assert r.cell("hf-generate", "rep").tau is None


def test_duplicate_labels_refused(tiny_target):
    ps = PromptSet.from_token_ids("p", [[1, 2, 3]])
    with pytest.raises(ConfigError, match="duplicate runner label"):
        run_bench(tiny_target, [DrafterSpec("hf-generate", "none")], [ps], BenchConfig(max_new_tokens=2, progress=False))


def test_report_files(tiny_results, tmp_path):
    paths = write_report(tiny_results, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["config"]["command"] == "test" and data["ceiling_tau"] == 5
    assert {"cpu", "cores", "torch", "transformers", "dtype", "cpu_flags", "load_average_1m"} <= set(data["machine"])
    # ngram under `auto` is scheduled by the hardware rule: the run measured its cost table (B = 1..γ+1) and says so
    assert list(data["machine"]["cost_table_ms"]) == ["1", "2", "3", "4", "5"]
    assert len(data["metrics"]) == 4 * 2 and "token_ids" not in data["samples"][0]
    md = paths["markdown"].read_text()
    assert "| dataset | runner | τ | drafts acc | tok/s | × none | × HF gen | acc@1 |" in md and "| = none | prefix = none |" in md
    assert "| rep | ngram |" in md and markdown_table(tiny_results) in md
    assert "cost table, measured at the start (ms per forward of B tokens): 1: " in md and "load average" in md
    for key in ("tau", "acceptance", "speedup"):
        blob = paths[key].read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5000


# ---------------------------------------------------------------------------------- CLI (embedded target)
@pytest.mark.slow
def test_cli_bench_embedded(tmp_path):
    from typer.testing import CliRunner

    from selfdraft.cli import app

    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["bench", "--drafters", "none,ngram", "--datasets", "humaneval",
                                   "--num-prompts", "1", "--max-new-tokens", "16", "--threads", "1",
                                   "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(Path(out / "results.json").read_text())
    from selfdraft.bench.llamacpp import find_server

    peers = ["llama.cpp", "llama.cpp-ngram"] if find_server() else []  # found where llama.cpp is installed
    assert [r["label"] for r in data["runners"]] == ["none", "ngram", "hf-generate", "hf-prompt-lookup"] + peers
    assert data["machine"]["dtype"] == "float32" and data["machine"]["target_format"].startswith("native-")
    assert (out / "tau.png").stat().st_size > 0


def test_cli_bench_refuses_unknown_dataset(tmp_path):
    from typer.testing import CliRunner

    from selfdraft.cli import app

    res = CliRunner().invoke(app, ["bench", "--datasets", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown dataset 'nope'" in res.output and "gsm8k" in res.output


def test_llamacpp_peers_run_beside_ours_and_are_stopped(tiny_target, tmp_path, monkeypatch, capsys):
    """The llama.cpp peer end to end against a stand-in server: started plain and with n-gram
    speculation on the target's GGUF, asked for every prompt, stopped after the run; absent, skipped."""
    import os
    import sys

    from selfdraft.target import Target

    ps = PromptSet.from_token_ids("p", [[1, 2, 3], [4, 5, 6]])
    cfg = BenchConfig(max_new_tokens=5, gamma=3, progress=False)
    monkeypatch.setenv("SELFDRAFT_LLAMA_SERVER", str(tmp_path / "nowhere"))
    assert "llama.cpp" not in run_bench(tiny_target, [DrafterSpec("none", "none")], [ps], cfg).labels
    assert "llama.cpp peer skipped: not installed" in capsys.readouterr().err

    fake, log, gguf = tmp_path / "llama-server", tmp_path / "argv.jsonl", tmp_path / "t.gguf"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("SELFDRAFT_LLAMA_SERVER", str(fake))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setattr(Target, "gguf_source", property(lambda self: gguf))
    r = run_bench(tiny_target, [DrafterSpec("none", "none")], [ps], cfg)
    assert r.labels == ["none", "hf-generate", "hf-prompt-lookup", "llama.cpp", "llama.cpp-ngram"]
    for label in ("llama.cpp", "llama.cpp-ngram"):
        got = [s for s in r.samples if s.label == label]
        assert len(got) == 2 and all(s.token_ids == [0, 1, 2, 3, 4] for s in got)
    started = [json.loads(line) for line in log.read_text().splitlines()]
    assert [("ngram-simple" in x["argv"]) for x in started] == [False, True]
    assert all(x["argv"][x["argv"].index("-m") + 1] == str(gguf) for x in started)
    for x in started:  # stopped (terminated and reaped) when the run ended
        with pytest.raises(ProcessLookupError):
            os.kill(x["pid"], 0)
