"""The MTP head's draft logits equal transformers' generic `MtpModel` on the `dense_vl` fixture.

The reference (`mtp_reference.npz`, `scripts/make_mtp_reference.py`) is transformers' own MTP
module run on the checkpoint's `mtp.*` weights over (h_t, tok_{t+1}) at every position t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6 import CausalKV, ContiguousKV
from ninfer_jax.models.qwen3_6.gdn import GDNState
from ninfer_jax.models.qwen3_6.model import step
from ninfer_jax.models.qwen3_6.mtp import mtp_step
from tests.conftest import FIXTURES
from tests.models.conftest import loaded

ATOL = 1e-4  # fp32


@functools.cache
def _reference() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "dense_vl" / "mtp_reference.npz") as f:
        return dict(f)


@functools.partial(jax.jit, static_argnums=1)
def _hidden(params, cfg, token_ids):
    b = token_ids.shape[0]
    return step(params, cfg, token_ids, jnp.zeros((b,), jnp.int32),
                GDNState.zeros(cfg, b, params["embed"].dtype), CausalKV()).hidden


def _ours():
    model = loaded("dense_vl")
    ids = jnp.asarray(_reference()["token_ids"])
    return model, ids, _hidden(model.params, model.config, ids)


def test_main_hidden_state_matches_transformers_final_normed_hidden():
    _, _, hidden = _ours()
    np.testing.assert_allclose(hidden, _reference()["hidden"], rtol=0, atol=ATOL)


def test_draft_logits_of_one_full_call_match_transformers_mtp_model():
    model, ids, hidden = _ours()
    want = _reference()["draft_logits"]
    assert want.shape == (ids.shape[0], ids.shape[1] - 1, model.config.vocab_size)
    assert np.abs(want).max() > 1.0  # a tolerance of 1e-4 on logits this large is meaningful
    got, _ = jax.jit(mtp_step, static_argnums=1)(
        model.params, model.config, hidden[:, :-1], ids[:, 1:],
        jnp.zeros((ids.shape[0],), jnp.int32), CausalKV())
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_draft_logits_with_a_cache_from_a_later_start_match_transformers():
    """Prefill 6 rows, then the rest from start_pos 6 with the head's K/V cached."""
    model, ids, hidden = _ours()
    cfg = model.config
    b, t = ids.shape[0], ids.shape[1] - 1
    shape = (1, b, t, cfg.num_kv_heads, cfg.head_dim)
    kv = ContiguousKV(layers=(jnp.zeros(shape), jnp.zeros(shape)), lengths=jnp.zeros((b,), jnp.int32))
    run = jax.jit(functools.partial(mtp_step, cfg=cfg))
    pieces = []
    for lo, hi in ((0, 6), (6, t)):
        got, kv = run(model.params, hidden=hidden[:, lo:hi], next_token_ids=ids[:, lo + 1:hi + 1],
                      start_pos=kv.lengths, kv=kv)
        pieces.append(got)
        kv = kv.advance(jnp.full((b,), hi - lo, jnp.int32))
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), _reference()["draft_logits"],
                               rtol=0, atol=ATOL)


@pytest.mark.dev
def test_committed_reference_is_what_transformers_computes_now():
    """Regenerates the reference in memory from the checkpoint (needs torch + transformers)."""
    from scripts.make_mtp_reference import mtp_reference

    fresh = mtp_reference()
    committed = _reference()
    assert set(fresh) == set(committed)
    np.testing.assert_array_equal(fresh["token_ids"], committed["token_ids"])
    # fp32 on CPU moves by a few ulps across torch/transformers builds (4.8e-6 on values ~2
    # with transformers 5.25); a tenth of ATOL still catches a reference that changed meaning
    for name in ("hidden", "draft_logits"):
        np.testing.assert_allclose(fresh[name], committed[name], rtol=0, atol=ATOL / 10,
                                   err_msg=name)
