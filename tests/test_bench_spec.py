"""The `spec` benchmark suite: its acceptance tally and settings (default tier), and both parts
on real Programs, the demo model and a tiny random model with an MTP head (slow tier)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scripts.benchmarks import spec
from scripts.benchmarks._env import SettingError
from scripts.benchmarks._spec_sides import merge_tallies, tally


def test_tally_counts_each_draft_position_only_where_the_limit_let_it_be_verified():
    # K=3. Round 1: rows limited to 4, 4, 2 tokens produced 1, 4, 2 (no draft, all three,
    # draft 1). Round 2: one row near its budget (limit 1: no draft can be verified) made 1.
    t = tally(3, [np.array([4, 4, 2]), np.array([1])], [np.array([1, 4, 2]), np.array([1])])
    assert t == {"row_rounds": 4, "committed": 8, "attempted": [3, 2, 2],
                 "accepted": [2, 1, 1]}
    m = merge_tallies([t, tally(3, [np.array([4])], [np.array([3])])])
    assert m["row_rounds"] == 5 and m["committed"] == 11
    assert m["attempted"] == [4, 3, 3] and m["accepted"] == [3, 2, 1]
    assert m["mean_committed_per_row_round"] == pytest.approx(11 / 5)
    assert m["acceptance_by_position"] == pytest.approx([3 / 4, 2 / 3, 1 / 3])
    plain = merge_tallies([tally(0, [np.array([1, 1])], [np.array([1, 1])])])
    assert plain["acceptance_by_position"] == [] and plain["mean_committed_per_row_round"] == 1


@pytest.mark.parametrize("var, value, message", [
    ("BENCH_SPEC_KS", "1,2", "BENCH_SPEC_KS must hold 0 (the baseline every ratio divides by)"),
    ("BENCH_SPEC_KS", "0,6", "BENCH_SPEC_KS must be >= 0 and <= 5, got 6"),
    ("BENCH_SPEC_BATCHES", "1,9", "BENCH_SPEC_BATCHES must be >= 1 and <= 8, got 9"),
    ("BENCH_SPEC_NEW_TOKENS", "1", "BENCH_SPEC_NEW_TOKENS must be >= 2 and <= 1024, got 1"),
    ("BENCH_SPEC_MEDIUM", "yes", "BENCH_SPEC_MEDIUM must be an integer, got 'yes'"),
    ("BENCH_SPEC_MEDIUM", "2", "BENCH_SPEC_MEDIUM must be >= 0 and <= 1, got 2"),
    ("BENCH_SPEC_MEDIUM_K", "0", "BENCH_SPEC_MEDIUM_K must be >= 1 and <= 5, got 0"),
    ("BENCH_SPEC_DFLASH_KS", "4,16", "BENCH_SPEC_DFLASH_KS must be >= 1 and <= 15, got 16"),
    ("BENCH_SPEC_DRAFT_HEAD", "top", "BENCH_SPEC_DRAFT_HEAD must be one of ('full', "
                                     "'selector'), got 'top'"),
])
def test_bad_settings_are_errors_naming_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingError) as e:
        spec.Settings.from_env()
    assert message in str(e.value)


def test_settings_from_the_environment(monkeypatch):
    assert spec.Settings.from_env() == spec.Settings()
    monkeypatch.setenv("BENCH_SPEC_KS", "2, 0")
    monkeypatch.setenv("BENCH_SPEC_MEDIUM", "0")
    s = spec.Settings.from_env()
    assert (s.ks, s.medium, s.batches) == ((0, 2), False, (1, 2, 4, 8))
    monkeypatch.setenv("BENCH_SPEC_DFLASH_KS", "")
    assert spec.Settings.from_env().dflash_ks == ()
    monkeypatch.setenv("BENCH_SPEC_DFLASH_KS", "15,4")
    assert spec.Settings.from_env().dflash_ks == (4, 15)


@pytest.mark.slow
def test_both_parts_on_real_programs():
    import jax

    from ninfer_jax.frontend import Frontend
    from ninfer_jax.loader import load_model
    from ninfer_jax.models.qwen3_6.weights import init_params
    from ninfer_jax.testing import tiny_dense
    from scripts.benchmarks._engine_vs_program import PROMPTS

    s = spec.Settings(ks=(0, 2), dflash_ks=(4,), batches=(1,), new_tokens=12, reps=2, warmup=1, medium_k=2,
                      medium_batches=(1,), medium_rounds=3, medium_reps=2)
    loaded = load_model(None, verify=False)
    frontend = Frontend.load(loaded.path)
    prompts = [list(frontend.prepare(prompt=p).token_ids) for p in PROMPTS[:1]]
    demo = spec.measure_demo(loaded.config, loaded.params, prompts, s)
    b1 = demo["batches"][1]
    assert b1["order"] == ["K=0", "K=2"] * 2 + ["K=0'", "K=2'", "dflash K=4"] * 2
    plain, drafted, block = b1["ks"]["K=0"], b1["ks"]["K=2"], b1["ks"]["dflash K=4"]
    assert b1["ks"]["K=2'"]["tally"] == drafted["tally"]  # the same greedy rounds again
    assert block["same_tokens_as_k0"] and block["tally"]["row_rounds"] < block["tally"][
        "committed"]
    assert plain["work"] == drafted["work"] == s.new_tokens - 1  # the timed rounds' tokens
    assert plain["same_tokens_as_k0"] and drafted["same_tokens_as_k0"]
    assert plain["tally"]["mean_committed_per_row_round"] == 1.0
    assert drafted["tally"]["committed"] == s.reps * (s.new_tokens - 1)
    assert drafted["tally"]["row_rounds"] < drafted["tally"]["committed"]  # drafts accepted
    ratios = sorted(x / y for x, y in zip(drafted["rates"], plain["rates"]))
    assert (drafted["ratio_to_k0"]["min"], drafted["ratio_to_k0"]["max"]) == (ratios[0],
                                                                             ratios[-1])
    assert demo["best"]["mtp"]["b1"]["k"] == 2 and demo["best"]["dflash"]["b1"]["k"] == 4
    assert "dflash_over_mtp_b1" in demo["best"]

    cfg = tiny_dense(mtp_num_layers=1)
    params = init_params(cfg, jax.random.key(0), num_mtp_layers=1)
    medium = spec.measure_verify(cfg, params, s, cfg.vocab_size)
    m = medium["batches"][1]
    assert m["order"] == ["K=0", "K=2"] * 2
    rounds = s.medium_rounds * (s.warmup + s.medium_reps)
    assert m["tally"]["row_rounds"] == s.medium_rounds * s.medium_reps
    assert m["k0_tokens_per_row"] == 1 + rounds and m["common_prefix_per_row"] == [1 + rounds]
    ms = m["round_ms"]
    assert ms["K=2"]["n"] == ms["K=0"]["n"] == s.medium_reps
    table = spec.format_table({"settings": dataclasses.asdict(s), "demo": demo,
                               "medium": medium})
    assert "target best K >= 1.5x K=0 at B=1 (embedded model)" in table
    assert "target MEDIUM verify (K=2) step <= 1.3x a decode step at B=1" in table
