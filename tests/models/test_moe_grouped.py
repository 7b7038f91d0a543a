"""The MoE layer's two expert paths: the grouped-GEMM one (`ragged_dot`, what accelerators
lower) equals the CPU one on the MoE fixture's weights, at every token count; the platform the
step is lowered for picks the path, and a CUDA lowering holds grouped GEMMs and no dense
contraction over all experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from ninfer_jax.models.qwen3_6.layers import experts_grouped, experts_on_cpu, moe
from tests.models.conftest import loaded


def _layer(name: str = "moe"):
    m = loaded(name)
    first = jax.tree.map(lambda a: a[0], m.params["linear"]["mlp"])  # the first GDN layer's
    return m.config, first


def _routing(cfg, n: int, seed: int):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((n, cfg.hidden_size)), jnp.float32)
    probs = jax.nn.softmax(jnp.asarray(r.standard_normal((n, cfg.num_experts)), jnp.float32))
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    return x, top_i, top_w / jnp.sum(top_w, axis=-1, keepdims=True)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 64])  # 8 experts, top-2: gathered below 4 tokens
def test_grouped_experts_equal_the_cpu_path(n):
    cfg, p = _layer()
    x, top_i, top_w = _routing(cfg, n, seed=n)
    want = jax.jit(experts_on_cpu)(p["experts"], x, top_i, top_w)
    got = jax.jit(experts_grouped)(p["experts"], x, top_i, top_w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_expert_no_token_chose_and_one_all_chose():
    cfg, p = _layer()
    n, k = 8, cfg.num_experts_per_tok
    x, _, _ = _routing(cfg, n, seed=1)
    top_i = jnp.tile(jnp.arange(k, dtype=jnp.int32), (n, 1))  # experts 0..k-1 take every token
    top_w = jnp.full((n, k), 1.0 / k, jnp.float32)
    want = jax.jit(experts_on_cpu)(p["experts"], x, top_i, top_w)
    got = jax.jit(experts_grouped)(p["experts"], x, top_i, top_w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _lowered(platform: str, n: int) -> str:
    cfg, p = _layer()
    args = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p),
            jax.ShapeDtypeStruct((n, cfg.hidden_size), jnp.float32))
    return export.export(jax.jit(lambda p, x: moe(p, x, cfg)), platforms=[platform])(
        *args).mlir_module()


@pytest.mark.parametrize("n", [2, 64])  # decode-sized and prefill-sized
def test_the_lowering_platform_picks_the_path(n):
    cfg, _ = _layer()
    dense = f"tensor<{n}x{cfg.num_experts}x{cfg.moe_intermediate_size}xf32>"  # [N, E, I]
    cuda, cpu = _lowered("cuda", n), _lowered("cpu", n)
    assert cuda.count('stablehlo.composite "chlo.ragged_dot"') == 3  # gate, up, down
    assert dense not in cuda
    assert "ragged_dot" not in cpu
    if n * cfg.num_experts_per_tok >= cfg.num_experts:
        assert dense in cpu  # XLA:CPU's fastest path is the dense one
