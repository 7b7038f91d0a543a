"""The Pallas prefill kernel (interpret mode) against the jnp reference and dense numpy, and its
lowering for CUDA.

Each case is a batch of rows with ragged cached lengths (none, inside a page, on a page
boundary, a chunk crossing pages, a near-full table) and ragged chunk lengths (full, one, none,
part). Every pool slot no row reads and every chunk padding row holds NaN, so any leak of
masked keys or values into an output is a mismatch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    paged_attention_prefill,
    paged_attention_prefill_pallas,
)
from tests.pallas_kernels.test_paged_attention import (
    NUM_KV_HEADS,
    PAGE_SIZE,
    PrefillCase,
    _rounded,
    _triton_custom_call_target,
    assert_close,
    dense_causal,
    prefill_args,
)

MAX_PAGES = 6


def _rows(tokens: int, page_size: int = PAGE_SIZE) -> list[tuple[int, int]]:
    """(prior_len, chunk_len) per row; the table holds MAX_PAGES * page_size positions."""
    room = MAX_PAGES * page_size - tokens
    rows = [(0, tokens), (0, 3), (5, tokens), (page_size, 5), (2 * page_size + 5, 1),
            (13, 0), (0, 0), (room, tokens)]
    return [(prior, min(chunk, tokens)) for prior, chunk in rows]


def make_batch(seed: int, *, tokens: int, group: int, head_dim: int, dtype,
               page_size: int = PAGE_SIZE) -> list[PrefillCase]:
    """One PrefillCase per row of `_rows(tokens)`, all on one shared, shuffled pool."""
    rng = np.random.default_rng(seed)
    rows = rng.permutation(_rows(tokens, page_size)).tolist()
    num_pages = len(rows) * MAX_PAGES + 3
    shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
    k, v = _rounded(rng.standard_normal(shape), dtype), _rounded(rng.standard_normal(shape), dtype)
    tables = rng.permutation(num_pages)[: len(rows) * MAX_PAGES].reshape(len(rows), MAX_PAGES)
    used = np.zeros((num_pages, page_size), bool)
    for row, (prior, _) in enumerate(rows):
        positions = np.arange(prior)
        used[tables[row, positions // page_size], positions % page_size] = True
        tables[row, -(-prior // page_size):] = rng.choice([-7, 0, num_pages + 11])
    k[~used], v[~used] = np.nan, np.nan
    cases = []
    for row, (prior, chunk) in enumerate(rows):
        own = (tokens, NUM_KV_HEADS, head_dim)
        ck, cv = _rounded(rng.standard_normal(own), dtype), _rounded(rng.standard_normal(own), dtype)
        ck[chunk:], cv[chunk:] = np.nan, np.nan
        q = _rounded(rng.standard_normal((tokens, NUM_KV_HEADS * group, head_dim)), dtype)
        cases.append(PrefillCase(q, k, v, tables[row].astype(np.int32), int(prior), ck, cv,
                                 int(chunk)))
    return cases


# tokens x group x head_dim x dtype x blocks: T not a multiple of block_c (20), group 3 and 6
# (row blocks end inside a token), one row block and several, two pages per step and four.
CONFIGS = [
    (8, 1, 64, jnp.float32, {"block_k": 16}),
    (20, 3, 64, jnp.float32, {"block_m": 16, "block_c": 16, "block_k": 16}),
    (16, 6, 128, jnp.float32, {"block_m": 32, "block_c": 16}),
    (4, 8, 64, jnp.float32, {"block_m": 16, "block_k": 32}),  # a verify window
    (20, 2, 128, jnp.bfloat16, {"block_m": 16, "block_c": 16}),
    (4, 6, 64, jnp.bfloat16, {"block_m": 16, "block_k": 16}),
]


@pytest.mark.parametrize("tokens, group, head_dim, dtype, blocks", CONFIGS)
def test_kernel_matches_reference_and_dense_numpy(tokens, group, head_dim, dtype, blocks):
    kernel = jax.jit(functools.partial(paged_attention_prefill_pallas, interpret=True, **blocks))
    reference = jax.jit(functools.partial(paged_attention_prefill, impl="reference"))
    for seed in (0, 1):
        cases = make_batch(seed, tokens=tokens, group=group, head_dim=head_dim, dtype=dtype)
        args = prefill_args(cases, dtype)
        out = kernel(*args)
        assert_close(out, np.asarray(reference(*args).astype(jnp.float32)), dtype)
        for row, case in enumerate(cases):
            assert_close(out[row], dense_causal(case), dtype)
            assert np.all(np.asarray(out[row, case.chunk_len:]) == 0), "padding rows are zero"


def test_key_blocks_smaller_than_a_page():
    """Pages of 64 positions read 16 at a time, rows crossing and ending inside pages."""
    kernel = jax.jit(functools.partial(paged_attention_prefill_pallas, interpret=True, block_k=16,
                                       block_m=16, block_c=16))
    cases = make_batch(4, tokens=12, group=2, head_dim=64, dtype=jnp.float32, page_size=64)
    out = kernel(*prefill_args(cases, jnp.float32))
    for row, case in enumerate(cases):
        assert_close(out[row], dense_causal(case), jnp.float32)


def test_dispatch_runs_the_interpreter_on_cpu_and_scales_like_the_reference():
    cases = make_batch(2, tokens=8, group=2, head_dim=64, dtype=jnp.float32)
    args = prefill_args(cases, jnp.float32)
    expected = paged_attention_prefill(*args, scale=0.3, impl="reference")
    assert_close(paged_attention_prefill(*args, scale=0.3, impl="pallas"), np.asarray(expected),
                 jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_lowers_to_triton_for_cuda(dtype):
    """Qwen3.6-like shapes (24 q / 4 kv heads x 256, page 16), a 48-token chunk, odd sizes."""
    s = jax.ShapeDtypeStruct
    batch, tokens, num_pages = 3, 48, 37
    args = (s((batch, tokens, 24, 256), dtype),
            PagedAttentionInputs(s((num_pages, 16, 4, 256), dtype),
                                 s((num_pages, 16, 4, 256), dtype),
                                 s((batch, 5), jnp.int32), s((batch,), jnp.int32),
                                 chunk_k=s((batch, tokens, 4, 256), dtype),
                                 chunk_v=s((batch, tokens, 4, 256), dtype),
                                 chunk_lens=s((batch,), jnp.int32)))
    prefill = jax.jit(functools.partial(paged_attention_prefill, impl="pallas"))
    text = prefill.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{_triton_custom_call_target()}") == 1
    cpu = prefill.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert _triton_custom_call_target() not in cpu


def _changed(field: str, change):
    """(q, inputs) -> the same with `change` applied to `field` ("q" or an inputs field)."""
    def apply(q, inputs):
        if field == "q":
            return change(q), inputs
        return q, dataclasses.replace(inputs, **{field: change(getattr(inputs, field))})
    return apply


@pytest.mark.parametrize(
    "change, kwargs, message",
    [
        (_changed("q", lambda x: x[:, :, :3]), {}, "q num_q_heads (3) must be a multiple"),
        (_changed("chunk_k", lambda x: x[:, :, :1]), {},
         "chunk_k must be [B, T, num_kv_heads, head_dim] = [8, 8, 2, 64]"),
        (_changed("chunk_v", lambda x: x[:, :4]), {}, "chunk_v must be [B, T, num_kv_heads"),
        (_changed("cached_lens", lambda x: x[:2]), {}, "cached_lens must be [B=8]"),
        (_changed("chunk_lens", lambda x: x.astype(jnp.float32)), {}, "chunk_lens must be int32"),
        (_changed("chunk_v", lambda x: None), {}, "prefill needs chunk_v, got None"),
        (_changed("q", lambda x: x), {"block_m": 8}, "block_m must be a power of two >= 16, got 8"),
        (_changed("q", lambda x: x), {"block_c": 24},
         "block_c must be a power of two >= 16, got 24"),
        (_changed("q", lambda x: x), {"block_k": 24}, "block_k must be a power of two"),
    ],
)
def test_bad_inputs_name_the_field(change, kwargs, message):
    args = change(*prefill_args(make_batch(0, tokens=8, group=2, head_dim=64,
                                           dtype=jnp.float32), jnp.float32))
    with pytest.raises(ValueError) as err:
        jax.jit(functools.partial(paged_attention_prefill_pallas, interpret=True,
                                  **kwargs)).trace(*args)
    assert message in str(err.value)
    if not kwargs:  # the reference checks the same contract
        with pytest.raises(ValueError, match=None) as ref_err:
            paged_attention_prefill(*args, impl="reference")
        assert message in str(ref_err.value)
