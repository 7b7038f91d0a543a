"""`scripts/train_dflash.py` is a function of its flags: two runs with the same seed write the
same bytes (the shipped drafter, `ninfer_jax/assets/demo_dflash`, is what the script writes with
its defaults), and the drafter it writes loads as the Engine loads one. Dev tier: it needs optax
(the dev extra) and about 1.5 min."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

import pytest

from ninfer_jax.loader import load_drafter

REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--sequences=48", "--valid_sequences=16", "--steps=12", "--eval_every=6"]


def _train(out: pathlib.Path, *flags: str) -> str:
    subprocess.run([sys.executable, str(REPO / "scripts" / "train_dflash.py"), f"--out={out}",
                    *SMALL, *flags], check=True, cwd=REPO, capture_output=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.dev
def test_two_runs_with_one_seed_write_the_same_drafter(tmp_path):
    first = _train(tmp_path / "a")
    assert _train(tmp_path / "b") == first
    assert _train(tmp_path / "c", "--seed=1") != first
    drafter = load_drafter(tmp_path / "a")
    assert drafter.config.block_size == 16 and drafter.params
