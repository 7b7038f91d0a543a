"""The `vision` benchmark suite on the fixture, each engine in its own worker process: both
sides' vision embeddings and first tokens agree, every measurement alternates (slow + dev tier:
the transformers worker needs torch)."""

from __future__ import annotations

import pytest

from scripts.benchmarks import vision


@pytest.mark.slow
@pytest.mark.dev
def test_vision_suite_agrees_with_transformers():
    s = vision.Settings(images=("grad_64x48.png", "tall_97x300.png"), reps=2, warmup=1,
                        timeout_s=600, torch_env={"OMP_WAIT_POLICY": "PASSIVE"})
    r = vision.measure(s)
    for name in s.images:
        enc, ttft = r["images"][name]["encode"], r["images"][name]["ttft"]
        assert enc["order"] == ttft["order"] == ["ours", "transformers"] * 2
        assert enc["agreement"]["shape"] and enc["agreement"]["sum_abs_diff"] < 1e-3
        assert ttft["agreement"]["same_first_token"]
    assert "ours/hf speed" in vision.format_table(r)
