"""Test-wide set-up: fp32 CPU, persistent compilation cache in a temp dir, shared data path."""

from __future__ import annotations

import gc
import os
import pathlib
import sys

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
def _release_after_module():
    """Frees what a test module built before the next one starts: jax's jit caches, the
    `functools` caches of every test module (the Programs, Engines and scoring cores they
    keep; a later module that wants one builds it again, from the persistent compilation
    cache) and the garbage. A loaded XLA:CPU executable holds about 3 memory mappings per
    kernel (a demo Engine at max_concurrency 4 about 2,700), and a whole single-process run
    that kept them all passed the kernel's limit (vm.max_map_count, 65,530): XLA aborted the
    process while loading an executable in the scoring tests."""
    yield
    if "jax" in sys.modules:  # the executables of every jit cache (models, kernels, sampling)
        sys.modules["jax"].clear_caches()
    for name, module in list(sys.modules.items()):
        if name == "tests" or name.startswith("tests."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and \
                        hasattr(value, "cache_info"):
                    value.cache_clear()
    gc.collect()
