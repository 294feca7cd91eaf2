"""Tests never touch the user's cache: conftest's `run_cache` points SELFDRAFT_CACHE at a folder of this run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from platformdirs import user_cache_dir

from selfdraft.target_loading import cache_root


def test_the_cache_is_this_runs_own(run_cache):
    user = Path(user_cache_dir("selfdraft")).resolve()
    ours = cache_root().resolve()
    assert ours == run_cache.resolve() and os.environ["SELFDRAFT_CACHE"] == str(run_cache)
    assert ours != user and user not in ours.parents, f"tests would write the user's cache {user}"


def test_a_command_run_by_a_test_inherits_it(run_cache):
    res = subprocess.run([sys.executable, "-c", "from selfdraft.target_loading import cache_root; print(cache_root())"],
                         capture_output=True, text=True, check=True)
    assert Path(res.stdout.strip()).resolve() == run_cache.resolve()
