"""The `spec_policy` benchmark suite's settings (default tier; the suite itself runs Engines in
worker processes for minutes: `python scripts/bench.py --suite=spec_policy`)."""

from __future__ import annotations

import pytest

from scripts.benchmarks import spec_policy
from scripts.benchmarks._env import SettingError


@pytest.mark.parametrize("var, value, message", [
    ("BENCH_SPECPOL_METHOD", "eagle", "BENCH_SPECPOL_METHOD must be one of ['mtp', 'dflash']"),
    ("BENCH_SPECPOL_KS", "1,6", "BENCH_SPECPOL_KS must be >= 1 and <= 5, got 6"),
    ("BENCH_SPECPOL_BATCHES", "1,5", "BENCH_SPECPOL_BATCHES must be >= 1 and <= 4, got 5"),
    ("BENCH_SPECPOL_NEW_TOKENS", "1", "BENCH_SPECPOL_NEW_TOKENS must be >= 2"),
])
def test_bad_settings_are_errors_naming_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec_policy.Settings.from_env()


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("BENCH_SPECPOL_METHOD", "dflash")
    s = spec_policy.Settings.from_env()
    assert (s.method, s.ks, s.batches) == ("dflash", (4, 8, 15), (1, 4))
    monkeypatch.setenv("BENCH_SPECPOL_KS", "3,15")
    assert spec_policy.Settings.from_env().ks == (3, 15)
    assert spec_policy._settings(s, 15, "adaptive") == {
        "max_concurrency": 4, "speculative": "dflash", "num_speculative_tokens": 15,
        "draft_policy": "adaptive"}
    assert spec_policy._settings(s, 0, "fixed") == {"max_concurrency": 4}


def test_the_ab_script_loads_a_revisions_policy_and_names_a_bad_one():
    from absl import app

    from scripts import spec_policy_ab

    policy = spec_policy_ab._policy_at("HEAD")((0, 1, 3), "mtp")
    assert policy.adaptive and policy.choose([], lambda k, b: True) == 0
    with pytest.raises(app.UsageError, match="--against: no spec_policy.py at 'no-such-rev'"):
        spec_policy_ab._policy_at("no-such-rev")


def test_the_policys_rounds_by_k_per_turn_are_the_differences_of_its_counts():
    def out(counts):
        return {"stats": {"rounds_by_drafts": [[k, n] for k, n in counts.items()]}}

    side = {"warmup_outputs": [out({15: 6, 0: 20}), out({15: 6, 0: 20, 3: 38})],
            "outputs": [out({15: 6, 0: 20, 3: 76}), out({15: 8, 0: 21, 3: 110, 7: 2})]}
    assert spec_policy._rounds_by_turn(side) == [{3: 38}, {15: 2, 0: 1, 3: 34, 7: 2}]
    side = {"warmup_outputs": [], "outputs": [out({0: 20}), out({0: 30, 3: 5})]}
    assert spec_policy._rounds_by_turn(side) == [{0: 20}, {0: 10, 3: 5}]


def test_the_policys_bare_rounds_per_turn_are_the_differences_of_its_count():
    def out(bare):
        return {"stats": {"rounds_by_drafts": [[0, 100]], "bare_rounds": bare}}

    side = {"warmup_outputs": [out(40), out(90)], "outputs": [out(190), out(230)]}
    assert spec_policy._bare_by_turn(side) == [100, 40]
