#!/usr/bin/env python3
"""Replace citations of the old design document ("DESIGN section N", "DESIGN N", "DESIGN sections
A and B", "DESIGN.md") with the docs/ page that now covers them. Idempotent: a second run changes
nothing. Edits only the citation text, line by line.

    python scripts/fix_design_refs.py           # rewrite the files, print each change
    python scripts/fix_design_refs.py --check   # print what would change; exit 1 if anything would

Files: tracked and untracked-but-not-ignored text files of the repository (git ls-files).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()

# Section of the old design document -> the docs/ page (and anchor) that covers it.
SECTIONS = {
    2: "docs/verification.md",
    3: "docs/architecture.md#feature-layers",
    4: "docs/methods/mtp.md",
    5: "docs/methods/eagle3.md",
    6: "docs/methods/dflash.md",
    7: "docs/methods/dspark.md",
    8: "docs/scheduler.md",
    10: "docs/architecture.md#the-target",
    11: "docs/data.md",
    12: "docs/architecture.md#checkpoints-and-export",
    13: "docs/architecture.md#request-flow",
}
FALLBACK = "docs/architecture.md"

# Sharper targets for particular places: (file path regex, line regex, section) -> page#anchor.
# The first matching rule wins; otherwise SECTIONS.
SPECIFIC = [
    (r"sampling\.py$", r"residual|reject", 2, "docs/verification.md#residual-distribution"),
    (r"(verify|drafters/base)\.py$", r"sibling", 2, "docs/verification.md#the-sibling-rule"),
    (r"config\.py$", r"processed", 2, "docs/verification.md#sampling-transforms"),
    (r"decode\.py$", r"τ", 2, "docs/verification.md#metrics"),
    (r"harness\.py$", r"[Mm]etric", 2, "docs/verification.md#metrics"),
    (r"BENCHMARKS\.md$", r"[Mm]etrics", 2, "docs/verification.md#metrics"),
    (r"BENCHMARKS\.md$", r"hf-generate|near-tie|bf16", 2, "docs/verification.md#greedy-verification"),
    (r"tree\.py$", r"", 5, "docs/verification.md#draft-trees"),
    (r"training/masks\.py$", r"", 5, "docs/methods/eagle3.md#training-time-test"),
    (r"training/masks\.py$", r"", 6, "docs/methods/dflash.md#training-on-many-anchors"),
    (r"training/data\.py$", r"", 5, "docs/data.md#draft-vocabulary"),
    (r"eagle3\.py$", r"[Tt]raining-time test|soft-CE|loss", 5, "docs/methods/eagle3.md#training-loss"),
    (r"mtp\.py$", r"[Cc]ross-entropy|loss", 4, "docs/methods/mtp.md#training-loss"),
    (r"dflash\.py$", r"cross-entropy|loss", 6, "docs/methods/dflash.md#training-loss"),
    (r"dflash\.py$", r"anchors|ONE backbone forward", 6, "docs/methods/dflash.md#training-on-many-anchors"),
    (r"drafters/layers\.py$", r"", 6, "docs/methods/dflash.md#kv-injection"),
    (r"dspark\.py$", r"w_ce|loss|L = ", 7, "docs/methods/dspark.md#training-loss"),
    (r"objectives\.py$", r"acceptance label|c\*", 7, "docs/methods/dspark.md#training-loss"),
    (r"calibrate\.py$", r"", 7, "docs/calibration.md"),
    (r"scheduler\.py$", r"Algorithm 1", 8, "docs/scheduler.md#algorithm-1"),
    (r"profile\.py$", r"", 8, "docs/scheduler.md#cost-table"),
    (r"objectives\.py$", r"", 11, "docs/training.md#feature-cache"),
    (r"(training/data\.py|data/reference/README\.md)$", r"", 11, "docs/data.md#why-regenerate"),
    (r"trainer\.py$", r"", 12, "docs/training.md#checkpoints-and-resuming"),
]

# Whole phrases, replaced before anything else (composite citations that read better as one page).
PHRASES = [
    (r"DESIGN section 2 and the data flow of section 13", "docs/architecture.md#one-round"),
    (r"DESIGN sections 2, 8,? (?:and )?13", "docs/architecture.md#batched-engine"),
    (r"DESIGN sections 6 and 7", "docs/methods/dflash.md, docs/methods/dspark.md"),
    (r"DESIGN sections 3 and 11", "docs/architecture.md#feature-layers, docs/training.md#feature-cache"),
    (r"DESIGN section 10 on an idle machine", "an idle machine (docs/architecture.md#the-target)"),
    (r"`(?:\.\./)?(?:shared/)?DESIGN\.md`", "`docs/` (start with `docs/architecture.md`)"),
    (r"(?:\.\./)?(?:shared/)?DESIGN\.md", "docs/architecture.md"),
]

CITATION = re.compile(r"\bDESIGN\s+(?:sections?\s+|§\s*)?(\d+(?:(?:\s*,\s*|\s+and\s+|,\s*and\s+)\d+)*)")


def target_for(path: str, line: str, section: int) -> str:
    for path_re, line_re, sec, ref in SPECIFIC:
        if sec == section and re.search(path_re, path) and re.search(line_re, line):
            return ref
    return SECTIONS.get(section, FALLBACK)


def fix_line(path: str, line: str) -> str:
    for pattern, ref in PHRASES:
        line = re.sub(pattern, ref, line)

    def sub(m: re.Match) -> str:
        refs = []
        for n in re.findall(r"\d+", m.group(1)):
            ref = target_for(path, line, int(n))
            if ref not in refs:
                refs.append(ref)
        return ", ".join(refs)

    return CITATION.sub(sub, line)


def repo_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    files = []
    for name in out.split("\0"):
        f = ROOT / name
        if name and f.is_file() and f.resolve() != SELF:
            files.append(f)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report; exit 1 if a file would change")
    args = ap.parse_args()
    changed = 0
    for f in repo_files():
        data = f.read_bytes()
        if b"\0" in data[:8192] or b"DESIGN" not in data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        rel = f.relative_to(ROOT).as_posix()
        lines = text.split("\n")
        new = [fix_line(rel, line) for line in lines]
        for i, (a, b) in enumerate(zip(lines, new), 1):
            if a != b:
                changed += 1
                print(f"{rel}:{i}: {a.strip()}\n    -> {b.strip()}")
        if new != lines and not args.check:
            f.write_text("\n".join(new), encoding="utf-8")
    print(f"{changed} line(s) {'would change' if args.check else 'changed'}", file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
