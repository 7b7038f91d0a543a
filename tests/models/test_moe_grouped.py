"""The MoE layer's expert paths: the GPU one (`experts_kernel`, the Pallas grouped matmul, here
interpreted), the TPU one (`experts_grouped`, XLA's ragged_dot) and the CPU one agree on the
MoE fixture's weights at every token count, with stacked layers indexed in place (`LayerOf`),
and the platform the step is lowered for picks the path: a CUDA lowering holds the two grouped
kernels and no ragged_dot or dense contraction over all experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6.layers import (
    LayerOf,
    experts_grouped,
    experts_kernel,
    experts_on_cpu,
    layer_params,
    moe,
)
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


def _kernel(ex, x, top_i, top_w):
    return jax.jit(lambda *a: experts_kernel(*a, interpret=True))(ex, x, top_i, top_w)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 64])  # 8 experts, top-2: gathered below 4 tokens
def test_grouped_experts_equal_the_cpu_path(n):
    cfg, p = _layer()
    x, top_i, top_w = _routing(cfg, n, seed=n)
    want = jax.jit(experts_on_cpu)(p["experts"], x, top_i, top_w)
    got = jax.jit(experts_grouped)(p["experts"], x, top_i, top_w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_kernel(p["experts"], x, top_i, top_w)),
                               np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_expert_no_token_chose_and_one_all_chose():
    cfg, p = _layer()
    n, k = 8, cfg.num_experts_per_tok
    x, _, _ = _routing(cfg, n, seed=1)
    top_i = jnp.tile(jnp.arange(k, dtype=jnp.int32), (n, 1))  # experts 0..k-1 take every token
    top_w = jnp.full((n, k), 1.0 / k, jnp.float32)
    want = jax.jit(experts_on_cpu)(p["experts"], x, top_i, top_w)
    for got in (jax.jit(experts_grouped)(p["experts"], x, top_i, top_w),
                _kernel(p["experts"], x, top_i, top_w)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_kernel_indexes_a_stacked_layer_in_place():
    """`layer_params` keeps the routed experts stacked (a `LayerOf` the kernel indexes) and
    slices the rest; the result is that layer's."""
    m = loaded("moe")
    stacked = m.params["linear"]
    last = stacked["input_norm"].shape[0] - 1
    p = layer_params(stacked, last)
    assert isinstance(p["mlp"]["experts"], LayerOf)
    assert p["mlp"]["router"].shape == stacked["mlp"]["router"].shape[1:]
    x, top_i, top_w = _routing(m.config, 6, seed=3)
    sliced = jax.tree.map(lambda a: a[last], stacked["mlp"]["experts"])
    want = jax.jit(experts_on_cpu)(sliced, x, top_i, top_w)
    got = _kernel(p["mlp"]["experts"], x, top_i, top_w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _lowered(platform: str, n: int, stacked: bool = False) -> str:
    m = loaded("moe")
    cfg = m.config
    params = m.params["linear"]
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    x = jax.ShapeDtypeStruct((n, cfg.hidden_size), jnp.float32)

    def run(p, x):
        layer = layer_params(p, 1) if stacked else jax.tree.map(lambda a: a[1], p)
        return moe(layer["mlp"], x, cfg)

    return jax.jit(run).trace(abstract, x).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("n", [2, 64])  # decode-sized and prefill-sized
def test_the_lowering_platform_picks_the_path(n):
    cfg, _ = _layer()
    dense = f"tensor<{n}x{cfg.num_experts}x{cfg.moe_intermediate_size}xf32>"  # [N, E, I]
    cuda, cpu = _lowered("cuda", n, stacked=True), _lowered("cpu", n)
    assert "grouped_swiglu" in cuda and "grouped_matmul" in cuda
    assert "ragged_dot" not in cuda and dense not in cuda
    # the stacked experts reach the kernels whole ([L, E, I, H]): no per-layer slice of them
    layers = loaded("moe").params["linear"]["mlp"]["experts"]["gate"].shape[0]
    whole = f"tensor<{layers}x{cfg.num_experts}x{cfg.moe_intermediate_size}x{cfg.hidden_size}"
    assert whole in cuda
    assert "ragged_dot" not in cpu and "grouped_matmul" not in cpu
    if n * cfg.num_experts_per_tok >= cfg.num_experts:
        assert dense in cpu  # XLA:CPU's fastest path is the dense one
