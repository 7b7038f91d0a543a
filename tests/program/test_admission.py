"""Program-owned feasibility (DESIGN §5): `admission` says fits / fits after releasing these
checkpoints / waits; `release_to_fit` names the fewest checkpoints (a prefix of those offered)
whose release frees enough pages, counting a page only when nothing else holds it; and
`backfill_fits` is the backfill proof. On the FakeProgram (the same HostProgram accounting)."""

from __future__ import annotations

from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.testing.fake_program import FakeProgram


def _program() -> FakeProgram:
    return FakeProgram(ProgramLimits(max_seq_len=80, page_size=4, total_pages=20, total_slots=3,
                                     max_concurrency=3, prefill_chunk=8, vocab_size=64,
                                     total_checkpoint_slots=8))


def _two_checkpoints(prog):
    """c1 at frontier 12 (pages 0-2 of a sequence) and c2 at 14 (the same 3 pages and a 4th)."""
    ids = list(range(1, 13))
    h = prog.materialize(prog.plan_admission(len(ids), 8), ids)
    while (batch := prog.prefill(h)) is None:
        pass
    prog.commit(batch, [1])
    c1 = prog.capture(h)
    for _ in range(2):
        prog.commit(prog.decode([h]), [1])
    c2 = prog.capture(h)
    prog.release(h)
    assert len(prog.checkpoint_pages(c1)) == 3 and len(prog.checkpoint_pages(c2)) == 4
    return c1, c2


def test_release_to_fit_counts_only_pages_nothing_else_holds():
    prog = _program()
    c1, c2 = _two_checkpoints(prog)
    assert prog.pages.num_available == 16
    assert prog.release_to_fit(16, [c1, c2]) == ()
    assert prog.release_to_fit(17, [c1, c2]) == (c1, c2)  # c1 alone frees no page: c2 holds them
    assert prog.release_to_fit(17, [c2, c1]) == (c2,)  # c2 alone frees its 4th page
    assert prog.release_to_fit(20, [c2, c1]) == (c2, c1)
    assert prog.release_to_fit(21, [c1, c2]) is None


def test_admission_names_what_to_release_and_then_fits():
    prog = _program()
    c1, c2 = _two_checkpoints(prog)
    answer = prog.admission(40, 28, None, [c1, c2])  # 17 pages
    assert not answer.fits and answer.evict == (c1, c2)
    assert prog.admission(40, 40, None, [c1, c2]).evict == (c1, c2)  # 20 pages: all of them
    assert prog.admission(40, 40, None, [c2]).evict is None  # c1 would still hold 3 pages
    for c in answer.evict:
        prog.release_checkpoint(c)
    again = prog.admission(40, 28)
    assert again.fits and again.plan.num_pages == 17
    prog.materialize(again.plan, list(range(40)))
    # no slot for a 4th sequence: nothing to release would help
    for _ in range(2):
        prog.materialize(prog.plan_admission(1, 1), [1])
    assert prog.admission(1, 1).evict is None


def test_backfill_fits_is_the_proof_from_root():
    prog = _program()
    _two_checkpoints(prog)  # checkpoints do not count: the proof assumes them all released
    assert prog.backfill_fits([(40, 36), (1, 3)])  # 19 + 1 = 20 pages of 20
    assert not prog.backfill_fits([(40, 36), (4, 4)])  # 19 + 2 = 21 pages
    assert not prog.backfill_fits([(1, 1)] * 4)  # 3 slots
