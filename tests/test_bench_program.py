"""The `program` benchmark suite on the tiny config: both engines produce the same greedy tokens
and every reported number is a positive rate (slow + dev tier: it needs transformers)."""

from __future__ import annotations

import pytest

from ninfer_jax.testing import tiny_dense
from scripts.benchmarks import program as bench


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
