"""The README is a contract: what a newcomer reads first must stay true. Fast: nothing loads
a model. Commands are checked against the Typer app itself (its click tree), not `--help` text.

- the first screen names the two commands, and both are Makefile targets;
- every `selfdraft CMD [SUB] --option` (also `$S ...`, `-m selfdraft ...`) in a code block or an inline
  code span is a real command and option;
- every repo path, `make` target and BENCHMARKS.md / docs/ anchor it names exists;
- the sections a newcomer needs are there, in their order.
"""

from __future__ import annotations

import re

import pytest
import typer

from selfdraft.cli import app
from tests.helpers import ROOT, cli_problem, readme_first_try, code_blocks, inline_spans, make_targets, path_problems, readme_invocations, \
    selfdraft_invocations, shell_lines  # noqa: F401

README = ROOT / "README.md"
# The order a newcomer needs: each a level-2 heading starting with these words.
SECTIONS = ("Two commands", "The pipeline", "Serving", "Export", "Run your drafter in llama.cpp", "Distributed training", "Evidence",
            "Layout")
FIRST_SCREEN = 60  # lines


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
