"""The `program` benchmark suite: its HF export inverts the weight schema, and on the tiny config
both engines produce the same greedy tokens and every reported number is a positive rate."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6.weights import init_params, params_from_hf
from ninfer_jax.testing import tiny_dense
from scripts.benchmarks import program as bench


class _DictSource:
    def __init__(self, tensors):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def get(self, name):
        return self.tensors[name]


@pytest.mark.parametrize("tied", [True, False])
def test_hf_state_dict_reads_back_to_the_same_params(tied):
    cfg = tiny_dense(tie_word_embeddings=tied)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(1)))
    back, notes = params_from_hf(cfg, _DictSource(bench._hf_state_dict(cfg, params)))
    assert notes == []
    jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.slow
@pytest.mark.dev
def test_tiny_run_agrees_with_transformers_and_reports_rates():
    s = bench.Settings(batches=(1, 2), decode_steps=4, reps=1, prefill_len=24,
                       prefill_chunks=(8, 16), prefill_reps=1)
    r = bench.measure("tiny", tiny_dense(), s, bandwidth_gbps=10.0)
    assert r["greedy_prefix_agreement"] == f"{s.decode_steps + 1}/{s.decode_steps + 1}"
    assert set(r["ours"]["decode_tokens_per_s"]) == set(s.batches)
    assert set(r["transformers"]["decode_tokens_per_s"]) == set(s.batches)
    assert set(r["ours"]["prefill"]["tokens_per_s"]) == set(s.prefill_chunks)
    rates = [*r["ours"]["decode_tokens_per_s"].values(),
             *r["ours"]["prefill"]["tokens_per_s"].values(),
             r["transformers"]["prefill_tokens_per_s"], r["floor_decode_tokens_per_s_b1"]]
    assert all(v > 0 for v in rates)
    assert r["ratios"]["decode_b1_ours_over_floor"] == pytest.approx(
        r["ours"]["decode_tokens_per_s"][1] / r["floor_decode_tokens_per_s_b1"])
