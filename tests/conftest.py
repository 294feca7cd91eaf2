"""Shared fixtures: a per-run cache, tiny random Llama targets (fast, float32) and the embedded target (slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from selfdraft.target import Target
from tests.helpers import tiny_llama  # noqa: F401  (tests that still import it from here)


@pytest.fixture(scope="package", autouse=True)  # tests/ is one package: once per run
def run_cache(tmp_path_factory) -> Path:
    """Tests never read or write the user's cache (converted targets, hardware profiles, GGUF exports):
    SELFDRAFT_CACHE points at a folder of this run for the whole run, so `selfdraft profile` in a test
    cannot change the profile the user's scheduler reads. The embedded target is converted at most once
    per run (~20 s), by the first test that needs it."""
    old = os.environ.get("SELFDRAFT_CACHE")
    path = tmp_path_factory.mktemp("selfdraft-cache")
    os.environ["SELFDRAFT_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("SELFDRAFT_CACHE", None)
    else:
        os.environ["SELFDRAFT_CACHE"] = old


@pytest.fixture(scope="package")
def embedded_dir(run_cache) -> Path:
    """The embedded target converted to a Hugging Face directory in this run's cache."""
    from selfdraft.target_loading import _embedded_dir

    return _embedded_dir()


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (thread sync costs more than their matmuls);
    the embedded 135M target uses both cores."""
    torch.set_num_threads(2 if "embedded_fp32" in request.fixturenames else 1)


@pytest.fixture
def tiny_target() -> Target:
    return Target(tiny_llama())


@pytest.fixture(scope="package")
def embedded_fp32(run_cache) -> Target:
    return Target.load(dtype="float32")
