"""The prompts synthesized ones are compared against: evaluation sets (refused) and excluded datasets
(deduplicated against). Every user turn counts, not only the first."""

from __future__ import annotations

import json
from pathlib import Path

from selfdraft.training.records import DataError, iter_records
from selfdraft.training.sources import (
    BUNDLED_EVAL_DIR,
    SHAREGPT,
    SourceStats,
    read_hf_dataset,
    read_json_array,
    read_jsonl,
    sharegpt_path,
)


def prompt_files(path: Path) -> list[Path]:
    """A .jsonl / .json file, or every such file under a directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json") and p.is_file())
    if path.is_file():
        return [path]
    raise DataError(f"{path}: no such prompt file or directory")


def read_turns(path: Path) -> list[str]:
    """Every user turn of a prompt file (the shapes `data regenerate` reads)."""
    stats = SourceStats()
    convs = read_json_array(path, stats) if path.suffix == ".json" else read_jsonl(path, stats)
    return [t for turns in convs for t in turns if t.strip()]


def eval_prompts(extra: list[Path]) -> tuple[list[str], list[str]]:
    """(turns, file names) of the bundled benchmark prompts plus every prompt file under `extra`."""
    files = prompt_files(BUNDLED_EVAL_DIR) + [f for p in extra for f in prompt_files(p)]
    texts, labels = [], []
    for f in files:
        turns = read_turns(f)
        texts += turns
        labels += [f.name] * len(turns)
    return texts, labels


def excluded_turns(specs: list[str]) -> list[str]:
    """The user turns of every --exclude: dataset directories, campaign ledgers and prompt sources. A source
    a ledger names is read by name unless one of the dataset directories holds its records (a synthesized
    source has no name to read it by: its directory is the way to exclude it)."""
    paths = [Path(s).expanduser() for s in specs]
    records = [r for p in paths if p.is_dir() for r in iter_records(p)]
    held = {r["source"] for r in records}
    return _user_turns(records) + [t for s, p in zip(specs, paths) if not p.is_dir() for t in excluded_prompts(s, held)]


def _user_turns(records) -> list[str]:
    return [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]


def excluded_prompts(spec: str, held: set[str] = frozenset()) -> list[str]:
    """The user turns an --exclude names: a dataset directory's records, the sources a campaign ledger's
    keys name (their every prompt: a superset of what it trained on) except those in `held` (read from
    their directories), or a prompt source."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return _user_turns(iter_records(path))
    if path.suffix == ".json" and path.is_file():
        obj = json.loads(path.read_text())
        if isinstance(obj, dict) and "records" in obj:
            sources = sorted({k.rpartition(":")[0] for k in obj["records"]} - held)
            return [t for s in sources for t in _source_turns(s, ledger=path)]
    return _source_turns(spec)


def _source_turns(spec: str, ledger: Path | None = None) -> list[str]:
    stats = SourceStats()
    if spec == SHAREGPT:
        convs = read_json_array(sharegpt_path(), stats)
    elif spec.startswith("hf:"):
        convs = read_hf_dataset(spec, stats)
    elif Path(spec).expanduser().is_file():
        return read_turns(Path(spec).expanduser())
    elif ledger is not None:
        raise DataError(f"{ledger} names the source {spec!r}, whose prompts cannot be read here: pass its "
                        f"dataset directory or prompt file with --exclude instead")
    else:
        raise DataError(f"--exclude {spec!r}: not a dataset directory, a campaign ledger, `sharegpt`, hf:NAME "
                        f"or a prompt file")
    return [t for turns in convs for t in turns if t.strip()]
