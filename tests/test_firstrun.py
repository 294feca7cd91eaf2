"""What a newcomer meets first (issue: the README pipeline at small scale): a val split even for a small
--limit, warnings and errors that name an empty split, progress lines in logs, calibration notes, input
that cannot be meant refused, one --threads default, the demo's headline, --final-only checkpoints."""

from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from selfdraft.cli import app
from selfdraft.cli.generate import demo_headline
from selfdraft.config import DEFAULT_THREADS
from selfdraft.progress import LogProgress, progress_bar
from selfdraft.training.calibrate import HeldOutRounds, report, sequential_temperature_scaling
from selfdraft.training.sources import SourceStats, collect_prompts, select_prompts
from tests.helpers import readme_first_try, tiny_llama
from tests.toy_training import TOY, single_thread, toy_method, write_dataset  # noqa: F401  (fixtures)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def target_dir(tmp_path):
    path = tmp_path / "tiny-target"
    tiny_llama(peaked=4.0).save_pretrained(path)
    return path


@pytest.fixture
def chat_target_dir(tmp_path):
    from tests.helpers import char_tokenizer

    tok, d = char_tokenizer(), tmp_path / "tiny-chat"
    tiny_llama(vocab=len(tok), hidden=32, layers=2, seed=3, max_pos=512).save_pretrained(d)
    tok.save_pretrained(d)
    return d


# ------------------------------------------------------------------ 1. an empty validation split
def _prompts(tmp_path, n: int):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(n)))
    return collect_prompts([str(src)], val_fraction=0.02)[0]


def test_a_small_limit_still_gets_one_val_prompt(tmp_path):
    prompts = _prompts(tmp_path, 40)
    assert sum(p.split == "val" for p in prompts[:4]) == 0  # the README's small --limit: all train by hash
    chosen = select_prompts(_prompts(tmp_path, 40), lambda p: 1, 512, limit=4, stats=SourceStats(), min_val=1)
    val = [p for p in chosen if p.split == "val"]
    assert len(chosen) == 4 and len(val) == 1
    assert val[0].id == min((p.id for p in chosen), key=lambda i: int(i[8:16], 16))  # nearest the val range
    again = select_prompts(_prompts(tmp_path, 40), lambda p: 1, 512, limit=4, stats=SourceStats(), min_val=1)
    assert [p.split for p in again] == [p.split for p in chosen]  # deterministic: resume writes the same splits
    one = select_prompts(_prompts(tmp_path, 40), lambda p: 1, 512, limit=1, stats=SourceStats(), min_val=1)
    assert [p.split for p in one] == ["train"]  # a single prompt stays train
    off = select_prompts(_prompts(tmp_path, 40), lambda p: 1, 512, limit=4, stats=SourceStats(), min_val=0)
    assert all(p.split == "train" for p in off)  # --val-fraction 0: no val asked for


def test_train_warns_without_val_and_calibrate_names_the_empty_split(toy_method, target_dir, tmp_path):
    data = write_dataset(tmp_path / "data", n_train=8, n_val=0)
    out = tmp_path / "out"
    res = invoke("train", "--method", TOY, "--target", str(target_dir), "--data", str(data), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--max-seq-len", "24", "--feature-layers", "1,2",
                 "--no-bf16", "--dtype", "float32", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert "has no validation conversations (split val)" in res.output
    res = invoke("calibrate", "--drafter", str(out), "--target", str(target_dir), "--data", str(data),
                 "--dtype", "float32", "--threads", "1")
    assert res.exit_code == 2 and "has no 'val' conversations" in res.output and "split is empty" in res.output
    assert "no calibration rounds" not in res.output


def test_regenerate_cli_writes_a_val_split_or_says_it_is_empty(chat_target_dir, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(4)))
    common = ["data", "regenerate", str(src), "--target", str(chat_target_dir), "-n", "4", "--dtype", "float32",
              "--threads", "1"]  # fmt: skip
    res = invoke(*common, "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.output
    assert "dataset: 3 train + 1 val conversations" in res.output and "no validation" not in res.output
    res = invoke(*common, "--out", str(tmp_path / "none"), "--val-fraction", "0")
    assert res.exit_code == 0, res.output
    assert "dataset: 4 train + 0 val" in res.output and "has no validation conversations" in res.output


# ------------------------------------------------------------------ 2. progress lines when not on a terminal
def test_progress_is_periodic_lines_off_a_terminal():
    f = io.StringIO()
    bar = progress_bar(total=4, desc="train toy", unit="step", file=f, interval=0.05)
    assert isinstance(bar, LogProgress)
    for i in range(4):
        time.sleep(0.06)
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
        bar.update(1)
    bar.write("step 2: val loss 1.0", file=f)
    bar.close()
    text = f.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert lines[0].startswith("train toy:   0% 0/4")
    final = [ln for ln in lines if ln.startswith("train toy: 100% 4/4")]
    assert len(final) == 1 and "step/s" in final[0] and "<00:00" in final[0] and "loss=0.250" in final[0]

    f = io.StringIO()  # a long interval: the first and the final line only
    for _ in progress_bar(range(50), desc="calibration rounds", unit="prompt", file=f, interval=3600):
        pass
    assert [ln.split(":")[0] for ln in f.getvalue().splitlines()] == ["calibration rounds"] * 2
    assert "50/50" in f.getvalue().splitlines()[-1]


def test_train_prints_progress_lines_into_a_log(toy_method, target_dir, tmp_path):
    """CliRunner's stderr is not a terminal: tqdm's disable=None used to print nothing at all."""
    data = write_dataset(tmp_path / "data")
    res = invoke("train", "--method", TOY, "--target", str(target_dir), "--data", str(data), "--out",
                 str(tmp_path / "o"), "--steps", "3", "--batch-size", "2", "--max-seq-len", "24",
                 "--feature-layers", "1,2", "--no-bf16", "--dtype", "float32", "--threads", "1")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith(f"train {TOY}:")]
    assert lines[0].startswith(f"train {TOY}:   0% 0/3") and lines[-1].startswith(f"train {TOY}: 100% 3/3")
    assert "\r" not in res.output


# ------------------------------------------------------------------ 3. calibration without evidence says so
def test_calibration_notes_positions_without_evidence():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 4, generator=g)
    accepted = torch.rand(200, 4, generator=g) < 0.9
    accepted[:, 2] = False  # nobody survives draft 3: y_3 and y_4 have one class
    rounds = HeldOutRounds(z=z, accepted=accepted)
    temps = sequential_temperature_scaling(rounds)
    rep = report(rounds, temps)
    assert rep[0].note == "" and rep[1].note == ""
    assert rep[2].note.startswith("one class only: no round accepts drafts 1..3")
    assert rep[3].note.startswith("too few rounds: 0 reach position 4")
    assert temps[2] == temps[3] == temps[1] and "kept from position 2" in rep[2].note
    for r in rep:  # AUC is nan exactly where a note explains it
        assert (r.auc_after != r.auc_after) == (r.k >= 3)
    few = report(HeldOutRounds(z=z[:5], accepted=accepted[:5]), sequential_temperature_scaling(
        HeldOutRounds(z=z[:5], accepted=accepted[:5])))
    assert few[0].temperature == 1.0 and few[0].note == "too few rounds: 5 reach position 1 (< 20); T_1 = 1"
    assert few[0].rounds_reached == 5


def test_calibrate_cli_prints_the_notes(target_dir, tmp_path):
    from selfdraft.checkpoint import save_checkpoint
    from selfdraft.methods.dspark.config import DSparkConfig
    from selfdraft.target import Target
    from selfdraft.training.strategy import STRATEGIES

    target = Target.load(str(target_dir), dtype="float32")
    cfg = DSparkConfig(feature_layers=(1, 2), gamma=3, markov_rank=8)
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "d", STRATEGIES["dspark"].build(cfg, target), cfg, target, {})
    data = write_dataset(tmp_path / "data", n_train=2, n_val=2)
    res = invoke("calibrate", "--drafter", str(ckpt), "--target", str(target_dir), "--data", str(data),
                 "-n", "6", "--dtype", "float32", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert "too few rounds" in res.output and "positions" in res.output and "--num-prompts; 2 used" in res.output
    assert any(ln.startswith("calibration rounds: 100% 2/2") for ln in res.output.splitlines())


# ------------------------------------------------------------------ 4. input that cannot be meant
@pytest.mark.parametrize("args, match", [
    (["generate", "-p", ""], "the prompt is empty"),
    (["generate", "-p", "  \n"], "the prompt is empty"),
    (["generate", "-p", "hi", "--gamma", "0"], "--gamma must be >= 1"),
    (["bench", "--out", "x", "--gamma", "0"], "--gamma must be >= 1"),
    (["serve", "--gamma", "0"], "--gamma must be >= 1"),
    (["profile", "--engine", "ngram", "--gamma", "0"], "--gamma must be >= 1"),
    (["generate", "-p", "hi", "--threads", "0"], "--threads must be >= 1"),
])  # fmt: skip
def test_rejects_what_cannot_be_meant(args, match):
    res = invoke(*args)
    assert res.exit_code == 2 and match in res.output and "Traceback" not in res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1  # one line


def test_empty_prompt_file_is_rejected(tmp_path):
    (tmp_path / "p.txt").write_text("\n")
    res = invoke("generate", "--prompt-file", str(tmp_path / "p.txt"))
    assert res.exit_code == 2 and "the prompt is empty" in res.output


# ------------------------------------------------------------------ 5. one --threads, one default
def test_every_compute_command_has_threads_with_one_default():
    import typer.main

    group = typer.main.get_command(app)
    commands = {**group.commands, **{f"data {k}": v for k, v in group.commands["data"].commands.items()}}
    compute = ["generate", "demo", "data regenerate", "data features", "train", "bench", "profile", "calibrate", "serve"]
    for name in compute:
        opt = next((p for p in commands[name].params if p.name == "threads"), None)
        assert opt is not None, f"{name} has no --threads"
        assert opt.default == DEFAULT_THREADS and opt.opts == ["--threads"], name


# ------------------------------------------------------------------ 6. the demo leads with the result
def _result(tok_s: float, tau: float = 2.0, ids=(1, 2, 3)):
    return SimpleNamespace(tokens_per_s=tok_s, tau=tau, token_ids=list(ids))


def test_demo_headline_says_plainly_when_slower_on_a_busy_machine():
    fast = demo_headline("dspark", _result(40.0), _result(20.0), load=0.2, cores=2)
    assert fast.startswith("speedup 2.00x: dspark 40.0 tok/s") and "identical outputs" in fast and "SLOWER" not in fast
    busy = demo_headline("dspark", _result(15.0), _result(20.0), load=3.4, cores=2).splitlines()
    assert busy[0].startswith("speedup 0.75x")
    assert "SLOWER than plain decoding" in busy[1] and "busy: load average 3.4 on 2 cores" in busy[1]
    assert "rerun" in busy[1]
    idle = demo_headline("dspark", _result(15.0), _result(20.0), load=0.1, cores=2)
    assert "not busy: load average 0.1 on 2 cores" in idle and "drafter's cost" in idle
    flipped = demo_headline("dspark", _result(30.0, ids=(1, 2, 9)), _result(20.0), load=0.0, cores=2)
    assert "equal for the first 2 tokens" in flipped


def test_demo_first_line_is_the_speedup(chat_target_dir):
    res = CliRunner().invoke(app, ["demo", "--target", str(chat_target_dir), "--drafter", "ngram", "-n", "8",
                                   "--dtype", "float32", "--threads", "1"])
    assert res.exit_code == 0, res.output
    stdout = res.stdout.splitlines()
    assert stdout[0].startswith("speedup ") and "ngram" in stdout[0] and "--- prompt ---" in res.stdout


def test_auto_drafter_is_the_shipped_hybrid_on_the_embedded_target_only(chat_target_dir, monkeypatch, tmp_path):
    """`--drafter auto` (demo, generate and serve's default): hybrid over the shipped DSpark where it fits the
    target (the embedded one, in a checkout that has it), training-free ngram everywhere else; a named drafter
    passes through."""
    from selfdraft.cli import common

    embedded, other = common.TargetOptions(), common.TargetOptions(target=str(chat_target_dir))
    assert common.resolve_drafter("auto", embedded) == "hybrid:" + str(common.SHIPPED / "dspark")
    assert (common.SHIPPED / "dspark" / "config.json").exists()  # so the line above names a real drafter
    assert common.resolve_drafter("auto", other) == "ngram"
    assert common.resolve_drafter("suffix", embedded) == "suffix"
    monkeypatch.setattr(common, "SHIPPED", tmp_path)  # an install without checkpoints/
    assert common.resolve_drafter("auto", embedded) == "ngram"
    res = CliRunner().invoke(app, ["demo", "--target", str(chat_target_dir), "-n", "4", "--dtype", "float32", "--threads", "1"])
    assert res.exit_code == 0 and "ngram" in res.stdout.splitlines()[0], res.output


# ------------------------------------------------------------------ 7. --final-only keeps the weights alone
def test_train_final_only_drops_the_trainer_state(toy_method, target_dir, tmp_path):
    data = write_dataset(tmp_path / "data")
    common = ["--method", TOY, "--target", str(target_dir), "--data", str(data), "--steps", "2", "--batch-size",
              "2", "--max-seq-len", "24", "--feature-layers", "1,2", "--no-bf16", "--dtype", "float32",
              "--threads", "1"]  # fmt: skip
    res = invoke("train", *common, "--out", str(tmp_path / "full"))
    assert res.exit_code == 0 and (tmp_path / "full" / "trainer_state.pt").exists(), res.output
    assert "trainer_state.pt" in res.output and "MB (resume only" in res.output
    res = invoke("train", *common, "--out", str(tmp_path / "final"), "--final-only")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "final" / "model.safetensors").exists() and not (tmp_path / "final" / "trainer_state.pt").exists()
    assert "model.safetensors" in res.output and "trainer_state.pt" not in res.output.split("->")[-1]



# ------------------------------------------------------------------ 8. the README's first try, as written there
def test_the_readme_first_try_runs_as_written(tmp_path, monkeypatch):
    """Every command of the README's small-scale pipeline, verbatim, on a tiny chat model instead of the
    embedded target (the only change: --target, float32, and paths under a temporary directory)."""
    from tests.helpers import char_tokenizer

    tok, chat_target_dir = char_tokenizer(), tmp_path / "tiny-chat-6"
    tiny_llama(vocab=len(tok), hidden=32, layers=6, seed=3, max_pos=512).save_pretrained(chat_target_dir)
    tok.save_pretrained(chat_target_dir)
    monkeypatch.chdir(tmp_path)
    runs = readme_first_try()
    assert len(runs) == 5
    for args in runs:
        extra = ["--target", str(chat_target_dir), "--threads", "1"]
        if args[0] in ("data", "train", "calibrate", "bench"):
            extra += ["--dtype", "float32"]
        if args[0] == "train":
            extra += ["--no-bf16"]
        res = invoke(*args, *extra)
        assert res.exit_code == 0, f"{' '.join(args)}:\n{res.output}"
    assert (tmp_path / "runs/first-ckpt/model.safetensors").exists()
    assert (tmp_path / "runs/first-ckpt/calibration.json").exists()
    assert list((tmp_path / "runs/first").glob("*.md")), "bench wrote no report"
