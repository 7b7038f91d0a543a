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
    assert spec_policy_ab._fixed_k("k:8", (0, 4, 8, 15)) == 8
    for bad, says in (("k:0", "one of \\[4, 8, 15\\]"), ("k:5", "one of"), ("k:x", "integer")):
        with pytest.raises(app.UsageError, match=says):
            spec_policy_ab._fixed_k(bad, (0, 4, 8, 15))


def test_a_turns_rounds_by_k_are_the_differences_of_the_engines_counts():
    from scripts.benchmarks.workers.spec_engine import _since

    assert _since(((0, 20), (3, 38), (15, 6)), ((0, 20), (15, 6))) == {3: 38}
    assert _since(((0, 21), (3, 110), (7, 2), (15, 8)), ((0, 20), (3, 76), (15, 6))) == {
        0: 1, 3: 34, 7: 2, 15: 2}
    side = {"warmup_outputs": [{"rounds_by_drafts": {0: 9}, "bare_rounds": 9}],
            "outputs": [{"rounds_by_drafts": {0: 20}, "bare_rounds": 12},
                        {"rounds_by_drafts": {0: 10, 3: 5}, "bare_rounds": 0}]}
    assert spec_policy._rounds_by_turn(side) == [{0: 20}, {0: 10, 3: 5}]
    assert spec_policy._bare_by_turn(side) == [12, 0]


class _Recorder:
    name = "policy 2"

    def __init__(self):
        self.calls = []

    def __getattr__(self, op):
        return lambda *a: self.calls.append((op, *a)) or {"seconds": 1.0, "work": 1}


def test_the_policys_process_serves_requests_that_draft_nothing_as_a_side_of_its_own():
    worker = _Recorder()
    side = spec_policy.RequestsOff(worker)
    assert side.name == "policy 2:off"
    side.prepare("b4", {"prompts": ["a"], "new_tokens": 8})
    side.rep("b4")
    side.finish("b4")
    assert worker.calls == [
        ("prepare", "b4:off", {"prompts": ["a"], "new_tokens": 8, "speculative": "off"}),
        ("rep", "b4:off"), ("finish", "b4:off")]


class _Handle:
    """A request's events as an Engine publishes them (a RequestHandle's reading side)."""

    def __init__(self, events, fail: bool = False):
        self.events, self.fail, self.read = list(events), fail, []

    @property
    def done(self) -> bool:
        return not self.events

    def next_event(self, timeout=None):
        if self.fail:
            raise RuntimeError("the Engine failed")
        self.read.append(self.events.pop(0))
        return self.read[-1]

    def result(self, timeout=None):
        import time

        time.sleep(0.02)  # the rest of the output arrives meanwhile
        tokens = [t for e in self.read + self.events for t in getattr(e, "token_ids", ())]
        self.events = []
        return type("Result", (), {"token_ids": tuple(tokens)})


def test_a_requests_client_times_its_decode_from_its_first_token():
    from ninfer_jax.engine.events import (
        Channel,
        Delta,
        Finished,
        FinishReason,
        GenerationStart,
        Usage,
    )
    from scripts.benchmarks.workers.spec_engine import _Watch

    def delta(*ids):
        return Delta(7, "", ids, Channel.CONTENT)

    handle = _Handle([GenerationStart(7, 5, 0), delta(), delta(11, 12), delta(13),
                      delta(14, 15, 16), Finished(7, FinishReason.LENGTH, Usage(5, 6))])
    watch = _Watch(handle)
    watch.join()
    assert len(handle.read) == 3  # up to the first event with tokens, then the result
    assert watch.before == 2 and len(watch.result.token_ids) == 6
    assert watch.decode_tok_s == pytest.approx(4 / (watch.end - watch.first))
    assert watch.end - watch.first >= 0.02
    broken = _Watch(_Handle([GenerationStart(7, 5, 0)], fail=True))
    with pytest.raises(RuntimeError, match="the Engine failed"):
        broken.join()


def test_the_targets_are_on_decode_tok_s_and_the_turns_rate_is_reported_beside():
    def spread(x):
        return {"median": x, "min": x, "max": x, "n": 1}

    def side(decode, turn):
        return {"decode_tok_s": spread(100 * decode), "decode_over_off": spread(decode),
                "tok_s": spread(90 * turn), "over_off": spread(turn),
                "first_token_over_off": spread(1.1), "same_tokens_as_off": True,
                "worker_cpu_ms_per_round": spread(1.0)}

    policy = {"best_fixed": "K=4", "decode_over_best_fixed": spread(1.3),
              "over_best_fixed": spread(1.25), "decode_over_own_off": spread(0.99),
              "own_off_over_off": spread(0.97),
              "met": spec_policy._met(spread(0.98), spread(1.3)),
              "turn_met": spec_policy._met(spread(0.96), spread(1.25))}
    assert policy["met"] and not policy["turn_met"]
    result = {"settings": {"method": "dflash", "new_tokens": 128, "warmup": 2, "reps": 15},
              "measure": {"batches": {4: {"sides": {"off": side(1.0, 1.0),
                                                    "policy": side(0.98, 0.96),
                                                    "K=4": side(0.75, 0.74)},
                                          "policy": policy, "load_1min": spread(1.2)}},
                          "policy_stats": {"rounds_by_drafts": [[0, 10]],
                                           "acceptance_by_position": [0.5],
                                           "round_ms": [[0, 4, 3.2]]}}}
    table = spec_policy.format_table(result)
    assert ("policy / best fixed (K=4) per pair: decode 1.30 [1.30-1.30], turn 1.25 "
            "[1.25-1.25]") in table
    assert "met (on the turn's tok/s: not met)" in table
    assert ("policy / its own process's speculative=\"off\" requests per pair (the same "
            "process): decode 0.99 [0.99-0.99]; those requests / off per pair: decode 0.97 "
            "[0.97-0.97]") in table
    assert spec_policy._over([2.0, 3.0], [1.0, 2.0])["median"] == pytest.approx(1.75)


def test_replicas_pool_every_policy_process_over_every_off_process_per_turn(monkeypatch):
    monkeypatch.setenv("BENCH_SPECPOL_REPLICAS", "2")
    s = spec_policy.Settings.from_env()
    assert s.replicas == 2 and spec_policy._replicas(s, "off") == ["off", "off 2"]
    monkeypatch.setenv("BENCH_SPECPOL_REPLICAS", "5")
    with pytest.raises(SettingError, match="BENCH_SPECPOL_REPLICAS must be >= 1 and <= 4"):
        spec_policy.Settings.from_env()
    # two turns; the second off process runs 10% faster than the first
    rates = {"off": [100.0, 100.0], "off 2": [110.0, 110.0], "policy": [99.0, 97.0],
             "policy 2": [108.9, 106.7]}
    pooled = spec_policy._pooled(rates, ["policy", "policy 2"], ["off", "off 2"])
    assert pooled["n"] == 8
    assert pooled["median"] == pytest.approx(0.98, abs=0.011)
    alone = spec_policy._pooled(rates, ["policy"], ["off"])
    assert alone == spec_policy._over(rates["policy"], rates["off"])
    assert spec_policy._pooled(rates, ["off 2"], ["off"])["median"] == pytest.approx(1.1)


def test_replicas_run_every_fixed_k_as_several_processes_too(monkeypatch):
    monkeypatch.setenv("BENCH_SPECPOL_METHOD", "dflash")
    monkeypatch.setenv("BENCH_SPECPOL_REPLICAS", "2")
    names = {name: (k, policy) for name, k, policy in
             spec_policy._sides(spec_policy.Settings.from_env())}
    assert list(names) == ["off", "policy", "K=4", "K=8", "K=15", "off 2", "policy 2",
                           "K=4 2", "K=8 2", "K=15 2"]
    assert names["K=8 2"] == (8, "fixed") and names["policy 2"] == (15, "adaptive")


def test_the_policys_round_times_are_kept_per_turn_at_the_turns_b():
    side = {"outputs": [{"stats": {"round_ms": [[0, 1, 0.9], [4, 1, 4.1], [0, 4, 2.5]]}},
                        {"stats": {"round_ms": [[0, 1, 1.3], [4, 4, 10.0]]}}]}
    assert spec_policy._round_ms_by_turn(side, 1) == [{0: 0.9, 4: 4.1}, {0: 1.3}]
    assert spec_policy._round_ms_by_turn(side, 4) == [{0: 2.5}, {4: 10.0}]
