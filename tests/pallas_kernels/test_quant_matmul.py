"""The fused-dequantize matmul kernel (interpret mode) against its reference and the quantized
weights' own dequantize; its CUDA lowering, in the kernel and in a quantized Program's steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax import quant
from ninfer_jax.models.qwen3_6.layers import linear32
from ninfer_jax.models.qwen3_6.weights import param_shapes
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.program.aot import lower_all
from ninfer_jax.testing import tiny_dense
from pallas_kernels.quant_matmul import kernel_supports, quant_matmul, quant_matmul_reference
from tests.models.conftest import rel_err
from tests.pallas_kernels.test_paged_attention import _triton_custom_call_target
from tests.program.test_lowering import PCFG


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("m,n,k,group", [(1, 48, 256, 128), (5, 128, 128, 64), (33, 16, 96, 32)])
def test_kernel_equals_reference_and_dequantized_weights(method, m, n, k, group):
    rng = np.random.default_rng(m + n)
    w = quant.quantize_int(rng.normal(size=(n, k)).astype(np.float32), method, group)
    assert w.block == (1, group)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
    ref = quant_matmul_reference(x, w.q, w.scale, method=method, group=group)
    got = quant_matmul(x, w.q, w.scale, method=method, group=group, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ref, x @ w.dequantize().T, rtol=1e-5, atol=1e-4)


def test_bf16_activations_accumulate_in_fp32():
    rng = np.random.default_rng(3)
    w = quant.quantize_int(rng.normal(size=(64, 256)).astype(np.float32), "int4")
    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.bfloat16)
    got = quant_matmul(x, w.q, w.scale, method="int4", group=128, interpret=True)
    ref = quant_matmul_reference(x, w.q, w.scale, method="int4", group=128)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=0.3)  # the weight tile is rounded to bf16


def test_bad_shapes_are_refused_naming_them():
    w = quant.quantize_int(np.ones((48, 256), np.float32), "int4")
    x = jnp.ones((2, 256), jnp.float32)
    with pytest.raises(ValueError, match="int4 q must be"):
        quant_matmul(x, w.q[:, :64], w.scale, method="int4", group=128, interpret=True)
    with pytest.raises(ValueError, match="method must be"):
        quant_matmul(x, w.q, w.scale, method="int3", group=128, interpret=True)
    assert not kernel_supports(48, 96) and not kernel_supports(40, 128)
    with pytest.raises(ValueError, match="power-of-two group"):
        w96 = quant.quantize_int(np.ones((48, 192), np.float32), "int8", 96)
        quant_matmul(jnp.ones((1, 192)), w96.q, w96.scale, method="int8", group=96)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_linear_lowers_to_the_kernel_for_cuda_and_to_xla_for_cpu(method):
    w = quant.quantize_int(np.ones((256, 512), np.float32), method)
    x = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16)
    fn = jax.jit(linear32)
    cuda = fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count(f"custom_call @{_triton_custom_call_target()}") == 1
    assert f"quant_matmul_{method}" in cuda and "interpret" not in cuda.lower()
    cpu = fn.trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert _triton_custom_call_target() not in cpu


@functools.cache
def _lowered(platform: str) -> dict:
    cfg = tiny_dense()
    zeros = jax.tree.map(lambda s: np.zeros(s, np.float32), param_shapes(cfg),
                         is_leaf=lambda x: isinstance(x, tuple))
    return lower_all(cfg, PCFG, platform, params=quant.quantize_params(zeros, "int8"))


def test_a_quantized_program_lowers_its_projections_to_the_kernel_for_cuda():
    """tiny_dense: inputs of 64 or 128 give power-of-two groups (the kernel); 96 (the MLP's
    down, GDN's out) gives group 96, which stays an XLA dot; for CPU every one is XLA."""
    cuda, cpu = _lowered("cuda"), _lowered("cpu")
    for key in (StepKey(StepKind.PREFILL, 1), StepKey(StepKind.DECODE, 1)):
        assert cuda[key].count("quant_matmul_int8") > 0, key
        assert "quant_matmul" not in cpu[key], key


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_stacked_weight_is_read_in_place_at_its_layer(method):
    """`layer`: q and scale stacked [L, ...] (a scanned layer loop's buffers), the kernel reads
    one layer of them; `layers.layer_params` keeps quantized leaves stacked so `linear32` passes
    the stack (XLA would copy a slice before the kernel) and the CUDA lowering holds it whole."""
    from ninfer_jax.models.qwen3_6.layers import LayerOf, layer_params

    rng = np.random.default_rng(2)
    w = rng.normal(size=(3, 128, 256)).astype(np.float32)
    q = quant.fp8_blocks(w) if method == "fp8" else quant.quantize_int(w, method)
    x = jnp.asarray(rng.normal(size=(5, 256)).astype(np.float32))
    for layer in range(3):
        got = quant_matmul(x, q.q, q.scale, method=method, group=128,
                           layer=jnp.asarray([layer]), interpret=True)
        want = quant_matmul_reference(x, q.q[layer], q.scale[layer], method=method, group=128)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    params = layer_params({"w": q, "norm": np.ones((3, 256), np.float32)}, 1)
    assert isinstance(params["w"], LayerOf) and params["norm"].shape == (256,)
    np.testing.assert_allclose(linear32(x, params["w"]), x @ q[1].dequantize().T, rtol=1e-5,
                               atol=1e-4)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), q)
    cuda = jax.jit(lambda x, q: linear32(x, layer_params({"w": q}, 2)["w"])).trace(
        jax.ShapeDtypeStruct((4, 256), jnp.bfloat16), abstract).lower(
        lowering_platforms=("cuda",)).as_text()
    stored = str(q.q.dtype).replace("float8_e4m3fn", "f8E4M3FN").replace("int8", "i8").replace(
        "uint8", "ui8")
    whole = f"tensor<3x128x{q.q.shape[-1]}x{stored}>"
    calls = [line for line in cuda.splitlines() if "quant_matmul_" in line and "custom_call" in line]
    assert len(calls) == 1 and whole in calls[0]


@pytest.mark.parametrize("m", [1, 20])
def test_fp8_block_kernel_equals_reference_and_the_checkpoint_dequantize(m):
    rng = np.random.default_rng(m)
    w = quant.fp8_blocks(rng.normal(size=(256, 384)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(m, 384)).astype(np.float32))
    ref = quant_matmul_reference(x, w.q, w.scale, method="fp8", group=128)
    got = quant_matmul(x, w.q, w.scale, method="fp8", group=128, interpret=True)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ref, x @ w.dequantize().T, rtol=1e-5, atol=1e-4)
    assert not kernel_supports(200, 128, "fp8") and kernel_supports(256, 128, "fp8")
    cuda = jax.jit(linear32).trace(jax.ShapeDtypeStruct((m, 384), jnp.bfloat16), w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "quant_matmul_fp8" in cuda


def test_fp8_activations_kernel_equals_its_reference_and_lowers_for_cuda():
    """W8A8: activations quantized per row and 128-channel tile in the kernel, FP8 x FP8 dot."""
    rng = np.random.default_rng(7)
    w = quant.fp8_blocks(rng.normal(size=(128, 256)).astype(np.float32))
    x = rng.normal(size=(3, 256)).astype(np.float32)
    x[1, :128] = 0  # a zero tile: scale 0
    x = jnp.asarray(x, jnp.bfloat16)
    kw = {"method": "fp8", "group": 128, "fp8_activations": True}
    ref = quant_matmul_reference(x, w.q, w.scale, **kw)
    got = quant_matmul(x, w.q, w.scale, interpret=True, **kw)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    exact = quant_matmul_reference(x, w.q, w.scale, method="fp8", group=128)
    assert rel_err(ref, exact) < 0.05  # e4m3 activations
    fn = jax.jit(functools.partial(quant_matmul, **kw))
    cuda = fn.trace(x, w.q, w.scale).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count(f"custom_call @{_triton_custom_call_target()}") == 1
    with pytest.raises(ValueError, match="fp8_activations is for method 'fp8'"):
        quant_matmul(x, w.q, w.scale, method="int8", group=128, fp8_activations=True)
