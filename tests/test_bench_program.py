"""The `program` and `scoring` benchmark suites on the tiny config, each engine in its own worker
process: both engines give the same greedy tokens and log-probs, every measurement alternates
and reports its spread (slow + dev tier: the transformers workers need torch)."""

from __future__ import annotations

import statistics

import pytest

from scripts.benchmarks import program, scoring

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.slow
@pytest.mark.dev
def test_tiny_program_suite_agrees_with_transformers(tmp_path):
    s = program.Settings(configs=("tiny",), batches=(1, 2), reps=2, warmup=1, steps=4,
                         prefill_len=24, prefill_chunk=8, timeout_s=600, torch_env=PASSIVE)
    r = program.measure("tiny", s, workdir=tmp_path)
    assert list(r["measurements"]) == ["decode_b1", "decode_b2", "prefill_24"]
    assert r["measurements"]["decode_b2"]["order"] == ["ours", "transformers"] * 2
    for b in (1, 2):
        m = r["measurements"][f"decode_b{b}"]
        tokens = 1 + s.steps * (s.warmup + s.reps)  # the prefill's token, then every round's
        assert m["greedy_agreement"] == {"tokens_per_row": tokens,
                                         "common_prefix_per_row": [tokens] * b}
        ours, hf = m["sides"]["ours"], m["sides"]["transformers"]
        assert ours["work"] == hf["work"] == b * s.steps
        pairs = sorted(x / y for x, y in zip(ours["rates"], hf["rates"]))
        ratio = m["ratios"]["ours/transformers"]
        assert ratio["min"] == pairs[0] and ratio["max"] == pairs[-1]
    assert r["measurements"]["prefill_24"]["first_token_agreement"] == "3/3"
    b1 = r["measurements"]["decode_b1"]
    # the floor and XLA's matrix-vector chain measured in turn
    assert b1["order"] == ["ours", "transformers", "floor", "gemv"] * 2
    assert b1["sides"]["gemv"]["work"] == s.steps
    gemv = [x / y for x, y in zip(b1["sides"]["ours"]["rates"], b1["sides"]["gemv"]["rates"])]
    assert r["floor_b1"]["ours/gemv"]["median"] == pytest.approx(statistics.median(gemv))
    # every weight matrix: all but the norms, the conv kernels and the GDN's per-head vectors
    assert 0.99 * r["decode_weight_bytes"] < r["setup"]["gemv"]["matrix_bytes"] \
        <= r["decode_weight_bytes"]
    assert b1["sides"]["floor"]["work"] == 2 * program.COPY_BYTES / r["decode_weight_bytes"]
    ours = [x / y for x, y in zip(b1["sides"]["ours"]["rates"], b1["sides"]["floor"]["rates"])]
    assert r["floor_b1"]["ours/floor"]["median"] == pytest.approx(statistics.median(ours))
    assert [t["what"] for t in r["targets"]] == [
        "decode B=1 ours/transformers", "decode B=2 ours/transformers", "decode B=1 ours/floor",
        "prefill 24 ours/transformers"]
    assert set(r["setup"]) == {"ours", "transformers", "gemv"}
    assert "XLA GEMV chain" in program.format_table([r])
    assert r["setup"]["transformers"]["env"] == PASSIVE


@pytest.mark.slow
@pytest.mark.dev
def test_tiny_scoring_suite_agrees_with_transformers(tmp_path):
    s = scoring.Settings(configs=("tiny",), windows=4, window=32, contexts=3, records=40,
                         hf_rows=4, reps=2, warmup=1, lm_eval=False, timeout_s=600,
                         torch_env=PASSIVE)
    r = scoring.measure("tiny", s, tmp_path)
    assert set(r["tasks"]) == {"rolling", "choice", "short"}
    for task, t in r["tasks"].items():
        assert t["vs_transformers"]["logprob_rel_err"] < 1e-5, task
        assert t["vs_transformers"]["greedy_flags_agree"] == 1.0, task
        m = t["measurement"]
        sides = ["ours", "transformers"] if task == "rolling" else \
            ["ours", "ours_plain", "transformers"]
        assert m["order"] == sides * 2
        assert len({m["sides"][n]["work"] for n in sides}) == 1
    assert r["tasks"]["rolling"]["measurement"]["sides"]["ours"]["work"] == 4 * 32
    assert r["tasks"]["choice"]["measurement"]["sides"]["ours"]["work"] == 3 * 4
    assert r["tasks"]["short"]["fill"]["ours"] > r["tasks"]["short"]["fill"]["ours_plain"]
    assert "ours/plain" in scoring.format_table([r])
