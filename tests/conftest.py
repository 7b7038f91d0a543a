"""Test-wide set-up: fp32 CPU, persistent compilation cache in a temp dir, shared data path."""

from __future__ import annotations

import gc
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


@pytest.fixture(autouse=True, scope="module")
def _collect_after_module():
    """Frees each module's closed Engines and Programs before the next module starts. Their
    compiled executables hold thousands of memory mappings (about 2,700 for a demo Engine at
    max_concurrency 4), and Python's full collections are rare in a long run: a whole
    single-process run of the suite passed the kernel's limit (vm.max_map_count, 65,530) in
    the gateway tests and XLA aborted the process while loading an executable."""
    yield
    gc.collect()
