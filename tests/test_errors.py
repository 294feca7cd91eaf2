"""Bad input gets a clear, actionable error."""

from __future__ import annotations

import importlib.util
import struct

import pytest
from typer.testing import CliRunner
from transformers import ViTConfig

from selfdraft.cli import app
from selfdraft.config import ConfigError, DrafterConfig, GenerationConfig, SamplingParams, from_dict
from selfdraft.decode import generate
from selfdraft.loader import load_drafter
from selfdraft.methods.dflash.config import DFlashConfig
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.target import Target, TargetError
from tests.helpers import tiny_llama


def test_missing_target_path(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        Target.load(str(tmp_path / "nope"))


def test_non_causal_model_dir(tmp_path):
    ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(TargetError, match="causal language model"):
        Target.load(str(tmp_path))


def test_dir_without_config(tmp_path):
    with pytest.raises(TargetError, match="config.json"):
        Target.load(str(tmp_path))


def test_gguf_without_gguf_package(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(TargetError, match="pip install gguf"):
        Target.load(str(f))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k")],
)
def test_impossible_sampling_parameters(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_max_tokens_below_one():
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


def test_prompt_longer_than_context():
    target = Target(tiny_llama(max_pos=32))
    with pytest.raises(TargetError, match="exceeds the target's context of 32"):
        generate(target, NoDrafter(), list(range(30)), config=GenerationConfig(max_new_tokens=8))


def test_unknown_drafter_and_config_keys(tiny_target):
    with pytest.raises(ConfigError, match="unknown drafter"):
        load_drafter("warp-drive", tiny_target)
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(DrafterConfig, {"gama": 7})


@pytest.mark.parametrize(
    "args, match",
    [(["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"), (["-n", "0"], "max_new_tokens"),
     ([], None)],
)
def test_cli_reports_errors_without_traceback(args, match):
    argv = ["generate", *args] + (["-p", "hi"] if match else [])
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    if match:
        assert match in res.output


# ---------------------------------------------------------------- a corpus of bad files through the CLI
def _checkpoint(tmp_path, drafter_method: str, method: str = "dflash"):
    """A real tiny DFlash checkpoint for the saved target dir, its config.json then edited."""
    import json

    from selfdraft.checkpoint import save_checkpoint
    from selfdraft.training.strategy import STRATEGIES

    target_dir = tmp_path / "target"
    tiny_llama().save_pretrained(target_dir)
    target = Target.load(str(target_dir), dtype="float32")
    cfg = DFlashConfig(feature_layers=(1, 2))
    d = save_checkpoint(tmp_path / "ckpt", STRATEGIES["dflash"].build(cfg, target), cfg, target, {})
    meta = json.loads((d / "config.json").read_text())
    meta["method"], meta["drafter"]["method"] = method, drafter_method
    (d / "config.json").write_text(json.dumps(meta))
    return ["--target", str(target_dir), "--dtype", "float32", "--drafter", str(d), "-p", "hi"], d / "config.json"


def _gguf(tmp_path, name: str, data: bytes):
    f = tmp_path / name
    f.write_bytes(data)
    return ["--target", str(f), "-p", "hi"], f


def _prompt_file(tmp_path, data: bytes):
    f = tmp_path / "prompt.txt"
    f.write_bytes(data)
    return ["--prompt-file", str(f)], f


BAD_FILES = {  # case -> (builder(tmp_path) -> (generate argv, the file the error must name), what the line says)
    "empty gguf": (lambda t: _gguf(t, "empty.gguf", b""), "empty"),
    "garbage gguf": (lambda t: _gguf(t, "garbage.gguf", bytes(range(256)) * 40), "not a GGUF file"),
    "truncated gguf": (lambda t: _gguf(t, "cut.gguf", b"GGUF" + struct.pack("<IQQ", 3, 12, 30) + b"\x05\x00"),
                       "truncated or corrupt"),
    "non-UTF-8 prompt file": (lambda t: _prompt_file(t, "café".encode("latin-1")), "not UTF-8"),
    "binary prompt file": (lambda t: _prompt_file(t, b"\x7fELF\x02\x01\x00\x00\x00"), "binary"),
    "unknown method in drafter block": (lambda t: _checkpoint(t, "bogus"), "disagree"),
    "methods disagree": (lambda t: _checkpoint(t, "dspark"), "disagree"),
    "unknown method everywhere": (lambda t: _checkpoint(t, "bogus", "bogus"), "does not know"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_give_one_line_naming_the_file_and_exit_2(case, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    build, says = BAD_FILES[case]
    argv, path = build(tmp_path)
    res = CliRunner().invoke(app, ["generate", *argv])
    lines = [x for x in res.output.splitlines() if x.strip() and not x.startswith("converting ")]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    assert str(path) in lines[0] and says in lines[0], lines[0]
    assert not (tmp_path / "cache" / "targets").exists() or not any(
        ".partial" in p.name for p in (tmp_path / "cache" / "targets").iterdir())


def test_cli_temperature_too_small_for_float32_decodes_greedily_and_nan_exits_2(tmp_path):
    import json

    from tests.helpers import char_tokenizer

    tok = char_tokenizer()
    tiny_llama(vocab=len(tok), seed=3).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    base = ["generate", "-p", "hello", "--target", str(tmp_path), "--dtype", "float32", "-n", "12", "--json"]
    runs = {t: CliRunner().invoke(app, [*base, "--temperature", t, "--seed", "1"]) for t in ("0", "1e-40", "5e-324")}
    assert all(r.exit_code == 0 for r in runs.values()), [r.output for r in runs.values()]
    ids = {t: json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for t, r in runs.items()}  # stderr: notes
    assert ids["1e-40"] == ids["5e-324"] == ids["0"]
    for bad in ("nan", "inf"):
        res = CliRunner().invoke(app, [*base, "--temperature", bad])
        assert res.exit_code == 2 and "temperature" in res.output and "Traceback" not in res.output


# ----------------------------------------------------------------------------- one error base, one exit-code map
def test_user_errors_share_one_base_with_an_exit_code():
    from selfdraft.bench.datasets import DatasetError
    from selfdraft.checkpoint import CheckpointError
    from selfdraft.errors import SelfdraftError
    from selfdraft.training.records import DataError

    for cls in (ConfigError, TargetError, DataError, CheckpointError, DatasetError):
        assert issubclass(cls, SelfdraftError) and issubclass(cls, ValueError) and cls.exit_code == 2, cls


def test_cli_maps_errors_to_exit_codes_in_one_place():
    """common.command: a SelfdraftError exits with its own code and one line, an unreadable file with 2,
    anything else (a bug) keeps its traceback. Control: the same function unwrapped raises."""
    import typer

    from selfdraft.cli.common import command
    from selfdraft.errors import SelfdraftError

    class Quota(SelfdraftError):
        exit_code = 3

    raised = {"quota": Quota("over quota: ask for more"), "io": FileNotFoundError("no such file: x"),
              "bug": KeyError("bug"), "data": TargetError("bad target")}
    toy = typer.Typer()

    @command(toy, "run")
    def run(kind: str) -> None:
        raise raised[kind]

    command(toy, "noop")(lambda: None)  # two commands, so `run` stays a subcommand
    codes = {k: CliRunner().invoke(toy, ["run", k]) for k in raised}
    assert codes["quota"].exit_code == 3 and codes["quota"].output.strip() == "error: over quota: ask for more"
    assert codes["io"].exit_code == 2 and "no such file: x" in codes["io"].output
    assert codes["data"].exit_code == 2 and "bad target" in codes["data"].output
    assert codes["bug"].exit_code == 1 and isinstance(codes["bug"].exception, KeyError)
    with pytest.raises(Quota):
        run("quota")  # the decorator registers a wrapper; the function itself is unchanged


def test_no_command_catches_errors_itself():
    """The exit-code mapping lives in cli/common.py only: no command module has its own except tuple
    of selfdraft errors."""
    import ast
    from pathlib import Path

    import selfdraft.cli

    names = {"ConfigError", "TargetError", "DataError", "CheckpointError", "DatasetError", "SelfdraftError"}
    bad = []
    for f in sorted(Path(selfdraft.cli.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None and f.name != "common.py":
                caught = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                if caught & names:
                    bad.append(f"{f.name}:{node.lineno}")
    assert not bad, bad


def test_two_processes_converting_one_gguf_at_once_both_get_a_complete_directory(tmp_path, monkeypatch):
    """Two `data regenerate --part` processes on a new machine convert the embedded GGUF at the same moment:
    each writes a private copy, so neither reads a directory the other is still writing or renaming."""
    import threading

    import selfdraft.target_loading as tg
    from tests.helpers import char_tokenizer

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(64))
    both_saved = threading.Barrier(2, timeout=60)

    class Tok:  # a tokenizer whose save waits until both models are on disk: the interleaving that raced
        @staticmethod
        def from_pretrained(*a, **k):
            tok = char_tokenizer()
            save = tok.save_pretrained
            tok.save_pretrained = lambda d: (both_saved.wait(), save(d))
            return tok

    monkeypatch.setattr(tg.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_llama(vocab=40, seed=0))
    monkeypatch.setattr(tg, "AutoTokenizer", Tok)
    got, errors = [], []

    def convert():
        try:
            got.append(tg._converted_gguf_dir(f, cache_name="same"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    out = tmp_path / "cache" / "targets" / "same"
    assert got == [out, out]
    assert {"model.safetensors", "config.json", "selfdraft_converted.json"} <= {p.name for p in out.iterdir()}
    assert [p.name for p in out.parent.iterdir()] == ["same"]  # no temporary copy left behind
    Target.load(str(out))
