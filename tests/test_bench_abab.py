"""The ABAB benchmark harness (`scripts/benchmarks/_abab.py`) with real worker subprocesses.

The workers are the fakes in `tests/bench_fakes/`: `scripted` reports known seconds (so medians
and ratios are exact) and the monotonic times it really ran at; `faulty` crashes, hangs or
raises on purpose. Every call is bounded by the harness's own timeouts.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from scripts.benchmarks._abab import LocalSide, Worker, WorkerError, alternate

SCRIPTED = "tests.bench_fakes.scripted"
FAULTY = "tests.bench_fakes.faulty"
MARKER = "faulty worker: simulated failure"


def test_alternates_abab_and_reports_medians_spread_ratio_and_load(capsys):
    # Repetition 0 of each side is the warm-up: its seconds (100) must not count.
    a_seconds = [100.0, 1.0, 4.0, 2.0, 5.0, 3.0]
    b_seconds = [100.0, 2.0, 2.0, 8.0, 2.0, 2.0]
    with Worker("a", SCRIPTED, timeout_s=30) as a, Worker("b", SCRIPTED, timeout_s=30) as b:
        a.setup({"sleep_s": 0.02, "seconds": a_seconds, "work": 12.0})
        b.setup({"sleep_s": 0.02, "seconds": b_seconds, "work": 12.0})
        r = alternate([a, b], "m", {"x": 1}, reps=5, warmup=1)
        procs = [a._proc, b._proc]
    assert [p.returncode for p in procs] == [0, 0]  # asked to exit, exited cleanly

    assert r["order"] == ["a", "b"] * 5
    runs = [(side, o) for i in range(5) for side in "ab"
            for o in [r["sides"][side]["outputs"][i]]]
    for (_, first), (_, second) in itertools.pairwise(runs):
        assert first["end"] <= second["start"]  # really one after the other, in that order
    assert len({o["pid"] for _, o in runs}) == 2

    sa, sb = r["sides"]["a"], r["sides"]["b"]
    assert sa["warmup_s"] == [100.0] and sb["warmup_s"] == [100.0]
    assert sa["prepared"] == {"name": "m", "args": {"x": 1}}
    assert sa["seconds"] == {"median": 3.0, "min": 1.0, "max": 5.0, "n": 5}
    assert sb["seconds"] == {"median": 2.0, "min": 2.0, "max": 8.0, "n": 5}
    assert sa["rate"] == {"median": 4.0, "min": 2.4, "max": 12.0, "n": 5}
    # Per pair: a's rate over b's = b_seconds / a_seconds = 2, 0.5, 4, 0.4, 2/3.
    assert list(r["ratios"]) == ["a/b"]
    ratio = r["ratios"]["a/b"]
    assert ratio["median"] == pytest.approx(2 / 3)
    assert (ratio["min"], ratio["max"]) == pytest.approx((0.4, 4.0))

    assert len(r["load"]) == 10 and [x["side"] for x in r["load"]] == r["order"]
    assert all(len(x["before"]) == 3 and len(x["after"]) == 3 for x in r["load"])
    assert r["load_1min"]["n"] == 20 and r["load_1min"]["min"] >= 0
    # Stray stdout reached our stderr, prefixed with the worker's name, not the protocol.
    assert "[a] stray stdout from m repetition 3" in capsys.readouterr().err


@pytest.mark.parametrize("fail, op", [("setup", "setup"), ("crash", "rep")])
def test_a_crashing_worker_is_an_error_with_its_stderr(fail, op):
    start = time.monotonic()
    with pytest.raises(WorkerError) as e, Worker("ok", SCRIPTED, timeout_s=30) as ok, \
            Worker("bad", FAULTY, timeout_s=30) as bad:
        ok.setup({"sleep_s": 0.0, "seconds": [1.0] * 10, "work": 1.0})
        bad.setup({"fail": fail, "at_rep": 2})
        alternate([ok, bad], "m", {}, reps=5, warmup=1)
    message = str(e.value)
    assert f"exited with status 3 during {op!r}" in message
    assert "'bad'" in message and MARKER in message
    assert ok._proc.poll() is not None and bad._proc.poll() is not None  # nothing left behind
    assert time.monotonic() - start < 20


def test_a_hanging_worker_is_killed_at_its_timeout():
    with Worker("ok", SCRIPTED, timeout_s=30) as ok:
        bad = Worker("bad", FAULTY, timeout_s=30)
        try:
            ok.setup({"sleep_s": 0.0, "seconds": [1.0] * 10, "work": 1.0})
            bad.setup({"fail": "hang", "at_rep": 1})
            bad.timeout_s = 1.0
            errors = []

            def measure() -> None:
                try:
                    alternate([ok, bad], "m", {}, reps=3, warmup=0)
                except WorkerError as e:
                    errors.append(e)

            thread = threading.Thread(target=measure, daemon=True)
            thread.start()
            thread.join(timeout=20)  # a harness without its own timeout fails here, not hangs
            assert not thread.is_alive() and len(errors) == 1
            assert "did not answer 'rep' within 1 s and was killed" in str(errors[0])
            assert bad._proc.poll() is not None  # killed and reaped, not left sleeping
            with pytest.raises(WorkerError, match="exited with status -9 before 'rep'"):
                bad.rep("m")
        finally:
            bad.kill()
    assert ok._proc.returncode == 0  # the healthy worker still exits cleanly


def test_an_error_reply_and_a_bad_repetition_are_errors_naming_the_cause():
    with Worker("bad", FAULTY, timeout_s=30) as bad:
        bad.setup({"fail": "raise", "at_rep": 0})
        with pytest.raises(WorkerError, match=f"(?s)failed 'rep'.*RuntimeError: {MARKER}"):
            bad.rep("m")
        bad.rep("m")  # the worker survived its own exception and still answers
    with Worker("bad", FAULTY, timeout_s=30) as bad:
        bad.setup({"fail": "bad_seconds", "at_rep": 0})
        with pytest.raises(WorkerError, match="'seconds' must be a finite number > 0, got 0.0"):
            alternate([bad], "m", {}, reps=1, warmup=0)


class _Counter:
    """An in-process side: reports seconds 1, 2, 3, ... and logs the calls."""

    def __init__(self, log: list):
        self.log, self.n = log, 0

    def prepare(self, name, args):
        self.log.append(("prepare", name))

    def rep(self, name):
        self.n += 1
        self.log.append(("rep", self))
        return {"seconds": float(self.n), "work": 6.0, "outputs": self.n}

    def finish(self, name):
        self.log.append(("finish", name))


def test_local_sides_alternate_in_one_process():
    log = []
    one, two = _Counter(log), _Counter(log)
    r = alternate([LocalSide("one", one), LocalSide("two", two)], "m", {}, reps=3, warmup=1)
    reps = [x[1] for x in log if x[0] == "rep"]
    assert reps == [one, two] + [one, two] * 3
    assert log[0] == ("prepare", "m") and log[-1] == ("finish", "m")
    assert r["sides"]["one"]["outputs"] == [2, 3, 4]
    assert r["sides"]["one"]["rate"]["median"] == 2.0
    assert r["ratios"] == {"one/two": {"median": 1.0, "min": 1.0, "max": 1.0, "n": 3}}


def test_serpentine_turns_reverse_every_other_round():
    log = []
    sides = [_Counter(log) for _ in range(3)]
    r = alternate([LocalSide(n, c) for n, c in zip("abc", sides)], "m", {}, reps=3, warmup=0,
                  serpentine=True)
    assert r["order"] == [*"abc", *"cba", *"abc"]
    assert [x[1] for x in log if x[0] == "rep"] == [sides[i] for i in (0, 1, 2, 2, 1, 0, 0, 1, 2)]
    assert r["sides"]["c"]["outputs"] == [1, 2, 3]


def test_rotated_rounds_start_one_side_later_each_and_repeat_no_side():
    log = []
    sides = [_Counter(log) for _ in range(3)]
    r = alternate([LocalSide(n, c) for n, c in zip("abc", sides)], "m", {}, reps=4, warmup=0,
                  rotate=True)
    assert r["order"] == [*"abc", *"bca", *"cab", *"abc"]
    assert all(x != y for x, y in zip(r["order"], r["order"][1:]))
    assert r["sides"]["a"]["outputs"] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="serpentine or rotate, not both"):
        alternate([LocalSide("a", sides[0])], "m", {}, reps=1, serpentine=True, rotate=True)


@pytest.mark.parametrize("var, value, message", [
    ("BENCH_PROGRAM_BATCHES", "1,x", "BENCH_PROGRAM_BATCHES must be an integer, got 'x'"),
    ("BENCH_PROGRAM_BATCHES", "1,0", "BENCH_PROGRAM_BATCHES must be >= 1 and <= 64, got 0"),
    ("BENCH_PROGRAM_BATCHES", "2,2", "BENCH_PROGRAM_BATCHES must list distinct integers"),
    ("BENCH_PROGRAM_REPS", "0", "BENCH_PROGRAM_REPS must be >= 1, got 0"),
    ("BENCH_PROGRAM_CONFIGS", "tiny,huge",
     "BENCH_PROGRAM_CONFIGS must list distinct names out of ['tiny', 'medium'], got 'tiny,huge'"),
    ("BENCH_TORCH_OMP_WAIT_POLICY", "spin",
     "BENCH_TORCH_OMP_WAIT_POLICY must be one of ['passive', 'active', 'inherit'], got 'spin'"),
])
def test_bad_settings_are_errors_naming_the_variable(monkeypatch, var, value, message):
    from scripts.benchmarks import program
    from scripts.benchmarks._env import SettingError

    monkeypatch.setenv(var, value)
    with pytest.raises(SettingError) as e:
        program.Settings.from_env()
    assert message in str(e.value)


def test_settings_from_the_environment(monkeypatch):
    from scripts.benchmarks import program

    monkeypatch.setenv("BENCH_PROGRAM_BATCHES", "8, 1")
    monkeypatch.setenv("BENCH_PROGRAM_CONFIGS", "medium")
    monkeypatch.setenv("BENCH_TORCH_OMP_WAIT_POLICY", "inherit")
    s = program.Settings.from_env()
    assert (s.batches, s.configs, s.torch_env, s.reps) == ((1, 8), ("medium",), {}, 5)
    monkeypatch.delenv("BENCH_TORCH_OMP_WAIT_POLICY")
    assert program.Settings.from_env().torch_env == {"OMP_WAIT_POLICY": "PASSIVE"}
