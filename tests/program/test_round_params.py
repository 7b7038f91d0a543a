"""`round_params` and `round_pools`: a decode round's call passes only the params its
executable reads, and no checkpoint image pools.

Each leaf passed costs the call host time even where the executable never reads it (jax prunes
it from the executable, not from the call), so an unread leaf is a cost on every round.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from ninfer_jax.program.aot import abstract_params, abstract_pools
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.executable_specs import IMAGE_POOLS, program_executables, round_params
from ninfer_jax.program.executables import StepKind, jit_step
from ninfer_jax.testing import tiny_dense
from ninfer_jax.testing.configs import tiny_drafter

PCFG = ProgramConfig(max_concurrency=2, max_seq_len=64, num_pages=16, page_size=8,
                     prefill_chunk=16, num_checkpoint_slots=0, draft_policy="adaptive")

SLOW = pytest.mark.slow


def _setups():
    cfg = tiny_dense(mtp_num_layers=1)
    return {
        "dflash": (tiny_dense(), dataclasses.replace(PCFG, speculative="dflash",
                                                      num_speculative_tokens=4), None),
        "dflash_selector": (tiny_dense(), dataclasses.replace(
            PCFG, speculative="dflash", num_speculative_tokens=4, draft_head="selector"), None),
        "mtp": (cfg, dataclasses.replace(PCFG, speculative="mtp", num_speculative_tokens=2),
                None),
        "mtp_int8": (cfg, dataclasses.replace(PCFG, speculative="mtp",
                                              num_speculative_tokens=2), "int8"),
    }


def _unread(fn, args: tuple, donate: tuple[str, ...]) -> int:
    """How many of the params' leaves (args[0]) the lowered step does not read."""
    lowered = jit_step(fn, args, donate, None).trace(*args).lower()
    kept = lowered._lowering.compile_args["kept_var_idx"]
    return sum(i not in kept for i in range(len(jax.tree.leaves(args[0]))))


# the selector head and int8 weights in the slow tier (~18 s): the same rounds' params, the
# head's and the quantized leaves
@pytest.mark.parametrize("setup", ["dflash", pytest.param("dflash_selector", marks=SLOW), "mtp",
                                   pytest.param("mtp_int8", marks=SLOW)])
def test_every_param_a_decode_round_passes_is_read(setup):
    cfg, pcfg, quantize = _setups()[setup]
    drafter = tiny_drafter(cfg) if pcfg.speculative == "dflash" else None
    params = abstract_params(cfg, pcfg, quantize, drafter)
    pools = abstract_pools(cfg, pcfg, drafter)
    rounds = [s for s in program_executables(cfg, pcfg, params, pools, drafter)
              if s.key.kind is StepKind.DECODE and s.key.batch == 1]
    kinds = {s.key.extra for s in rounds}
    # a verify round of each K, the round of 0 with the upkeep, and the bare one (MTP: lean)
    assert {(0,), (0, 1)} <= kinds and len(kinds) >= 4, kinds
    extra = "dflash" if drafter is not None else "mtp"
    for s in rounds:
        passed = s.args[0]
        assert _unread(s.fn, s.args, s.donate) == 0, s.key
        bare = s.key.extra[1:] == (1,)
        assert (extra in passed) is not bare, s.key
        if s.key.extra[:1] == (0,) and not bare:  # the upkeep reads part of the head/drafter
            assert len(jax.tree.leaves(passed[extra])) < len(jax.tree.leaves(params[extra]))
    # what the selection saves: the same bare round over every param leaves them unread
    bare = next(s for s in rounds if s.key.extra == (0, 1))
    assert _unread(bare.fn, (params, *bare.args[1:]), bare.donate) > 0


def test_round_params_keeps_the_target_and_drops_the_vision_tower():
    params = {"embed": 1, "layers": (2,), "vision": {"w": 3}, "mtp": {"fc": 4}}
    off = dataclasses.replace(PCFG, draft_policy="fixed")
    assert round_params(params, off, 0) == {"embed": 1, "layers": (2,)}
    mtp = dataclasses.replace(off, speculative="mtp", num_speculative_tokens=1)
    assert round_params(params, mtp, 1) == {"embed": 1, "layers": (2,), "mtp": {"fc": 4}}


def test_a_decode_round_passes_no_checkpoint_image_pools():
    """Only the capture, the restore and the image steps touch the checkpoint images' pools; a
    round gets the others, a bare round all but the drafter's rings too (the Program puts
    them back after it, `with_images`)."""
    cfg, pcfg, _ = _setups()["dflash"]
    pcfg = dataclasses.replace(pcfg, num_checkpoint_slots=2)
    drafter = tiny_drafter(cfg)
    pools = abstract_pools(cfg, pcfg, drafter)
    specs = program_executables(cfg, pcfg, abstract_params(cfg, pcfg, None, drafter), pools,
                                drafter)
    rounds = [s for s in specs if s.key.kind is StepKind.DECODE]
    assert rounds
    for s in rounds:
        assert all(getattr(s.args[1], f) is None for f in IMAGE_POOLS), s.key
        bare = s.key.extra[1:] == (1,)
        assert (s.args[1].dk is None) == (s.args[1].dv is None) == bare, s.key
        assert s.args[1].k is not None
    assert any(s.key.extra[1:] == (1,) for s in rounds)
    capture = next(s for s in specs if s.key.kind is StepKind.CAPTURE)
    assert all(getattr(capture.args[0], f) is not None for f in IMAGE_POOLS)


@pytest.mark.parametrize("setup", ["dflash", "mtp"])
def test_rounds_of_0_commit_and_return_one_token_a_row(setup):
    """A round of 0 (with the upkeep, bare or lean) takes a commit of one token a row and
    returns [B, 1], as a Program without speculation does; a drafting round verify_width."""
    cfg, pcfg, _ = _setups()[setup]
    drafter = tiny_drafter(cfg) if pcfg.speculative == "dflash" else None
    specs = program_executables(cfg, pcfg, abstract_params(cfg, pcfg, None, drafter),
                                abstract_pools(cfg, pcfg, drafter), drafter)
    rounds = [s for s in specs if s.key.kind is StepKind.DECODE]
    assert {s.key.extra[:1] for s in rounds} >= {(0,), ()}
    for s in rounds:
        width = 1 if s.key.extra[:1] == (0,) else pcfg.verify_width
        assert s.args[2].commit.tokens.shape == (s.key.batch, width), s.key
        _, out = jax.eval_shape(s.fn, *s.args)
        assert out.tokens.shape == (s.key.batch, width), s.key
