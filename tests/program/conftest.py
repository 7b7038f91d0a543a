"""Programs shared by the Program tests (compiling every exact B takes a while on a CPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.models.qwen3_6 import forward
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from tests.models.conftest import loaded

PCFG = ProgramConfig(max_concurrency=8, page_size=4, num_pages=96, max_seq_len=64,
                     prefill_chunk=8, num_checkpoint_slots=4)


@functools.lru_cache(maxsize=None)
def program(name: str = "dense", **overrides) -> Program:
    m = loaded(name)
    prog = Program(m.config, m.params, ProgramConfig(**{**PCFG.__dict__, **overrides}))
    prog.wait_compiled()  # no test sees another Program's background compiles
    return prog


@functools.lru_cache(maxsize=None)
def _padded_forward(name: str):
    m = loaded(name)
    fn = jax.jit(lambda ids: forward(m.params, m.config, ids))
    return fn


def reference_greedy(name: str, prompt: list[int], num_new: int, width: int = 64) -> list[int]:
    """Greedy continuation by repeated full forwards over a right-padded, fixed-width row
    (causal attention makes the padding invisible), so one executable serves every length."""
    fn = _padded_forward(name)
    seq = list(prompt)
    for _ in range(num_new):
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(seq)] = seq
        seq.append(int(np.asarray(fn(jnp.asarray(ids)))[0, len(seq) - 1].argmax()))
    return seq[len(prompt):]


def run_to_completion(prog: Program, handles_budgets: dict) -> None:
    """Drives prefill then decode rounds of all given sequences until each used its budget."""
    for h in handles_budgets:
        while (pb := prog.prefill(h)) is None:
            pass
        prog.commit(pb, [1])
    live = [h for h, n in handles_budgets.items() if n > 1]
    while live:
        pb = prog.decode(live)
        prog.commit(pb, [1] * len(live))
        live = [h for h in live if prog.num_generated(h) < handles_budgets[h]]
