"""Test-wide set-up: fp32 CPU, persistent compilation cache in a temp dir, shared data path."""

from __future__ import annotations

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FIXTURES = REPO / "tests" / "fixtures"


def pytest_configure(config):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from ninfer_jax.compile_cache import enable_persistent_cache

    enable_persistent_cache()


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"../shared/data not found at {SHARED_DATA}")
    return SHARED_DATA
