"""Guards on the package's structure: no import cycles, inference independent of training, and
no file citing documents or machine paths outside the repository (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, heading_anchors, repo_text_files  # noqa: F401

SRC = ROOT / "src"
PKG = "selfdraft"


# ----------------------------------------------------------------------------- import graph
def module_names(src: Path, pkg: str) -> dict[str, Path]:
    """Dotted module name -> file for every .py under src/pkg (a package is its __init__)."""
    out = {}
    for f in sorted((src / pkg).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks (never executed, so not a runtime import)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(src: Path, pkg: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports at runtime, at any level (module, class, function).

    `from a.b import c` points at a.b.c when that is a module, else at a.b. Imports under
    `if TYPE_CHECKING:` are left out: they never run."""
    mods = module_names(src, pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` where only a.b is ours, etc.
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted, as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_import_graph_sees_function_level_imports_and_cycles(tmp_path):
    """Control: the walker finds a cycle closed only by a function-level import, ignores
    TYPE_CHECKING imports, and resolves relative imports."""
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from toy import b\n")
    (pkg / "b.py").write_text("def f():\n    from toy.c import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy import a\n")
    graph = import_graph(tmp_path, "toy")
    assert graph["toy.b"] == {"toy.c"} and graph["toy.c"] == {"toy.a"} and graph["toy.d"] == set()
    assert import_cycles(graph) == [["toy.a", "toy.b", "toy.c"]]
    (pkg / "c.py").write_text("")
    assert import_cycles(import_graph(tmp_path, "toy")) == []


def test_no_import_cycles():
    cycles = import_cycles(import_graph(SRC, PKG))
    assert not cycles, "import cycles (strongly connected module sets):\n" + "\n".join(" <-> ".join(c) for c in cycles)


# ----------------------------------------------------------------------------- inference without training
BLOCKER = """
import importlib, importlib.abc, sys

class BlockTraining(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "selfdraft.training" or name.startswith("selfdraft.training."):
            raise ImportError(f"blocked: {name} is a training module")
        return None

sys.meta_path.insert(0, BlockTraining())
failed = []
for mod in sys.argv[1:]:
    for name in [m for m in sys.modules if m == "selfdraft" or m.startswith("selfdraft.")]:
        del sys.modules[name]  # each module from scratch (torch etc. stay loaded)
    try:
        importlib.import_module(mod)
    except ImportError as e:
        failed.append(f"{mod}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def import_blocked(modules: list[str]) -> subprocess.CompletedProcess:
    """Import each module afresh (no selfdraft module loaded before it) in an interpreter where any
    selfdraft.training* import raises."""
    return subprocess.run([sys.executable, "-c", BLOCKER, *modules], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "", "OMP_NUM_THREADS": "1"}, timeout=300)


def inference_modules() -> list[str]:
    """Every module of every method except its train.py, the shared drafter blocks, the decoding loop,
    the batched engine, and the checkpoint formats with the loader that reads them (a trained drafter
    must load and run without training code)."""
    mods = sorted(m for m in module_names(SRC, PKG) if m.startswith((f"{PKG}.drafters", f"{PKG}.methods"))
                  and not m.endswith(".train"))
    assert {f"{PKG}.methods.{m}.{part}" for m in ("dflash", "eagle3", "mtp") for part in ("model", "drafter", "export")} <= set(mods)
    return mods + [f"{PKG}.{m}" for m in ("decode", "engine", "checkpoint", "export", "loader", "vocab")]


def test_only_a_methods_train_module_imports_training():
    """Inside selfdraft/methods/, train.py is the one file of a method that may import selfdraft.training
    (the import walk sees imports at any level, so none hides in a function)."""
    graph = import_graph(SRC, PKG)
    trains = {m for m in graph if m.startswith(f"{PKG}.methods.") and m.endswith(".train")}
    assert {f"{PKG}.methods.{m}.train" for m in ("dflash", "dspark", "eagle3", "mtp")} <= trains
    bad = sorted(m for m, deps in graph.items() if m.startswith(f"{PKG}.methods") and m not in trains
                 and any(d == f"{PKG}.training" or d.startswith(f"{PKG}.training.") for d in deps))
    assert not bad, f"methods modules other than train.py that import selfdraft.training: {bad}"
    assert all(any(d.startswith(f"{PKG}.training") for d in graph[m]) for m in trains)  # control: the walk sees them


def test_training_blocker_blocks():
    """Control: the blocker stops training imports and nothing else."""
    res = import_blocked([f"{PKG}.config", f"{PKG}.training.masks", f"{PKG}.verify"])
    assert res.returncode == 1 and res.stdout.splitlines() == [
        "selfdraft.training.masks: blocked: selfdraft.training is a training module"], res.stdout + res.stderr


def test_inference_modules_import_without_training():
    res = import_blocked(inference_modules())
    assert res.returncode == 0, "inference modules that need selfdraft.training:\n" + res.stdout + res.stderr[-2000:]


# ----------------------------------------------------------------------------- self-contained files
DOC_WORD = "DES" + "IGN"  # spelled in two parts, so a grep for the word finds real citations only
OUTSIDE_DOC = re.compile(rf"\b{DOC_WORD}(?:\.md|\s+(?:sections?\s+)?\d)")  # a design document not in this repository
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root)/|(?<![\w/-])(?:\.\./)*" + "sha" + "red/")  # this machine's paths and its shared folder


def test_no_file_cites_outside_documents_or_machine_paths():
    bad = []
    for f in repo_text_files():
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE_DOC.search(line) or MACHINE_PATH.search(line):
                bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, "cite docs/ pages and relative paths instead:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- docs references resolve
DOCS_REF = re.compile(r"(?<![\w/.])docs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")  # a repo-relative page, optional anchor
MD_LINK = re.compile(r"\]\(((?:\.\./)*(?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?\)")  # a Markdown link between docs pages


def test_docs_references_resolve():
    """Every docs page (and anchor) cited in the repository, and every Markdown link between docs
    pages, names an existing page and heading."""
    refs = []
    for f in repo_text_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        refs += [(f, ROOT / "docs" / page, anchor) for page, anchor in DOCS_REF.findall(text)]
        if f.suffix == ".md" and ROOT / "docs" in f.parents:
            refs += [(f, (f.parent / page).resolve(), anchor) for page, anchor in MD_LINK.findall(text)]
    assert len(refs) > 40, "expected the code to cite docs/ pages"
    bad = [f"{f.relative_to(ROOT)}: {page.relative_to(ROOT)}#{anchor}" for f, page, anchor in refs
           if not page.is_file() or (anchor and anchor not in heading_anchors(page))]
    assert not bad, "broken docs references:\n" + "\n".join(sorted(set(bad)))


# ----------------------------------------------------------------------------- one registry entry per method
def test_every_method_resolves_through_the_one_registry():
    """Each registry line names a package whose METHOD has that name and whose parts all resolve; a
    trained method's strategy is of the same method and builds and wraps modules through the registry
    (one place per method, not two that can drift), and its export map carries its name."""
    from selfdraft import methods
    from selfdraft.config import DrafterConfig
    from selfdraft.training.strategy import STRATEGIES, Strategy

    assert set(methods.names(trained=True)) >= {"dflash", "dspark", "eagle3", "mtp"}
    assert set(methods.names(trained=False)) >= {"none", "ngram"}
    for name in methods.names():
        m = methods.get(name)
        assert m.name == name and callable(m.part(m.drafter)), name
        if not m.trained:
            assert not (m.model or m.strategy or m.export), name
            continue
        assert issubclass(m.config, DrafterConfig) and m.config().method == name, name
        assert callable(m.part(m.model)), name
        strategy = STRATEGIES[name]
        assert isinstance(strategy, Strategy) and strategy.method == name, m.strategy
        assert type(strategy).build is Strategy.build and type(strategy).drafter is Strategy.drafter, name
        assert m.speculators().method == name
    assert set(STRATEGIES) == {n for n in methods.names(trained=True) if methods.get(n).strategy}


# ----------------------------------------------------------------------------- each default once


def gamma_literals(src: Path, pkg: str) -> list[str]:
    """Places that write γ's default as a number: a parameter or dataclass field named gamma with a
    literal default, or a typer option `--gamma` with a literal default."""
    out = []
    for mod, path in module_names(src, pkg).items():
        rel = path.relative_to(src / pkg).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            hit = False
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + node.args.kw_defaults
                hit = any(a.arg == "gamma" and isinstance(d, ast.Constant) for a, d in zip(args, defaults))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                hit = node.target.id == "gamma" and isinstance(node.value, ast.Constant)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Option":
                lits = [a.value for a in node.args if isinstance(a, ast.Constant)]
                hit = "--gamma" in lits and isinstance(node.args[0], ast.Constant)
            if hit:
                out.append(f"{rel}:{node.lineno}")
    return out


def test_gamma_default_is_written_once(tmp_path):
    """γ's default lives in config.DEFAULT_GAMMA; everything else reads it. Control: the walker finds
    each kind of literal default in a toy package."""
    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / "a.py").write_text("def f(x, gamma=7):\n    pass\nclass C:\n    gamma: int = 7\n"
                              "o = typer.Option(7, '--gamma')\nok = typer.Option(G, '--gamma')\n")
    assert sorted(gamma_literals(tmp_path, "toy")) == ["a.py:1", "a.py:4", "a.py:5"]
    found = gamma_literals(SRC, PKG)
    assert not found, f"read config.DEFAULT_GAMMA instead of writing γ's default: {found}"
