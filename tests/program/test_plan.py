"""Memory plans (`ninfer plan`): the planned pools are exactly what a Program allocates, the
weights what the schema holds, and the published presets' plans come out for one and eight
H200s."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.presets import QWEN3_6_27B, QWEN3_6_35B_A3B
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.plan import GIB, memory_plan
from ninfer_jax.program.program import Program
from ninfer_jax.testing import tiny_dense
from tests.conftest import REPO


def test_the_plan_is_what_a_program_allocates():
    cfg = tiny_dense()
    pcfg = ProgramConfig(max_concurrency=2, page_size=8, num_pages=24, max_seq_len=64,
                         prefill_chunk=16, num_checkpoint_slots=3, speculative="mtp",
                         num_speculative_tokens=2)
    params = init_params(cfg, jax.random.key(0), num_mtp_layers=1)
    plan = memory_plan(cfg, pcfg, num_mtp_layers=1)
    prog = Program(cfg, params, pcfg)
    pools = sum(a.nbytes for a in jax.tree.leaves(prog.pools))
    prog.close()
    assert plan.total - plan.regions["weights"] == pools
    assert plan.regions["weights"] == sum(np.asarray(a).nbytes for a in jax.tree.leaves(params))
    assert plan.per_device == plan.regions and plan.fits


def _pcfg(**kw) -> ProgramConfig:
    mc, n = 8, 32768
    return ProgramConfig(max_concurrency=mc, max_seq_len=n, dtype="bfloat16",
                         attention_impl="reference", num_pages=2 * mc * n // 16,
                         num_checkpoint_slots=4 * mc, **kw)


@pytest.mark.parametrize("cfg,params_b", [(QWEN3_6_27B, (26.5, 28.5)),
                                          (QWEN3_6_35B_A3B, (34.0, 36.5))])
def test_preset_plans_on_one_and_eight_h200(cfg, params_b):
    one, eight = memory_plan(cfg, _pcfg()), memory_plan(cfg, _pcfg(), tensor_parallel=8)
    lo, hi = params_b
    assert lo * 2e9 < one.regions["weights"] < hi * 2e9  # bf16: 2 bytes a parameter
    kv = cfg.num_attention_layers * 2 * (2 * 8 * 32768 + 16) * cfg.num_kv_heads * cfg.head_dim * 2
    assert one.regions["kv_pages"] == kv
    assert one.fits and eight.fits and eight.device_total < one.device_total / 4
    assert eight.per_device["kv_pages"] == kv // min(8, cfg.num_kv_heads)


@pytest.mark.parametrize("cfg", [QWEN3_6_27B, QWEN3_6_35B_A3B])
def test_int8_pages_hold_about_twice_the_tokens_of_bf16_pages(cfg):
    """kv_dtype="int8": int8 K and V plus a float32 scale per position and kv head for each,
    so a page holds D / (D / 2 + 4) times the bf16 page's tokens per GB (1.97 at D = 256)."""
    bf16, int8 = memory_plan(cfg, _pcfg()), memory_plan(cfg, _pcfg(kv_dtype="int8"))
    d, positions = cfg.head_dim, 2 * 8 * 32768 + 16
    per_position = cfg.num_attention_layers * cfg.num_kv_heads * 2  # K and V
    assert bf16.regions["kv_pages"] == positions * per_position * d * 2
    assert int8.regions["kv_pages"] == positions * per_position * (d + 4)
    assert int8.page_bytes == 16 * per_position * (d + 4)
    assert int8.pages_per_gb / bf16.pages_per_gb == pytest.approx(2 * d / (d + 4))
    assert {k: v for k, v in int8.regions.items() if k != "kv_pages"} == {
        k: v for k, v in bf16.regions.items() if k != "kv_pages"}  # nothing else changes
    eight = memory_plan(cfg, _pcfg(kv_dtype="int8"), tensor_parallel=8)
    assert eight.device_page_bytes == int8.page_bytes // min(8, cfg.num_kv_heads)


def test_ninfer_plan_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "ninfer_jax.gateway.cli", "plan",
                          "--model_preset=qwen3_6_27b", "--max_seq_len=32768",
                          "--max_concurrency=8", "--tensor_parallel=8"],
                         capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "qwen3_6_27b: bfloat16, max_seq_len 32768, max_concurrency 8" in out.stdout
    assert "on 8 device(s) of 141 GB" in out.stdout and "fits" in out.stdout
    weights = memory_plan(QWEN3_6_27B, _pcfg()).regions["weights"]
    assert f"{weights / GIB:.2f}" in out.stdout
    # 16 layers x 16 positions x 1 of 4 kv heads x (K, V) x 256 x 2 bytes
    assert "K/V page (bfloat16): 262,144 bytes a device" in out.stdout
