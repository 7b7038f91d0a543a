"""The executable cache (`program.executable_cache`): a second process loads every step a
Program compiled in the first and decodes the same tokens with them (pools still donated in
place), a damaged entry is dropped and rebuilt, an executable jax loaded from its own cache is
never stored, and the key follows what decides the executable.

Each run is its own process (`executable_cache_worker.py`) on a private cache directory."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from ninfer_jax.program import executable_cache
from ninfer_jax.program.steps import commit_step
from tests.conftest import REPO


def _run(cache: pathlib.Path, programs: int = 1) -> dict:
    env = {**os.environ, "NINFER_JAX_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "tests.program.executable_cache_worker",
                           str(programs)],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_step_a_damaged_entry_is_rebuilt(tmp_path):
    """One cache directory through three processes (jax's own keys name the directory, so a
    copy elsewhere would miss in jax's cache)."""
    cold = _run(tmp_path)
    entries = sorted((tmp_path / executable_cache.SUBDIR).glob("*.exe"))
    n = cold["executables"]
    assert cold["counts"] == {"loaded": 0, "stored": n, "dropped": 0}
    assert len(entries) == n >= 4  # prefill, commit, decode at B = 1 and 2

    warm = _run(tmp_path)  # every step loaded, the same tokens, pools still donated
    assert warm["counts"] == {"loaded": n, "stored": 0, "dropped": 0}
    assert warm["tokens"] == cold["tokens"]
    assert warm["donated_in_place"] and cold["donated_in_place"]

    entries[0].write_bytes(entries[0].read_bytes()[:100])  # cut short
    entries[1].write_bytes(b"not a pickle")
    damaged = _run(tmp_path)
    # both dropped and built again; jax's own cache held them, so XLA did not compile them in
    # that process and they are not stored (see the module's docstring)
    assert damaged["counts"] == {"loaded": n - 2, "stored": 0, "dropped": 2}
    assert damaged["tokens"] == cold["tokens"]
    assert not entries[0].exists() and not entries[1].exists()


@pytest.mark.slow  # ~45 s: two more processes; the damaged entries above are not stored either
def test_steps_jax_loaded_are_never_stored(tmp_path):
    """jax's cache warm, ours empty: the first Program's steps come from jax's cache, the
    second's from jax's in-memory cache of those; neither kind is stored."""
    cold = _run(tmp_path)
    shutil.rmtree(tmp_path / executable_cache.SUBDIR)
    jax_only = _run(tmp_path, programs=2)
    assert jax_only["counts"] == {"loaded": 0, "stored": 0, "dropped": 0}
    assert jax_only["tokens"] == cold["tokens"]


def test_the_key_follows_what_decides_the_executable():
    import jax
    import numpy as np

    from ninfer_jax.program.executables import abstract_args, bind
    from ninfer_jax.program.steps import CommitInputs

    def args(rows: int):
        return (abstract_args(CommitInputs(
            slots=np.zeros(rows, np.int32), tokens=np.zeros((rows, 1), np.int32),
            num=np.ones(rows, np.int32), count=np.zeros(rows, bool))),)

    def key(fn, a, donate=("pools",)):
        return executable_cache.key(fn, a, donate, None)

    @dataclasses.dataclass(frozen=True)
    class Static:
        width: int

    base = key(commit_step, args(2))
    assert base == key(commit_step, args(2))  # no addresses or times in it
    assert base != key(commit_step, args(3))  # shapes
    assert base != key(commit_step, args(2), donate=())  # donation
    bound = bind(commit_step, static=Static(1))
    assert key(bound, args(2)) == key(bind(commit_step, static=Static(1)), args(2))
    assert key(bound, args(2)) != key(bind(commit_step, static=Static(2)), args(2))
    assert key(bound, args(2)) != base
    with jax.default_matmul_precision("highest"):  # a jax setting that changes lowering
        assert key(commit_step, args(2)) != base
    scale = 2.0
    # what a closure or lambda captured is not in a name: such a step is never cached
    assert key(lambda pools, inputs: commit_step(pools, inputs), args(2)) is None
    assert key(bind(lambda pools, inputs: scale * inputs, static=Static(1)), args(2)) is None
