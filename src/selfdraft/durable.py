"""Durable file replacement: write a private sibling, fsync it, rename it over the target, fsync the directory.

A rename alone is atomic but not durable: after a power loss the directory can hold the new name
with empty or partial contents (delayed allocation on ext4 and XFS) or still the old entry. The
data's fsync before the rename and the directory's after it make the new version survive a crash;
a reader sees either the old file or the new one, never a half-written one.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: str | Path, final: str | Path) -> None:
    """Make the finished file `tmp` the new `final`: fsync, rename, fsync the directory."""
    tmp, final = Path(tmp), Path(final)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def private_tmp(final: str | Path) -> Path:
    """A sibling of `final` that no other process writes (two writers never share a temp file)."""
    final = Path(final)
    return final.with_name(f".{final.name}.{os.getpid()}.tmp")


def write_text_durably(path: str | Path, text: str) -> None:
    tmp = private_tmp(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
