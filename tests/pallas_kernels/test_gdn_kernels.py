"""The GDN Pallas kernels (interpret mode) against the model's jnp gated delta rule, and their
lowering for CUDA.

Inputs are what a GDN layer feeds them: l2-normalised q (scaled) and k, log-decays g < 0,
write strengths beta in (0, 1), fp32 state; rows end in padding tokens (g = beta = 0), which
must leave the state exactly as the last real token left it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6.gdn import _l2norm, chunked_delta_rule, recurrent_delta_rule
from pallas_kernels.gdn import gated_delta_chunked, gated_delta_recurrent, gated_delta_rule
from tests.pallas_kernels.test_paged_attention import _triton_custom_call_target

TOL = 2e-5  # fp32 state, a different order of the same sums


def make_inputs(seed: int, batch: int, tokens: int, heads: int, dk: int, dv: int,
                num_valid: list[int] | None = None):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q = _l2norm(normal(batch, tokens, heads, dk)) * dk**-0.5
    k = _l2norm(normal(batch, tokens, heads, dk))
    v = normal(batch, tokens, heads, dv)
    g = -jnp.abs(normal(batch, tokens, heads)) * 0.5
    beta = jax.nn.sigmoid(normal(batch, tokens, heads))
    if num_valid is not None:
        valid = (jnp.arange(tokens)[None, :] < jnp.asarray(num_valid)[:, None])[..., None]
        g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    state = normal(batch, heads, dk, dv)
    return q, k, v, g, beta, state


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tokens, keep_states, dk, dv, block_v", [
    (1, False, 128, 128, 32),  # decode at the real GDN head dims
    (1, True, 32, 64, 16),
    (4, False, 64, 32, 32),
    (6, True, 32, 64, 16),  # an MTP / DFlash verify window
])
def test_recurrent_kernel_matches_the_recurrent_rule(tokens, keep_states, dk, dv, block_v):
    args = make_inputs(tokens + dk, 3, tokens, 2, dk, dv, num_valid=[tokens, 1, 0])
    want_out, want_state = recurrent_delta_rule(*args, keep_states=keep_states)
    kernel = jax.jit(functools.partial(gated_delta_recurrent, keep_states=keep_states,
                                       block_v=block_v, interpret=True))
    out, state = kernel(*args)
    close(out, want_out)
    close(state, want_state)
    if not keep_states:  # the empty row's state is exactly what it was
        np.testing.assert_array_equal(np.asarray(state[2]), np.asarray(args[5][2]))


@pytest.mark.parametrize("tokens, chunk, num_valid, dk, dv, block_v", [
    (16, 16, [16, 16], 32, 32, 16),  # one whole chunk
    # a partial last chunk; the second row padded across a chunk boundary
    (40, 16, [40, 23], 32, 32, 16),
    (100, 64, [100, 1], 128, 64, 32),  # the model's default chunk, a one-token row
])
def test_chunked_kernel_matches_the_recurrent_and_chunked_rules(tokens, chunk, num_valid, dk,
                                                               dv, block_v):
    args = make_inputs(tokens, 2, tokens, 3, dk, dv, num_valid=num_valid)
    want_out, want_state = recurrent_delta_rule(*args)
    kernel = jax.jit(functools.partial(gated_delta_chunked, chunk_size=chunk, block_v=block_v,
                                       interpret=True))
    out, state = kernel(*args)
    close(out, want_out)
    close(state, want_state)
    jnp_out, jnp_state = chunked_delta_rule(*args, chunk_size=chunk)
    close(out, jnp_out)
    close(state, jnp_state)


@pytest.mark.parametrize("dk, dv", [(24, 24), (20, 40)])  # the tiny configs' head dims: padded
def test_dims_that_are_not_powers_of_two_give_the_same_results(dk, dv):
    args = make_inputs(dk, 2, 20, 2, dk, dv, num_valid=[20, 7])
    for tokens, kernel in ((20, gated_delta_chunked), (2, gated_delta_recurrent)):
        part = tuple(a[:, :tokens] for a in args[:5]) + (args[5],)
        want_out, want_state = recurrent_delta_rule(*part)
        out, state = kernel(*part, interpret=True)
        assert out.shape == want_out.shape and state.shape == want_state.shape
        close(out, want_out)
        close(state, want_state)


def test_the_entry_point_picks_the_kernel_and_interprets_on_cpu():
    args = make_inputs(9, 2, 20, 2, 32, 32)
    for tokens, keep in ((20, False), (1, False), (3, True)):
        part = tuple(a[:, :tokens] for a in args[:5]) + (args[5],)
        want = recurrent_delta_rule(*part, keep_states=keep)
        got = gated_delta_rule(*part, chunk_size=10, keep_states=keep)  # chunk rounded to 16
        close(got[0], want[0])
        close(got[1], want[1])


@pytest.mark.parametrize("kernel, dv, kwargs, message", [
    (gated_delta_recurrent, 48, {"block_v": 24}, "block_v must be a power of two >= 16, got 24"),
    (gated_delta_chunked, 32, {"chunk_size": 8}, "chunk_size must be a power of two >= 16, got 8"),
    (gated_delta_chunked, 48, {"block_v": 8}, "block_v must be a power of two >= 16, got 8"),
])
def test_kernel_constraints_are_explained(kernel, dv, kwargs, message):
    args = make_inputs(0, 1, 4, 1, 32, dv)
    with pytest.raises(ValueError) as err:
        kernel(*args, interpret=True, **kwargs)
    assert message in str(err.value)
    bad_state = args[:5] + (args[5][:, :, :16],)
    with pytest.raises(ValueError, match=r"state must be \[B, H, dk, dv\]"):
        kernel(*bad_state, interpret=True)


@pytest.mark.parametrize("tokens, keep_states", [(512, False), (1, False), (4, True)])
def test_kernels_lower_to_triton_for_cuda(tokens, keep_states):
    """At the 27B's GDN dims (48 value heads of 128 x 128)."""
    s = jax.ShapeDtypeStruct
    f32 = jnp.float32
    b, h, d = 2, 48, 128
    args = (s((b, tokens, h, d), f32), s((b, tokens, h, d), f32), s((b, tokens, h, d), f32),
            s((b, tokens, h), f32), s((b, tokens, h), f32), s((b, h, d, d), f32))
    rule = jax.jit(functools.partial(gated_delta_rule, chunk_size=64, keep_states=keep_states))
    text = rule.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{_triton_custom_call_target()}") == 1
    assert _triton_custom_call_target() not in rule.trace(*args).lower(
        lowering_platforms=("cpu",)).as_text()
