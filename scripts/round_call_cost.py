"""What passing unread params and pools costs a decode round's call, on the embedded model.

    python scripts/round_call_cost.py [--method=dflash] [--batch=4] [--reps=15] [--calls=60]

Opens the demo Engine with the method's adaptive policy (DFlash K = 15 or MTP K = 3,
max_concurrency 4; its worker stopped: the Program is driven from here) and, for each round of
0 (the bare one and the one with the drafter's or head's upkeep) and the largest K at B =
`--batch`, takes turns between two executables of the same step: the Program's own, called
with the params it reads (`executable_specs.round_params`) and the pools but the checkpoint
images' (`round_pools`), and one compiled over every param and pool the Program holds (jax
prunes the unread params from the executable, not from the call; a donated pool it does not
touch is given back). A turn
is `--calls` chained calls on the same inputs; prints per call the median [min-max] over
`--reps` turns of the calling thread's CPU and the wall time, and the 1-minute load.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

METHOD = flags.DEFINE_enum("method", "dflash", ["dflash", "mtp"], "speculative method")
BATCH = flags.DEFINE_integer("batch", 4, "rows a round", lower_bound=1, upper_bound=4)
REPS = flags.DEFINE_integer("reps", 15, "turns per executable", lower_bound=1)
CALLS = flags.DEFINE_integer("calls", 60, "chained calls per turn", lower_bound=1)


def _inputs(prog, b: int, drafts: int):
    import numpy as np

    from ninfer_jax.program.executable_specs import no_commit, reads_ring, round_width
    from ninfer_jax.program.host import GREEDY
    from ninfer_jax.program.sampling import sampling_arrays
    from ninfer_jax.program.steps import DecodeInputs

    pc, w = prog.pcfg, prog.pcfg.max_pages_per_seq
    return DecodeInputs(  # rows at position 150 over distinct pages (their values unread)
        commit=no_commit(pc, b, round_width(pc, drafts)), token_ids=np.full(b, 5, np.int32),
        positions=np.full(b, 150, np.int32), slots=np.arange(b, dtype=np.int32),
        page_tables=np.arange(b * w, dtype=np.int32).reshape(b, w) % pc.num_pages,
        sampling=sampling_arrays([GREEDY] * b, mask_words=prog.limits.mask_words),
        step_index=np.full(b, 151, np.int32), limit=np.ones(b, np.int32), rope_delta=None,
        context_from=np.zeros(b, np.int32) if reads_ring(pc, drafts) else None)


def _turn(prog, exe, params, inputs, calls: int, every: bool,
          bare: bool) -> tuple[float, float]:
    import jax

    from ninfer_jax.program.executable_specs import round_pools, with_images

    held = prog._pools
    pools = held if every else round_pools(held, bare)
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        pools, out = exe(params, pools, inputs)
    jax.block_until_ready(out.tokens)
    prog._pools = pools if every else with_images(pools, held)
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def main(argv) -> None:
    del argv
    import jax

    from ninfer_jax.api import Engine
    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.program.executable_specs import (
        program_executables,
        round_key,
        round_params,
        round_pools,
    )
    from ninfer_jax.program.executables import jit_step

    enable_persistent_cache()
    k = 15 if METHOD.value == "dflash" else 3
    engine = Engine.open(prefix_reuse=False, max_concurrency=4, speculative=METHOD.value,
                         num_speculative_tokens=k, draft_policy="adaptive")
    engine.wait_compiled()
    engine.close()  # its worker stops; the Program stays usable
    prog, b = engine.core.program, BATCH.value
    specs = {s.key: s for s in program_executables(prog.cfg, prog.pcfg, prog.params,
                                                    prog._pools, prog.drafter)}
    rounds = {"bare 0": (0, True), "0 with upkeep": (0, False), f"K={k}": (k, False)}
    sides = []
    for name, (drafts, bare) in rounds.items():
        key = round_key(prog.pcfg, b, drafts, bare)
        if key not in specs:
            continue
        spec, inputs = specs[key], _inputs(prog, b, drafts)
        args = (prog.params, prog._pools, inputs)
        every = jit_step(spec.fn, args, spec.donate, None).lower(*args).compile()
        read = round_params(prog.params, prog.pcfg, drafts, bare)
        sides += [(f"{name}, what it reads", prog.executables._get(key), read, inputs, False,
                   bare), (f"{name}, everything", every, prog.params, inputs, True, bare)]
    for _, exe, params, inputs, whole, bare in sides:  # a first run of each
        _turn(prog, exe, params, inputs, 2, whole, bare)
    runs = {name: [] for name, *_ in sides}
    for rep in range(REPS.value):
        for name, exe, params, inputs, whole, bare in (sides if rep % 2 == 0 else sides[::-1]):
            runs[name].append(_turn(prog, exe, params, inputs, CALLS.value, whole, bare))
    print(f"{METHOD.value} K={k}, B={b}: per call, median [min-max] of {REPS.value} turns of "
          f"{CALLS.value} calls")
    for name, _, params, _, whole, bare in sides:
        pools = prog._pools if whole else round_pools(prog._pools, bare)
        cpu = [1e6 * c for c, _ in runs[name]]
        wall = [1e6 * w for _, w in runs[name]]
        print(f"  {name:30s} {len(jax.tree.leaves(params)):4d} + "
              f"{len(jax.tree.leaves(pools)):2d} leaves  caller CPU "
              f"{statistics.median(cpu):6.0f} [{min(cpu):.0f}-{max(cpu):.0f}] us  wall "
              f"{statistics.median(wall):6.0f} [{min(wall):.0f}-{max(wall):.0f}] us")
    print(f"load 1-min {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
