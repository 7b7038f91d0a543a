"""Paged attention: kernel (interpret mode) vs jnp reference, reference vs dense numpy, lowering.

Every pool slot that no valid position reads is filled with NaN, so any leak of masked keys,
values or stale pages into an output shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    paged_attention_decode,
    paged_attention_decode_pallas,
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
)

TOLERANCES = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # atol and rtol, by dtype
SEEDS = (0, 1, 2)
PAGE_SIZE = 8
MAX_PAGES = 7  # not a multiple of 2 or 4: the kernel pads the table to whole loop steps
NUM_KV_HEADS = 2
# Ragged rows: empty, one token, exactly one page, many pages with a partial last page, a full
# table. Each seed shuffles their order.
DECODE_LENS = (0, 1, PAGE_SIZE, 5 * PAGE_SIZE + 3, MAX_PAGES * PAGE_SIZE)


def _triton_custom_call_target() -> str:
    # jax's Triton lowering (jax/_src/pallas/triton/pallas_call_registration.py) emits this
    # target up to jaxlib 0.10.2 and "triton_kernel_call_ffi" after it.
    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:3])
    return "__gpu$xla.gpu.triton" if version <= (0, 10, 2) else "triton_kernel_call_ffi"


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    q: np.ndarray  # [B, H_q, D] float32 values (already rounded to the test dtype)
    k_pages: np.ndarray  # [P, page_size, H_kv, D], NaN where no valid position reads
    v_pages: np.ndarray  # [P, page_size, H_kv, D]
    page_tables: np.ndarray  # [B, max_pages] int32, garbage past each row's last page
    lengths: np.ndarray  # [B] int32

    def device_args(self, dtype) -> tuple[jax.Array, PagedAttentionInputs]:
        """(q, inputs) for the decode functions."""
        return (
            jnp.asarray(self.q, dtype),
            PagedAttentionInputs(
                jnp.asarray(self.k_pages, dtype),
                jnp.asarray(self.v_pages, dtype),
                jnp.asarray(self.page_tables),
                jnp.asarray(self.lengths),
            ),
        )


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    return np.array(jnp.asarray(x, dtype).astype(jnp.float32))


def make_decode_case(seed: int, *, group: int, head_dim: int, dtype,
                     page_size: int = PAGE_SIZE) -> DecodeCase:
    rng = np.random.default_rng(seed)
    lens = [length // PAGE_SIZE * page_size + length % PAGE_SIZE for length in DECODE_LENS]
    lengths = np.asarray(rng.permutation(lens), np.int32)
    batch = len(lengths)
    num_pages = batch * MAX_PAGES + 3
    pool_shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
    k_pages = _rounded(rng.standard_normal(pool_shape), dtype)
    v_pages = _rounded(rng.standard_normal(pool_shape), dtype)
    page_tables = rng.permutation(num_pages)[: batch * MAX_PAGES].reshape(batch, MAX_PAGES)
    used = np.zeros((num_pages, page_size), bool)
    for row, length in enumerate(lengths):
        for pos in range(length):
            used[page_tables[row, pos // page_size], pos % page_size] = True
        num_row_pages = -(-length // page_size)
        page_tables[row, num_row_pages:] = rng.choice([-7, 0, num_pages + 11])
    k_pages[~used] = np.nan
    v_pages[~used] = np.nan
    q = _rounded(rng.standard_normal((batch, NUM_KV_HEADS * group, head_dim)), dtype)
    return DecodeCase(q, k_pages, v_pages, page_tables.astype(np.int32), lengths)


def dense_decode(case: DecodeCase) -> np.ndarray:
    """Naive float64 attention of each row over its first `length` positions -> `[B, H_q, D]`."""
    batch, num_q_heads, head_dim = case.q.shape
    group = num_q_heads // NUM_KV_HEADS
    page_size = case.k_pages.shape[1]
    out = np.zeros((batch, num_q_heads, head_dim))
    for row, length in enumerate(case.lengths):
        positions = np.arange(length)
        pages = case.page_tables[row, positions // page_size]
        keys = case.k_pages[pages, positions % page_size].astype(np.float64)  # [L, H_kv, D]
        values = case.v_pages[pages, positions % page_size].astype(np.float64)
        for head in range(num_q_heads if length else 0):
            kv = head // group
            logits = keys[:, kv] @ case.q[row, head].astype(np.float64) / np.sqrt(head_dim)
            weights = np.exp(logits - logits.max())
            out[row, head] = weights @ values[:, kv] / weights.sum()
    return out


def assert_close(actual: jax.Array, expected: np.ndarray, dtype) -> None:
    assert actual.dtype == dtype
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(actual.astype(jnp.float32)), expected, atol=tol, rtol=tol)


# Group sizes x dtypes, each seeing head_dim 64 and 128 and several block_k (keys per step:
# 2 or 4 pages of PAGE_SIZE; None: the target's choice).
KERNEL_CONFIGS = [
    (1, 64, jnp.float32, 16),
    (2, 128, jnp.float32, 32),
    (4, 64, jnp.float32, None),
    (8, 128, jnp.float32, 16),
    (1, 128, jnp.bfloat16, 16),
    (2, 64, jnp.bfloat16, None),
    (4, 128, jnp.bfloat16, 32),
    (8, 64, jnp.bfloat16, 16),
]


@pytest.mark.parametrize("group, head_dim, dtype, block_k", KERNEL_CONFIGS)
def test_kernel_matches_reference(group, head_dim, dtype, block_k):
    kernel = jax.jit(functools.partial(paged_attention_decode_pallas, block_k=block_k,
                                       interpret=True))
    reference = jax.jit(paged_attention_decode_reference)
    for seed in SEEDS:
        case = make_decode_case(seed, group=group, head_dim=head_dim, dtype=dtype)
        args = case.device_args(dtype)
        out = kernel(*args)
        assert_close(out, np.asarray(reference(*args).astype(jnp.float32)), dtype)
        assert np.all(np.asarray(out)[case.lengths == 0] == 0), "length-0 rows must be zero"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_k", [16, 32])
def test_key_blocks_smaller_than_a_page(block_k, dtype):
    """Pages of 64 positions read 16 or 32 at a time (the tiles fp32 at head_dim 256 fit)."""
    kernel = jax.jit(functools.partial(paged_attention_decode_pallas, block_k=block_k,
                                       interpret=True))
    case = make_decode_case(5, group=4, head_dim=64, dtype=dtype, page_size=64)
    out = kernel(*case.device_args(dtype))
    assert_close(out, dense_decode(case), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 128), (8, 64)])
def test_reference_matches_dense_numpy(group, head_dim, dtype):
    reference = jax.jit(paged_attention_decode_reference)
    for seed in SEEDS:
        case = make_decode_case(seed, group=group, head_dim=head_dim, dtype=dtype)
        assert_close(reference(*case.device_args(dtype)), dense_decode(case), dtype)


def test_explicit_scale_is_used_by_both_paths():
    case = make_decode_case(3, group=2, head_dim=64, dtype=jnp.float32)
    args = case.device_args(jnp.float32)
    scaled_q = (args[0] * 0.3,) + args[1:]
    expected = paged_attention_decode_reference(*scaled_q, scale=1.0)
    for impl in ("reference", "pallas"):
        out = paged_attention_decode(*args, scale=0.3, impl=impl, block_k=16)
        assert_close(out, np.asarray(expected), jnp.float32)


def test_dispatch_defaults_to_interpret_on_cpu():
    case = make_decode_case(4, group=2, head_dim=64, dtype=jnp.float32)
    args = case.device_args(jnp.float32)
    out = paged_attention_decode(*args, impl="pallas", block_k=16)
    assert_close(out, dense_decode(case), jnp.float32)


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    q: np.ndarray  # [T, H_q, D]
    k_pages: np.ndarray  # [P, page_size, H_kv, D], NaN outside the cached positions
    v_pages: np.ndarray  # [P, page_size, H_kv, D]
    page_table: np.ndarray  # [max_pages] int32
    prior_len: int
    chunk_k: np.ndarray  # [T, H_kv, D], NaN in padding rows
    chunk_v: np.ndarray  # [T, H_kv, D]
    chunk_len: int


def prefill_args(cases: list[PrefillCase], dtype=jnp.float32
                 ) -> tuple[jax.Array, PagedAttentionInputs]:
    """(q, inputs) for the prefill functions: one batch row per case, all on the first case's
    pool."""
    return (jnp.asarray(np.stack([c.q for c in cases]), dtype),
            PagedAttentionInputs(
                jnp.asarray(cases[0].k_pages, dtype), jnp.asarray(cases[0].v_pages, dtype),
                jnp.asarray(np.stack([c.page_table for c in cases])),
                jnp.asarray([c.prior_len for c in cases], jnp.int32),
                chunk_k=jnp.asarray(np.stack([c.chunk_k for c in cases]), dtype),
                chunk_v=jnp.asarray(np.stack([c.chunk_v for c in cases]), dtype),
                chunk_lens=jnp.asarray([c.chunk_len for c in cases], jnp.int32)))


def make_prefill_case(seed: int, prior_len: int, chunk_len: int, num_tokens: int = 8):
    rng = np.random.default_rng(seed)
    group, head_dim, max_pages = 2, 64, 4
    num_pages = max_pages + 2
    pool_shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, head_dim)
    k_pages = rng.standard_normal(pool_shape)
    v_pages = rng.standard_normal(pool_shape)
    page_table = rng.permutation(num_pages)[:max_pages].astype(np.int32)
    used = np.zeros((num_pages, PAGE_SIZE), bool)
    positions = np.arange(prior_len)
    used[page_table[positions // PAGE_SIZE], positions % PAGE_SIZE] = True
    k_pages[~used] = np.nan
    v_pages[~used] = np.nan
    chunk_shape = (num_tokens, NUM_KV_HEADS, head_dim)
    chunk_k, chunk_v = rng.standard_normal(chunk_shape), rng.standard_normal(chunk_shape)
    chunk_k[chunk_len:] = np.nan
    chunk_v[chunk_len:] = np.nan
    q = rng.standard_normal((num_tokens, NUM_KV_HEADS * group, head_dim))
    return PrefillCase(q, k_pages, v_pages, page_table, prior_len, chunk_k, chunk_v, chunk_len)


def dense_causal(case: PrefillCase) -> np.ndarray:
    """Naive causal attention over the concatenated sequence `[cached..., chunk...]`.

    Returns `[T, H_q, D]` with zero padding rows.
    """
    positions = np.arange(case.prior_len)
    page_size = case.k_pages.shape[1]
    pages, offsets = case.page_table[positions // page_size], positions % page_size
    seq_k = np.concatenate([case.k_pages[pages, offsets], case.chunk_k[: case.chunk_len]])
    seq_v = np.concatenate([case.v_pages[pages, offsets], case.chunk_v[: case.chunk_len]])
    _, num_q_heads, head_dim = case.q.shape
    group = num_q_heads // NUM_KV_HEADS
    out = np.zeros_like(case.q)
    for i in range(case.chunk_len):
        visible = case.prior_len + i + 1
        for head in range(num_q_heads):
            kv = head // group
            logits = seq_k[:visible, kv] @ case.q[i, head] / np.sqrt(head_dim)
            weights = np.exp(logits - logits.max())
            out[i, head] = weights @ seq_v[:visible, kv] / weights.sum()
    return out


@pytest.mark.parametrize(
    "prior_len, chunk_len",
    [(0, 8), (0, 3), (5, 8), (PAGE_SIZE, 5), (2 * PAGE_SIZE + 5, 1), (13, 0), (0, 0)],
)
def test_prefill_reference_matches_dense_causal(prior_len, chunk_len):
    prefill = jax.jit(paged_attention_prefill_reference)
    for seed in SEEDS:
        case = make_prefill_case(seed, prior_len, chunk_len)
        out = prefill(*prefill_args([case]))[0]
        assert_close(out, dense_causal(case), jnp.float32)
        assert np.all(np.asarray(out)[chunk_len:] == 0), "padding rows must be exactly zero"


def test_one_token_prefill_equals_decode():
    """A one-token chunk after `prior_len` cached tokens is a decode step of length prior_len+1."""
    prior_len = 11
    case = make_prefill_case(5, prior_len=prior_len, chunk_len=1, num_tokens=1)
    q, chunks = prefill_args([case])
    prefill_out = paged_attention_prefill_reference(q, chunks)  # [1, 1, H_q, D]
    page, offset = case.page_table[prior_len // PAGE_SIZE], prior_len % PAGE_SIZE
    pages = PagedAttentionInputs(
        chunks.k_pages.at[page, offset].set(chunks.chunk_k[0, 0]),
        chunks.v_pages.at[page, offset].set(chunks.chunk_v[0, 0]),
        chunks.page_tables, jnp.asarray([prior_len + 1], jnp.int32))
    decode_out = paged_attention_decode_reference(q[:, 0], pages)
    assert_close(prefill_out[:, 0], np.asarray(decode_out), jnp.float32)


def _lowering_args(dtype=jnp.bfloat16) -> tuple[jax.ShapeDtypeStruct, PagedAttentionInputs]:
    """Qwen3.6-like decode shapes (16 q / 2 kv heads x 256) with odd batch, pool and table sizes:
    (q, inputs) of shapes."""
    return _decode_shapes(dtype)


def _decode_shapes(dtype=jnp.float32, **overrides
                   ) -> tuple[jax.ShapeDtypeStruct, PagedAttentionInputs]:
    """(q, inputs) of `_lowering_args`' shapes, with `overrides` (a field or "q": (shape,
    dtype))."""
    batch, num_pages, page_size, max_pages = 3, 37, 16, 5
    shapes = {
        "q": ((batch, 16, 256), dtype),
        "k_pages": ((num_pages, page_size, 2, 256), dtype),
        "v_pages": ((num_pages, page_size, 2, 256), dtype),
        "page_tables": ((batch, max_pages), jnp.int32),
        "cached_lens": ((batch,), jnp.int32),
        **overrides,
    }
    shapes = {name: jax.ShapeDtypeStruct(*spec) for name, spec in shapes.items()}
    return shapes.pop("q"), PagedAttentionInputs(**shapes)


@pytest.mark.parametrize("interpret", [False, None])  # None: the lowering platform decides
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_lowers_to_triton_for_cuda(dtype, interpret):
    decode = functools.partial(paged_attention_decode, impl="pallas", interpret=interpret)
    lowered = jax.jit(decode).trace(*_lowering_args(dtype)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert f"custom_call @{_triton_custom_call_target()}" in text
    assert "mosaic_gpu" not in text
    if interpret is None:  # the same call lowered for CPU runs the interpreter
        cpu = jax.jit(decode).trace(*_lowering_args(dtype)).lower(lowering_platforms=("cpu",))
        assert _triton_custom_call_target() not in cpu.as_text()


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"q": ((3, 256), jnp.float32)}, "q must be [B, num_q_heads, head_dim=256]"),
        ({"q": ((3, 15, 256), jnp.float32)}, "q num_q_heads (15) must be a multiple"),
        ({"q": ((3, 16, 128), jnp.float32)}, "q head_dim must equal the pool's head_dim 256"),
        ({"v_pages": ((37, 16, 2, 128), jnp.float32)}, "v_pages must have k_pages' shape"),
        ({"page_tables": ((4, 5), jnp.int32)}, "page_tables must be [B=3, max_pages_per_seq]"),
        ({"page_tables": ((3, 5), jnp.float32)}, "page_tables must be int32"),
        ({"cached_lens": ((3, 1), jnp.int32)}, "cached_lens must be [B=3]"),
        ({"chunk_lens": ((3,), jnp.int32)}, "decode takes no chunk, got chunk_lens"),
    ],
)
def test_bad_decode_inputs_name_the_field(impl, overrides, message):
    decode = functools.partial(paged_attention_decode, impl=impl, interpret=True)
    with pytest.raises(ValueError) as err:
        jax.jit(decode).trace(*_decode_shapes(**overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, kwargs, message",
    [
        (
            {
                "q": ((3, 16, 48), jnp.float32),
                "k_pages": ((37, 16, 2, 48), jnp.float32),
                "v_pages": ((37, 16, 2, 48), jnp.float32),
            },
            {},
            "head_dim must be a power of two",
        ),
        (
            {
                "k_pages": ((37, 12, 2, 256), jnp.float32),
                "v_pages": ((37, 12, 2, 256), jnp.float32),
            },
            {},
            "page_size must be a power of two",
        ),
        ({}, {"block_k": 24}, "block_k must be a power of two >= 16"),
        ({}, {"block_k": 8}, "block_k must be a power of two >= 16"),
        ({}, {"impl": "flash"}, "impl must be one of"),
    ],
)
def test_kernel_only_constraints_are_explained(overrides, kwargs, message):
    decode = functools.partial(paged_attention_decode, **{"impl": "pallas", **kwargs})
    with pytest.raises(ValueError) as err:
        jax.jit(decode).trace(*_decode_shapes(**overrides))
    assert message in str(err.value)


def test_bad_prefill_inputs_name_the_field():
    q, chunks = prefill_args([make_prefill_case(0, prior_len=3, chunk_len=2)])
    one_head = dataclasses.replace(chunks, chunk_k=chunks.chunk_k[:, :, :1])
    with pytest.raises(ValueError, match=r"chunk_k must be \[B, T, num_kv_heads, head_dim\]"):
        paged_attention_prefill_reference(q, one_head)
    with pytest.raises(ValueError, match="prefill needs chunk_lens, got None"):
        paged_attention_prefill_reference(q, dataclasses.replace(chunks, chunk_lens=None))
