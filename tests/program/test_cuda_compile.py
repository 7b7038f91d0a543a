"""The GPU build compiled for sm_90 (an H200 target, no GPU): a tiny dense and a tiny MoE
Program and a dense one with a DFlash drafter, every executable, the kernels across the dtypes, head dims, GQA groups and page
sizes users run, and the scoring executables. Dev tier: it needs a venv with jax's CUDA plugin, whose python is
$NINFER_CUDA_PYTHON (`scripts/test_slow.sh` makes one); without it the tests are skipped."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.dev

WORKER = pathlib.Path(__file__).with_name("cuda_compile_worker.py")
CUDA_PYTHON = os.environ.get("NINFER_CUDA_PYTHON")


def _run(what: str) -> dict:
    if not CUDA_PYTHON or not pathlib.Path(CUDA_PYTHON).exists():
        pytest.skip("NINFER_CUDA_PYTHON names no python with jax's CUDA plugin "
                    "(scripts/test_slow.sh makes one)")
    done = subprocess.run([CUDA_PYTHON, str(WORKER), what], capture_output=True, text=True,
                          timeout=1800, cwd=WORKER.parents[2], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tiny_programs_compile_for_sm90_with_their_kernels():
    results = _run("programs")
    for name, rows in results.items():
        failed = [r for r in rows if not r["ok"]]
        assert not failed, (name, failed)
        steps = {r["key"]: r for r in rows}
        rounds = {"dense": ("decode[1][0]", "decode[2][0]", "decode[2][1]", "decode[1][0][2]",
                            "decode[2][0][2]", "decode[1][0][1]", "decode[2][0][1]"),
                  "dflash": ("decode[1][0]", "decode[2][1]", "decode[1][0][1]",
                             "decode[2][0][1]")}.get(name, ())
        for key in ("prefill[1]", "decode[1]", "decode[2]", *rounds):
            kernels = steps[key]["kernels"]
            assert any(k.startswith("paged_attention") for k in kernels), (name, key, kernels)
            assert any(k.startswith("gated_delta") for k in kernels), (name, key, kernels)
            if name.startswith("moe"):
                assert {"grouped_swiglu", "grouped_matmul"} <= set(kernels), (key, kernels)
                assert steps[key]["expert_by_token"] == [], (key, steps[key])


def test_kernels_fit_the_sm_at_every_dtype_head_dim_group_and_page_size():
    results = _run("kernels")
    failed = {case: why for case, why in results.items() if why != "ok"}
    assert not failed, failed
    assert len(results) == 2 * 24 + 2 + 4 + 8


def test_scoring_windows_and_shared_contexts_compile_for_sm90():
    """Packed windows (segments) and shared contexts, dense and MoE, fp32 and bf16."""
    results = _run("scoring")
    assert len(results) == 8
    failed = {case: r for case, r in results.items() if not r["ok"]}
    assert not failed, failed
    assert all(r["expert_by_token"] == [] for r in results.values()), results
