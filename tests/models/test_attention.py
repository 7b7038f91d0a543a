"""`_grouped_attention` (every jnp attention path: causal, contiguous, segmented, DFlash's)
against a per-query-head numpy reference: GQA groups, masks of any pattern, rows that see
nothing (zeros, not NaN) and masks that broadcast over queries."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6.attention import _grouped_attention


def _reference(q, k, v, mask):
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    mask = np.broadcast_to(mask, (b, t, k.shape[1]))
    out = np.zeros((b, t, hq, d))
    for i in range(b):
        for h in range(hq):
            scores = q[i, :, h].astype(np.float64) @ k[i, :, h // group].T * d**-0.5
            scores = np.where(mask[i], scores, -np.inf)
            for r in range(t):
                if mask[i, r].any():
                    p = np.exp(scores[r] - scores[r].max())
                    out[i, r, h] = (p / p.sum()) @ v[i, :, h // group]
    return out


@pytest.mark.parametrize("hq,hkv,t,s,query_mask", [
    (6, 2, 5, 7, True),  # groups of 3, a [B, T, S] mask
    (3, 1, 8, 8, True),  # one K/V head (the demo model's layout)
    (4, 4, 1, 9, True),  # no grouping, one query (decode)
    (8, 2, 4, 6, False),  # a [B, 1, S] mask shared by every query (DFlash's non-causal layers)
])
def test_grouped_attention_equals_each_query_head_alone(hq, hkv, t, s, query_mask):
    rng = np.random.default_rng(hq * 100 + t)
    b, d = 2, 16
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    mask = rng.random((b, t if query_mask else 1, s)) < 0.6
    mask[0, 0] = False  # a row that sees nothing
    got = np.asarray(jax.jit(_grouped_attention)(q, k, v, mask))
    assert got.shape == (b, t, hq, d) and np.isfinite(got).all()
    np.testing.assert_allclose(got, _reference(q, k, v, mask), atol=2e-6, rtol=1e-5)
    assert not got[0, 0].any()
