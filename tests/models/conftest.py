"""Fixtures shared by the model tests: the transformers reference checkpoints."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from ninfer_jax import load_model
from tests.conftest import FIXTURES

NAMES = ("dense", "moe", "dense_vl")


@functools.lru_cache(maxsize=None)
def loaded(name: str, dtype: str = "float32"):
    return load_model(FIXTURES / name, dtype=dtype)


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as f:
        return dict(f)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(params=["dense", "moe"])
def family_model(request):
    return loaded(request.param)


jit_static_cfg = functools.partial(jax.jit, static_argnums=1)
