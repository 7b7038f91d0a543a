"""Checkpoint images: a checkpoint copied to the host (`export_checkpoint`) and back into fresh
pages and a checkpoint slot (`import_checkpoint`) continues exactly as the original, and its
bytes are a function of its tokens alone (what content-addressed store blocks need)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_jax.program.checkpoints import CheckpointImage
from ninfer_jax.program.errors import ResourceError
from tests.models.conftest import reference
from tests.program.conftest import program, reference_greedy, run_to_completion


def _admit(prog, prompt, max_new, source=None):
    return prog.materialize(prog.plan_admission(len(prompt), max_new, source), prompt)


def _checkpoint(prog, prompt, decode_after: int = 0):
    """A checkpoint of `prompt`; its sequence then decodes `decode_after` more tokens into the
    shared last page (the checkpoint must not see them) and is released."""
    a = _admit(prog, prompt, decode_after + 1)
    run_to_completion(prog, {a: 1})
    ckpt = prog.capture(a)
    for _ in range(decode_after):
        prog.commit(prog.decode([a]), [1])
    prog.release(a)
    return ckpt


def _flat(image: CheckpointImage) -> list[bytes]:
    return [b"".join(np.ascontiguousarray(b).tobytes() for b in page) for page in image.pages]


@pytest.mark.parametrize("frontier,extra", [(13, 3), (16, 1), (5, 9)])
def test_an_imported_image_continues_exactly_as_recompute(frontier, extra):
    prog = program()
    ids = reference("dense")["token_ids"][1].tolist()
    base, longer = ids[:frontier], ids[: frontier + extra]
    ckpt = _checkpoint(prog, base, decode_after=2)
    image = prog.export_checkpoint(ckpt)
    prog.release_checkpoint(ckpt)
    free = prog.stats().free_pages
    ckpt = prog.import_checkpoint(image)
    assert prog.checkpoint_tokens(ckpt) == tuple(base)
    assert prog.stats().free_pages == free - len(image.pages)
    b = _admit(prog, longer, 6, ckpt)
    run_to_completion(prog, {b: 6})
    assert prog.tokens(b)[len(longer):] == reference_greedy("dense", longer, 6)
    prog.release(b)
    again = prog.export_checkpoint(ckpt)  # a round trip changes no byte
    assert _flat(again) == _flat(image) and again.state.tobytes() == image.state.tobytes()
    prog.release_checkpoint(ckpt)
    s = prog.stats()
    assert s.free_pages == s.total_pages and s.num_checkpoints == 0


def test_image_bytes_are_a_function_of_the_tokens():
    prog = program()
    ids = reference("dense")["token_ids"][2].tolist()
    short = _checkpoint(prog, ids[:10], decode_after=3)  # pages 0-1 full, page 2 holds 2
    long = _checkpoint(prog, ids[:15], decode_after=1)
    same = _checkpoint(prog, ids[:10], decode_after=0)
    a, b, c = (prog.export_checkpoint(k) for k in (short, long, same))
    assert _flat(a) == _flat(c)  # whatever the sequence wrote after the capture
    assert a.state.tobytes() == c.state.tobytes()
    assert _flat(a)[:2] == _flat(b)[:2]  # shared full pages: the same bytes
    tail = a.pages[2][0]  # [layers, page_size, Hkv, D]: positions 10, 11 are past the frontier
    assert not tail[:, 2:].any() and tail[:, :2].any()
    part = prog.export_checkpoint(long, [1, 3])
    assert [bool(p) for p in part.pages] == [False, True, False, True]
    assert _flat(part)[1] == _flat(b)[1]
    for k in (short, long, same):
        prog.release_checkpoint(k)


def test_a_bad_image_is_refused_and_changes_nothing():
    prog = program()
    ids = reference("dense")["token_ids"][1].tolist()
    ckpt = _checkpoint(prog, ids[:9])
    image = prog.export_checkpoint(ckpt)
    prog.release_checkpoint(ckpt)
    before = prog.stats()
    bad = [
        (CheckpointImage(image.tokens, image.pages[:-1], image.state), "needs 3 pages"),
        (CheckpointImage(image.tokens, [[p[0]] for p in image.pages], image.state),
         "needs 3 pages"),
        (CheckpointImage(image.tokens, image.pages, image.state[:-1]), "state has"),
        (CheckpointImage((10 ** 7,) * 9, image.pages, image.state), "token ids"),
        (CheckpointImage((), [], image.state), "frontier 0"),
    ]
    for img, match in bad:
        with pytest.raises(ResourceError, match=match):
            prog.import_checkpoint(img)
    with pytest.raises(ResourceError, match="out of range"):
        prog.export_checkpoint(prog.import_checkpoint(image), [3])
    assert prog.stats().num_checkpoints == before.num_checkpoints + 1
    for c in prog.checkpoints.records():
        prog.release_checkpoint(c.ckpt)
    assert prog.stats().free_pages == prog.stats().total_pages
