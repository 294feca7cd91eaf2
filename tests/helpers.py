"""Helpers shared by the tests, in one module: tests import from here, not from each other.

- tiny_llama: a random Llama small enough for unit tests;
- repo_text_files, heading_anchors: the repository's text files and a Markdown page's anchors;
- reading shell blocks and `selfdraft` command lines out of Markdown, and checking them against the
  Typer app itself (README.md and BENCHMARKS.md are contracts: tests/test_readme.py, tests/test_text.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- tiny models
def tiny_llama(vocab: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0, peaked: float = 0.0,
               max_pos: int = 256, intermediate: int | None = None) -> LlamaForCausalLM:
    """A random Llama small enough for unit tests. `peaked` > 0 scales the output layer so p is far
    from uniform (statistical tests need distributions that differ visibly between models)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=intermediate or 2 * hidden, max_position_embeddings=max_pos,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, peaked / hidden**0.5)
    return model


# ----------------------------------------------------------------------------- the repository's text
SKIP = (
    ".gitignore",  # its patterns are repository-relative: a leading slash means the repository root
)


def repo_text_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored text files of the repository."""
    try:
        res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in res.stdout.decode().split("\0"):
        f = ROOT / name
        if not name or name in SKIP or not f.is_file():
            continue
        # Regenerated conversations are third-party prompt text (ShareGPT users' own words), not citations.
        if name.startswith("data/") and name.endswith(".jsonl"):
            continue
        data = f.read_bytes()
        if b"\0" not in data[:8192]:
            files.append(f)
    return files


def heading_anchors(md: Path) -> set[str]:
    """GitHub-style anchors of a Markdown file's headings (lowercase, punctuation dropped, spaces -> '-')."""
    out, fenced = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


# ----------------------------------------------------------------------------- reading the README
def code_blocks(text: str) -> list[str]:
    """The bodies of the fenced shell blocks (```bash ... ```); other blocks (Python, the layout) are not commands."""
    return re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, flags=re.S | re.M)


def inline_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def shell_lines(block: str) -> list[str]:
    """Logical shell lines of a code block: continuations joined, comments dropped."""
    lines, cur = [], ""
    for raw in block.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()  # a comment starts at a '#' after whitespace
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        lines.append(cur + line)
        cur = ""
    return [line for line in lines + [cur] if line.strip()]


def selfdraft_invocations(line: str) -> list[list[str]]:
    """Each `selfdraft ...` in a shell line, as its argument list (command words and options)."""
    try:
        words = shlex.split(line)
    except ValueError:  # not shell (e.g. Python in a block): nothing to check
        return []
    out, i = [], 0
    while i < len(words):
        w = words[i]
        is_cli = w in ("$S", "selfdraft") or (w.endswith("/bin/selfdraft") and "=" not in w) or (w == "selfdraft" and i and words[i - 1] == "-m")
        if is_cli:
            j = i + 1
            while j < len(words) and words[j] not in ("&&", "||", "|", ";"):
                j += 1
            out.append(words[i + 1 : j])
            i = j
        i += 1
    return out


def readme_invocations(text: str) -> list[list[str]]:
    found = [inv for block in code_blocks(text) for line in shell_lines(block) for inv in selfdraft_invocations(line)]
    found += [inv for span in inline_spans(text) if re.match(r"(\$S|selfdraft) \w", span)
              for inv in selfdraft_invocations(span)]
    return found


# ----------------------------------------------------------------------------- checking against the app
def cli_problem(args: list[str], root) -> str | None:
    """Why `selfdraft ARGS` is not a command line of the app (None if it is): an unknown command or
    subcommand, or an option the command does not declare."""
    cmd = root
    words = list(args)
    while hasattr(cmd, "commands"):  # a group (typer may bring its own click: no isinstance)
        if not words or words[0].startswith("-"):
            return None if cmd is not root else "no command"
        name = words.pop(0)
        if name not in cmd.commands:
            return f"unknown command {name!r} (known: {sorted(cmd.commands)})"
        cmd = cmd.commands[name]
    opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    for w in words:
        if w.startswith("-") and len(w) > 1 and not re.fullmatch(r"-\d[\d.]*", w):  # not a negative number
            if w.split("=", 1)[0] not in opts:
                return f"{cmd.name} has no option {w.split('=', 1)[0]}"
    return None


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for line in re.findall(r"^([\w./$()-][^:=\n]*):(?!=)", text, flags=re.M) for m in line.split()}


# A repo path the README names: under one of the tracked top-level folders, or a top-level file.
REPO_PATH = re.compile(r"(?<![\w./~-])((?:src|tests|docs|scripts|checkpoints|data/reference)/[\w./-]*[\w-]|"
                       r"(?:BENCHMARKS|README)\.md|Makefile|pyproject\.toml)(?:::(\w+))?(?:#([\w-]+))?")


def path_problems(text: str) -> list[str]:
    bad = []
    for path, test_name, anchor in REPO_PATH.findall(text):
        f = ROOT / path
        if not f.exists():
            bad.append(f"{path}: no such file or folder")
        elif test_name and f"def {test_name}(" not in f.read_text():
            bad.append(f"{path}::{test_name}: no such test")
        elif anchor and f.suffix == ".md" and anchor not in heading_anchors(f):
            bad.append(f"{path}#{anchor}: no such heading")
    for page, anchor in re.findall(r"\]\(((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?\)", text):  # Markdown links
        f = ROOT / page
        if not f.is_file() or (anchor and anchor not in heading_anchors(f)):
            bad.append(f"link {page}#{anchor}: does not resolve")
    return bad


def readme_first_try() -> list[list[str]]:
    """The commands of the README's "First try at small scale" block (after `$S`), read from README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"First try at small scale.*?```bash\n(.*?)```", text, flags=re.S)
    assert block, "README.md lost its 'First try at small scale' block"
    return [shlex.split(line)[1:] for line in block.group(1).splitlines() if line.startswith("$S ")]
