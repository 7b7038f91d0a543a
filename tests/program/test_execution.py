"""How the Program executes: one dispatch per steady decode round (the commit rides in the next
step), background compilation in order of need, and the two layer loops computing the same
tokens."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.program.errors import MissingExecutableError
from ninfer_jax.program.executables import ExecutableTable, StepKey, StepKind
from ninfer_jax.program.host import GREEDY
from tests.models.conftest import reference
from tests.program.conftest import program, run_to_completion


class _Counting:
    """Wraps an ExecutableTable and records the kinds it runs."""

    def __init__(self, table):
        self.table, self.kinds = table, []

    def __call__(self, key, *args):
        self.kinds.append(key.kind)
        return self.table(key, *args)

    def __getattr__(self, name):
        return getattr(self.table, name)


def test_a_steady_decode_round_is_one_dispatch_and_commits_stay_exact():
    prog = program()
    prompt = reference("dense")["token_ids"][0, :9].tolist()
    h = prog.materialize(prog.plan_admission(len(prompt), 8), prompt, GREEDY)
    counting = _Counting(prog.executables)
    prog.executables = counting
    try:
        while (pb := prog.prefill(h)) is None:
            pass
        prog.commit(pb, [1])
        counting.kinds.clear()
        for _ in range(5):
            prog.commit(prog.decode([h]), [1])
        assert counting.kinds == [StepKind.DECODE] * 5  # each commit rode in the next step
        # Reading the pools applies the last commit: the committed state is never stale.
        before = np.asarray(prog.pools.output_counts[prog._seq(h).slot]).sum()
        assert counting.kinds[-1] is StepKind.COMMIT and before == 6  # 1 prefill + 5 decode
        prog.abort_pending(prog.decode([h]))
        assert np.asarray(prog.pools.output_counts[prog._seq(h).slot]).sum() == before
    finally:
        prog.executables = counting.table
        prog.release(h)


def test_layer_loops_agree():
    ids = reference("dense")["token_ids"]
    outs = {}
    # The shared Program runs unrolled; a one-row scan Program keeps this test's compiles few.
    for loop, prog in (("unrolled", program()),
                       ("scan", program(layer_loop="scan", max_concurrency=1,
                                        num_checkpoint_slots=0))):
        assert ("layers" in prog.params) == (loop == "unrolled")
        outs[loop] = []
        for r, n in ((0, 9), (1, 14)):
            h = prog.materialize(prog.plan_admission(n, 6), ids[r, :n].tolist(), GREEDY)
            run_to_completion(prog, {h: 6})
            outs[loop].append(prog.tokens(h))
            prog.release(h)
    assert outs["unrolled"] == outs["scan"]


def test_background_compiles_follow_need_and_close_drops_the_rest(capsys):
    prog = program()  # compiled in the background, then waited for by the fixture
    assert prog.pcfg.background_compile
    keys = set(prog.executables.keys())
    prog.wait_compiled(progress=True)  # all done: the bar counts every one of them
    assert "compiling executables: 100%|" in capsys.readouterr().err
    assert {StepKey(StepKind.PREFILL, 1), StepKey(StepKind.CAPTURE, 1),
            StepKey(StepKind.RESTORE, 1), StepKey(StepKind.COMMIT, 8)} <= keys
    assert {StepKey(StepKind.DECODE, b) for b in range(1, 9)} <= keys
    # A fresh table: queue compiles, close before they run, and their keys then refuse.
    table = ExecutableTable()
    entered, gate = threading.Event(), threading.Event()

    def held(pools):  # traced on the compile thread, which it holds until the gate opens
        entered.set()
        gate.wait(10)
        return pools

    table.compile(StepKey(StepKind.CAPTURE, 1), held, np.zeros(2, np.float32), background=True)
    table.compile(StepKey(StepKind.CAPTURE, 2), lambda pools: pools + 1,
                  np.zeros(2, np.float32), background=True)
    assert entered.wait(10)
    table.close()
    gate.set()
    with pytest.raises(MissingExecutableError, match="dropped"):
        table(StepKey(StepKind.CAPTURE, 2), jnp.zeros(2))
    assert float(table(StepKey(StepKind.CAPTURE, 1), jnp.ones(2))[0]) == 1.0  # it was running


def test_held_compiles_wait_and_a_called_key_goes_first():
    """While held (an Engine serving requests) the compile thread starts nothing queued; a key
    someone calls is compiled at once, ahead of the queue; released, the rest follow."""
    table = ExecutableTable()
    entered, gate = threading.Event(), threading.Event()
    traced: list[int] = []

    def held(pools):
        entered.set()
        gate.wait(10)
        return pools

    def counted(b):
        def fn(pools):
            traced.append(b)
            return pools + b
        return fn

    table.compile(StepKey(StepKind.CAPTURE, 1), held, np.zeros(2, np.float32), background=True)
    for b in (2, 3, 4):
        table.compile(StepKey(StepKind.CAPTURE, b), counted(b), np.zeros(2, np.float32),
                      background=True)
    assert entered.wait(10)
    table.hold(True)
    gate.set()  # the running compile finishes; nothing else starts while held
    assert float(table(StepKey(StepKind.CAPTURE, 1), jnp.ones(2))[0]) == 1.0
    time.sleep(0.3)
    assert traced == []
    assert float(table(StepKey(StepKind.CAPTURE, 3), jnp.zeros(2))[0]) == 3.0  # called: first
    assert traced == [3]
    table.hold(False)
    table.wait()
    assert traced == [3, 2, 4]
    table.close()


def test_a_table_dropped_without_close_stops_compiling():
    """A Program that is garbage (its table unreferenced, never closed) compiles nothing more
    than the job in progress, and its thread ends: dropped Programs must not keep the cores
    busy, nor compile in the background while the process goes on."""
    import gc

    table = ExecutableTable()
    entered, gate = threading.Event(), threading.Event()
    traced = []

    def held(pools):
        entered.set()
        gate.wait(10)
        return pools

    def counted(pools):
        traced.append(1)
        return pools + 1

    table.compile(StepKey(StepKind.CAPTURE, 1), held, np.zeros(2, np.float32), background=True)
    for b in range(2, 6):
        table.compile(StepKey(StepKind.CAPTURE, b), counted, np.zeros(b, np.float32),
                      background=True)
    assert entered.wait(10)
    thread = table._thread
    del table
    gc.collect()
    gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert traced == []
