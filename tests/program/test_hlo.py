"""`program.hlo` on optimized HLO that XLA:CPU compiles here: what an argument's bytes read come
to through a scanned loop, a gather and a plain use, which slices are copies, the MoE
expert-by-token finder, the Triton kernels of a custom call; and `program.roofline`'s counts
against the weights' own schema."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ninfer_jax import quant
from ninfer_jax.models.qwen3_6.weights import param_shapes
from ninfer_jax.presets import PRESETS
from ninfer_jax.program import hlo, roofline

L, N = 4, 32


def _compiled(fn, *shapes) -> hlo.Module:
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return hlo.parse(jax.jit(fn).trace(*args).lower().compile().as_text())


def test_reads_through_a_scan_a_gather_and_a_plain_use():
    def f(w, table, ids, x):
        def body(h, i):
            return h @ w[i].T, None  # one layer of the stack an iteration

        h, _ = jax.lax.scan(body, x, jnp.arange(L))
        return h + table[ids].sum(0) + jnp.sum(x)

    module = _compiled(f, ((L, N, N), jnp.float32), ((100, N), jnp.float32),
                       ((3,), jnp.int32), ((2, N), jnp.float32))
    names = [name for name, _ in module.entry_params]
    reads = hlo.argument_reads(module)
    w, table = reads[names[0]], reads[names[1]]
    assert w.bytes == L * N * N * 4  # every layer once, over the loop's trip count
    assert w.copied == w.bytes  # XLA:CPU copies the slice before the dot (DESIGN §15)
    assert table.bytes == 3 * N * 4 and "gather" in table.how  # only the rows looked up
    assert reads[names[3]].bytes >= 2 * N * 4


def test_an_unrolled_loop_reads_each_weight_once_without_copies():
    def f(w0, w1, x):
        return (x @ w0.T) @ w1.T

    module = _compiled(f, ((N, N), jnp.float32), ((N, N), jnp.float32), ((1, N), jnp.float32))
    for name, _ in module.entry_params[:2]:
        read = hlo.argument_reads(module)[name]
        assert read.bytes == N * N * 4 and read.copied == 0


def test_expert_by_token_finds_a_dense_expansion_under_the_routed_scope_only():
    e, t, h = 16, 6, 8

    def f(w, x):
        router = jnp.einsum("th,eh->te", x, w[:, 0])  # [T, E]: outside the scope, by design
        with jax.named_scope("routed_experts"):
            dense = jnp.einsum("th,eih->tei", x, w)  # [T, E, I]: every expert on every token
        return router, dense

    module = _compiled(f, ((e, 4, h), jnp.float32), ((t, h), jnp.float32))
    found = hlo.expert_by_token(module, e, {t})
    assert found and all(f"{t},{e},4" in x or f"{e},{t}" in x for x in found), found
    assert hlo.expert_by_token(module, e, {t}, scope="elsewhere") == []


def test_triton_kernels_are_named_from_their_custom_calls():
    text = """HloModule m
ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %k = f32[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "grouped_swiglu", num_warps = 4 : i32}
}
"""
    module = hlo.parse(text)
    assert hlo.triton_kernels(module) == {"grouped_swiglu": 1}
    assert hlo.argument_reads(module, active_experts=0.25)["p"].bytes == 32 * 0.25


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("method", [None, "int4", "fp8"])
def test_roofline_weight_bytes_follow_the_schema(name, method):
    """A decode step of B rows reads the schema's weights (as `quant` holds them) but the MTP
    head's, B embedding rows, and of the routed experts min(E, B x k) of E."""
    cfg = PRESETS[name]
    shapes = param_shapes(cfg, cfg.mtp_num_layers)
    everything = quant.planned_bytes(shapes, method, "bfloat16")
    mtp = quant.planned_bytes({"mtp": shapes["mtp"]}, method, "bfloat16")
    embed = cfg.vocab_size * cfg.hidden_size * 2
    experts = 0
    if cfg.variant == "moe":
        experts = sum(quant.planned_bytes({k: v}, method, "bfloat16") for k, v in (
            ("linear", {"mlp": {"experts": shapes["linear"]["mlp"]["experts"]}}),
            ("attention", {"mlp": {"experts": shapes["attention"]["mlp"]["experts"]}})))
    for b in (1, 8, 64):
        share = 1.0 if cfg.variant == "dense" else roofline.active_experts(cfg, b) / cfg.num_experts
        want = everything - mtp - embed + b * embed / cfg.vocab_size - experts * (1 - share)
        assert roofline.weight_bytes(cfg, "bfloat16", method, b) == pytest.approx(want)
    d = roofline.decode_bytes(cfg, 8, 4096)
    assert d.kv == 8 * 4096 * cfg.num_attention_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert d.tokens_per_second() == pytest.approx(8 / (d.total / roofline.H200_BANDWIDTH))


def test_a_single_embedding_row_is_looked_up_as_a_gather():
    """`layers.embed_rows`: the rows of `table[ids]`; one id as a gather of two rows, which a
    tensor-parallel partitioner splits (a dynamic slice made it gather a vocabulary-split
    table whole on every device)."""
    import numpy as np

    from ninfer_jax.models.qwen3_6.layers import embed_rows

    table = jnp.arange(40.0).reshape(10, 4)
    for ids in (jnp.array([[7]]), jnp.array([3]), jnp.array([[1, 2], [9, 0]])):
        np.testing.assert_array_equal(embed_rows(table, ids), table[ids])
    text = jax.jit(embed_rows).trace(jax.ShapeDtypeStruct((10, 4), jnp.float32),
                                     jax.ShapeDtypeStruct((1, 1), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.gather" in text and "dynamic_slice" not in text
