"""`scripts/gpu_check.py` as a command: it stands down on CPU, and its CPU smoke run (the same
code at tiny sizes, kernels interpreted) prints every row and passes.

Both run as subprocesses on the persistent compilation cache this process uses. The smoke
builds six tiny Programs (22 executables): about 4 min on the 2 shared cores from a cold
cache (18 s warm), hence `slow`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
ROWS = ("1 decode kernel", "1 prefill kernel", "1 GDN kernel", "2 decode", "2 verify",
        "3 prefill", "4 executables", "5 platform defaults", "6 MoE prefill", "wall")


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "NINFER_JAX_CACHE_DIR": jax.config.jax_compilation_cache_dir}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=SCRIPT.parents[1], check=False)


def test_without_a_gpu_it_says_so_and_exits_0():
    r = _run(timeout=120)
    assert r.returncode == 0, r.stderr
    assert "needs a GPU" in r.stdout
    assert "|" not in r.stdout  # no table: nothing was run


@pytest.mark.slow
def test_cpu_smoke_prints_every_row_and_passes():
    r = _run("--cpu_smoke", timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")][1:]
    checks = [line.split(" | ")[0].removeprefix("| ") for line in table]
    for row in ROWS:
        assert row in checks, (row, r.stdout)
    assert checks.count("1 decode kernel") == 3  # bf16, fp32, bf16 over int8 pages
    assert checks.count("1 prefill kernel") == 6  # a chunk and a verify window for each of those
    assert checks.count("1 GDN kernel") == 3  # decode, verify, prefill
    assert checks.count("1 quant matmul") == 4  # int8, int4, fp8, fp8 x fp8
    assert checks.count("4 executables") == 6  # every Program built
    status = [line.rstrip(" |").rsplit(" | ", 1)[1] for line in table]
    assert "FAIL" not in status, r.stdout
    kernel = [line for line in table
              if line.startswith(("| 1 decode kernel", "| 1 prefill", "| 1 GDN", "| 1 quant"))]
    assert all(line.endswith("| pass |") for line in kernel), r.stdout
