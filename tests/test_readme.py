"""The README is a contract (issue 24): what a newcomer reads first must stay true. Fast: nothing loads
a model. Commands are checked against the Typer app itself (its click tree), not `--help` text.

- the first screen names the two commands, and both are Makefile targets;
- every `selfdraft CMD [SUB] --option` (also `$S ...`, `-m selfdraft ...`) in a code block or an inline
  code span is a real command and option;
- every repo path, `make` target and BENCHMARKS.md / docs/ anchor it names exists;
- the sections a newcomer needs are there, in their order.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from selfdraft.cli import app
from tests.test_structure import heading_anchors

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The order a newcomer needs (issue 24): each a level-2 heading starting with these words.
SECTIONS = ("Two commands", "The pipeline", "Serving", "Export", "Run your drafter in llama.cpp", "Distributed training", "Evidence",
            "Layout")
FIRST_SCREEN = 60  # lines


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


def readme_problems(text: str) -> list[str]:
    """Everything the README promises that is not so, one line each (empty: the contract holds)."""
    bad = []
    head = "\n".join(text.splitlines()[:FIRST_SCREEN])
    targets = make_targets()
    for target in ("demo", "test"):
        if f"make {target}" not in head:
            bad.append(f"the first {FIRST_SCREEN} lines do not name `make {target}`")
        if target not in targets:
            bad.append(f"`make {target}` is not a Makefile target")
    for target in set(re.findall(r"(?<![\w-])make ([a-z][\w-]*)", text)):
        if target not in targets:
            bad.append(f"`make {target}`: no such Makefile target")
    root = typer.main.get_command(app)
    invocations = readme_invocations(text)
    if not invocations:
        bad.append("no `selfdraft` command in the README's code")
    for args in invocations:
        why = cli_problem(args, root)
        if why:
            bad.append(f"`selfdraft {' '.join(args)}`: {why}")
    bad += path_problems(text)
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    at = [next((i for i, h in enumerate(headings) if h.startswith(s)), None) for s in SECTIONS]
    bad += [f"no section '## {s}...'" for s, i in zip(SECTIONS, at) if i is None]
    found = [i for i in at if i is not None]
    if found != sorted(found):
        bad.append(f"sections out of order: {[headings[i] for i in found]}; want {list(SECTIONS)}")
    return bad


# ----------------------------------------------------------------------------- the tests
def test_the_readme_keeps_its_promises():
    bad = readme_problems(README.read_text(encoding="utf-8"))
    assert not bad, "README.md:\n" + "\n".join(bad)


def test_the_first_try_block_is_the_one_the_pipeline_test_runs():
    from tests.test_firstrun import readme_first_try

    commands = readme_first_try()
    assert [c[0] for c in commands] == ["data", "data", "train", "calibrate", "bench"]
    assert all(" ".join(c).count("--target") == 0 for c in commands)  # the embedded target, as a newcomer runs it


@pytest.mark.parametrize("snippet, why", [
    ("```bash\n$S generate --no-such-flag\n```", "generate has no option --no-such-flag"),
    ("```bash\n$S data regen sharegpt\n```", "unknown command 'regen'"),
    ("```bash\nselfdraft bench --drafters none \\\n    --datasets x --nope 1\n```", "bench has no option --nope"),
    ("run `selfdraft train --method dspark --wrong`", "train has no option --wrong"),
    ("see docs" "/nope.md", "nope.md: no such file"),  # split: the repo-wide docs check reads this file too
    ("see docs" "/training.md#no-such-heading", "no such heading"),
    ("see [the numbers](BENCHMARKS.md#not-a-heading)", "does not resolve"),
    ("`tests/test_readme.py::test_not_there`", "no such test"),
    ("run `make demoo`", "`make demoo`: no such Makefile target"),
])
def test_the_check_catches_a_broken_readme(snippet, why):
    """Each kind of drift, added to the real README, is caught (a check that cannot fail proves nothing)."""
    assert not any(why in p for p in readme_problems(README.read_text(encoding="utf-8")))
    assert any(why in p for p in readme_problems(README.read_text(encoding="utf-8") + "\n" + snippet + "\n"))


def test_a_readme_without_its_first_screen_or_sections_fails():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    pushed = "\n".join(lines[:2] + ["filler"] * FIRST_SCREEN + lines[2:])
    assert any("do not name `make demo`" in p for p in readme_problems(pushed))
    dropped = re.sub(r"^## Serving.*?(?=^## )", "", text, flags=re.S | re.M)
    assert "no section '## Serving...'" in readme_problems(dropped)
