"""Prefix checkpoints in the Program: capture at a frontier, materialize a new sequence from it
(shared full pages, copied partial page, restored GDN state), exact continuation, refcounts."""

from __future__ import annotations

import pytest

from ninfer_jax.program.errors import ResourceError
from tests.models.conftest import reference
from tests.program.conftest import program, reference_greedy, run_to_completion


def _admit(prog, prompt, max_new, source=None):
    return prog.materialize(prog.plan_admission(len(prompt), max_new, source), prompt)


def _refs_are_explained(prog, ckpts):
    """Every page's refcount equals the references active sequences and checkpoints hold."""
    held = {}
    for h in prog.handles():
        for p in prog._seq(h).pages:
            held[p] = held.get(p, 0) + 1
    for c in ckpts:
        for p in prog.checkpoint_pages(c):
            held[p] = held.get(p, 0) + 1
    for page in range(prog.pages.num_pages):
        assert prog.pages.refcount(page) == held.get(page, 0), page


@pytest.mark.parametrize("extra", [1, 3, 9])
def test_continuation_from_a_prompt_checkpoint_equals_recompute(extra):
    prog = program()
    ids = reference("dense")["token_ids"][1].tolist()
    base, longer = ids[:13], ids[: 13 + extra]  # frontier 13: a partial page of 4
    a = _admit(prog, base, 5)
    run_to_completion(prog, {a: 1})
    ckpt = prog.capture(a)
    assert prog.checkpoint_tokens(ckpt) == tuple(base)
    pb = prog.decode([a])  # a keeps writing into the shared partial page
    prog.commit(pb, [1])
    plan = prog.plan_admission(len(longer), 6, ckpt)
    assert plan.cached_tokens == 13 and plan.num_pages == prog.pages_needed(len(longer), 6) - 3
    b = _admit(prog, longer, 6, ckpt)
    assert prog._seq(b).pages[:3] == prog._seq(a).pages[:3]
    assert prog._seq(b).pages[3] != prog._seq(a).pages[3]  # copied on write
    _refs_are_explained(prog, [ckpt])
    run_to_completion(prog, {b: 6})
    assert prog.tokens(b)[len(longer):] == reference_greedy("dense", longer, 6)
    prog.release(a)
    prog.release(b)
    _refs_are_explained(prog, [ckpt])
    prog.release_checkpoint(ckpt)
    s = prog.stats()
    assert s.free_pages == s.total_pages and s.num_checkpoints == 0


def test_checkpoint_after_a_generated_turn_serves_the_next_turn():
    prog = program()
    ids = reference("dense")["token_ids"][2].tolist()
    turn1 = ids[:9]
    a = _admit(prog, turn1, 7)
    run_to_completion(prog, {a: 7})
    history = prog.tokens(a)  # 9 + 7 tokens; the frontier holds all but the last
    ckpt = prog.capture(a)
    assert prog.checkpoint_tokens(ckpt) == tuple(history[:-1])
    prog.release(a)
    turn2 = history + ids[20:25]
    b = _admit(prog, turn2, 5, ckpt)
    run_to_completion(prog, {b: 5})
    assert prog.tokens(b)[len(turn2):] == reference_greedy("dense", turn2, 5)
    prog.release(b)
    with pytest.raises(ResourceError, match="does not start with the tokens"):
        _admit(prog, [1] + turn2[1:], 5, ckpt)
    with pytest.raises(ResourceError, match=r"frontier 15 must be in \[1, prompt_len=15\)"):
        prog.plan_admission(15, 3, ckpt)
    prog.release_checkpoint(ckpt)
    s = prog.stats()
    assert s.free_pages == s.total_pages and s.free_checkpoint_slots == 4
