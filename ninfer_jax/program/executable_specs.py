"""What a Program compiles, from shapes alone: the one list of its executables.

Owns the list of (key, step function, example arguments) a Program of (ModelConfig,
ProgramConfig) compiles, in the order of first need (the prefill chunk alone in the foreground,
then the commit, the capture, decode B = 1, the vision buckets, the restore, the checkpoint
images, decode B = 2..max_concurrency, then the rounds of fewer drafts for every B and the
bare or lean rounds of 0, `round_key`). The Program feeds it to its `ExecutableTable`;
`lower_all` and `aot.compile_all` feed it abstract params and pools (`jax.ShapeDtypeStruct`s), so
a GPU build can be lowered or compiled on a host that could not hold the weights. Example
arguments only carry shapes and dtypes: no value here shapes an executable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.dflash.model import context_params
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.mtp import store_params
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.dflash_steps import dflash_verify_step
from ninfer_jax.program.executables import StepKey, StepKind, bind
from ninfer_jax.program.host import GREEDY
from ninfer_jax.program.limits import mask_words
from ninfer_jax.program.pools import Pools, context_ring
from ninfer_jax.program.sampling import sampling_arrays
from ninfer_jax.program.steps import (
    CaptureInputs,
    CommitInputs,
    DecodeInputs,
    PageImport,
    PageRows,
    PrefillInputs,
    RestoreInputs,
    StateImport,
    StateRow,
    VisionEncodeInputs,
    capture_step,
    commit_step,
    decode_step,
    export_pages_step,
    export_state_step,
    import_pages_step,
    import_state_step,
    prefill_step,
    restore_step,
    verify_step,
    vision_encode_step,
)

PAGE_GROUP = 16  # pages per export/import call (a fixed shape: one executable each)


@dataclasses.dataclass(frozen=True)
class ExecutableSpec:
    key: StepKey
    fn: Callable  # the step, its static arguments bound
    args: tuple[Any, ...]  # example arguments: arrays or ShapeDtypeStructs (shapes only)
    background: bool  # False: compiled before the Program serves (the prefill chunk)
    donate: tuple[str, ...] = ("pools",)


def no_commit(pcfg: ProgramConfig, rows: int, width: int | None = None) -> CommitInputs:
    """A commit of `rows` provisional rows that moves nothing: all go to the sink slot.
    `width`: its tokens' (default verify_width; a round of 0's: `round_width`)."""
    return CommitInputs(slots=np.full(rows, pcfg.num_slots, np.int32),
                        tokens=np.zeros((rows, width or pcfg.verify_width), np.int32),
                        num=np.ones(rows, np.int32), count=np.zeros(rows, bool))


def round_width(pcfg: ProgramConfig, drafts: int) -> int:
    """The tokens a decode round of `drafts` drafts gives back a row, and the width of the
    commit it applies first: verify_width for a round that drafts, 1 for a round of 0 (which
    proposes one token; its commit is the round before it's, `Program._take_commit`): a chain
    of rounds of 0 then runs what a Program without speculation runs, its commit and tokens
    no wider (docs/speculative.md, narrow rounds of 0)."""
    return pcfg.verify_width if drafts else 1


def image_pools(pools: Pools) -> list:
    """The checkpoint-slot pools a StateImage holds, in its byte order."""
    parts = [pools.ck_conv, pools.ck_rec, pools.ck_ctx]
    return parts if pools.ck_dk is None else parts + [pools.ck_dk, pools.ck_dv]


def page_parts(pools: Pools, pcfg: ProgramConfig) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each buffer of a page image, in `Pools.kv`'s order: one page in
    every attention layer, [La, page_size, Hkv, D] for K and V (and [La, page_size, Hkv]
    for INT8 pages' K and V scales)."""
    per_layer = pcfg.num_pages + 1
    return [((a.shape[0] // per_layer, *a.shape[1:]), np.dtype(a.dtype)) for a in pools.kv]


def vision_on(cfg: ModelConfig, pcfg: ProgramConfig, params: dict) -> bool:
    """Whether a Program takes images: a tower whose special tokens are in the vocabulary,
    and vision buckets."""
    return cfg.takes_media and "vision" in params and bool(pcfg.vision_buckets)


def program_executables(cfg: ModelConfig, pcfg: ProgramConfig, params: dict, pools: Pools,
                        drafter: DFlashConfig | None = None) -> list[ExecutableSpec]:
    """Every executable a Program of `cfg` and `pcfg` compiles, in compile order. `params` and
    `pools` as the Program holds them (cast, quantized, unstacked for an unrolled layer loop),
    or their abstract shapes."""
    c, w = pcfg.prefill_chunk, pcfg.max_pages_per_seq
    vision = vision_on(cfg, pcfg, params)
    words = mask_words(cfg.vocab_size)

    def sampling(b: int):
        return sampling_arrays([GREEDY] * b, mask_words=words)

    def round_step(k: int, bare: bool = False, lean: bool = False) -> Callable:
        if k == 0:  # in a speculative Program it keeps the drafter's inputs current
            return bind(decode_step, cfg=cfg, pcfg=pcfg, drafter=drafter, bare=bare,
                        lean=lean)
        if pcfg.speculative == "mtp":
            return bind(verify_step, cfg=cfg, pcfg=pcfg, drafts=k)
        return bind(dflash_verify_step, cfg=cfg, pcfg=pcfg, drafter=drafter, drafts=k)

    def decode(b: int, k: int = pcfg.num_speculative_tokens, bare: bool = False,
               lean: bool = False) -> ExecutableSpec:
        example = DecodeInputs(
            commit=no_commit(pcfg, b, round_width(pcfg, k)), token_ids=np.zeros(b, np.int32),
            positions=np.zeros(b, np.int32), slots=np.arange(b, dtype=np.int32),
            page_tables=np.zeros((b, w), np.int32), sampling=sampling(b),
            step_index=np.zeros(b, np.int32), limit=np.ones(b, np.int32),
            rope_delta=np.zeros(b, np.int32) if vision else None,
            context_from=np.zeros(b, np.int32) if reads_ring(pcfg, k) else None)
        return ExecutableSpec(round_key(pcfg, b, k, bare, lean), round_step(k, bare, lean),
                              (round_params(params, pcfg, k, bare), round_pools(pools, bare),
                               example), background=True)

    vision_rows = {}
    if vision:  # MRoPE positions and the vision embeddings at placeholders
        vision_rows = {"rope_positions": np.zeros((3, 1, c), np.int32),
                       "vision_embeds": np.zeros((1, c, cfg.hidden_size),
                                                 np.dtype(params["embed"].dtype)),
                       "vision_mask": np.zeros((1, c), bool)}
    prefill = PrefillInputs(
        commit=no_commit(pcfg, 1), token_ids=np.zeros((1, c), np.int32),
        start_pos=np.zeros(1, np.int32), num_valid=np.ones(1, np.int32),
        page_table=np.zeros((1, w), np.int32), slot=np.zeros(1, np.int32),
        reset=np.ones(1, bool), sampling=sampling(1), step_index=np.zeros(1, np.int32),
        **vision_rows)
    bmax, one = pcfg.max_concurrency, np.zeros(1, np.int32)
    # The prefill first, alone (a compile shares the cores badly), then in the order of first
    # need: the prompt's checkpoint right after its prefill (a commit, then a capture), then
    # decoding one row.
    specs = [
        ExecutableSpec(StepKey(StepKind.PREFILL, 1),
                       bind(prefill_step, cfg=cfg, pcfg=pcfg, drafter=drafter),
                       (params, pools, prefill), background=False),
        ExecutableSpec(StepKey(StepKind.COMMIT, bmax), commit_step,
                       (pools, no_commit(pcfg, bmax)), background=True)]
    if pcfg.num_checkpoint_slots:
        specs.append(ExecutableSpec(
            StepKey(StepKind.CAPTURE, 1), bind(capture_step, pcfg=pcfg, drafter=drafter),
            (pools, CaptureInputs(slot=one, ckpt_slot=one, frontier=one, context_from=one)),
            background=True))
    specs.append(decode(1))
    if vision:  # the vision encoder for each bucket of patches, before a prompt needs it
        v = cfg.vision
        for n in pcfg.vision_buckets:
            specs.append(ExecutableSpec(
                StepKey(StepKind.VISION_ENCODE, 1, n), bind(vision_encode_step, cfg=cfg),
                (params["vision"], VisionEncodeInputs(
                    patches=np.zeros((n, v.patch_dim), np.float32),
                    pos_index=np.zeros((n, 4), np.int32),
                    pos_weight=np.zeros((n, 4), np.float32),
                    rope_hw=np.zeros((n, 2), np.int32), segment=np.zeros(n, np.int32))),
                background=True, donate=()))
    if pcfg.num_checkpoint_slots:
        specs.append(ExecutableSpec(
            StepKey(StepKind.RESTORE, 1), bind(restore_step, pcfg=pcfg),
            (pools, RestoreInputs(ckpt_slot=one, slot=one,
                                  prefix_ids=np.zeros((1, pcfg.max_seq_len), np.int32),
                                  prefix_len=one, copy_src=one, copy_dst=one)),
            background=True))
        specs += _image_executables(pcfg, pools)
    specs += [decode(b) for b in range(2, bmax + 1)]
    specs += [decode(b, k) for b in range(1, bmax + 1) for k in pcfg.round_drafts[:-1]]
    if bare_window(pcfg, drafter):
        specs += [decode(b, 0, bare=True) for b in range(1, bmax + 1)]
    if lean_rounds(pcfg):
        specs += [decode(b, 0, lean=True) for b in range(1, bmax + 1)]
    return specs


def round_params(params: dict, pcfg: ProgramConfig, drafts: int, bare: bool = False) -> dict:
    """The params a decode round of `drafts` drafts reads, which its call passes: each leaf
    passed costs the call host time though the executable never reads it (on XLA:CPU the
    demo's bare DFlash round at B = 4: 544 and 502 µs of the caller's CPU against 608 and 558
    over every param, `scripts/round_call_cost.py`). The target's (not the vision tower's,
    the MTP head's or the drafter's), and the head's or the drafter's for a round that drafts
    (the drafter's candidate selector only with draft_head="selector"); for a round of 0 that
    keeps their context current only what that reads (`mtp.store_params`,
    `dflash.context_params`); for a bare round (it skips that upkeep) none."""
    target = {k: v for k, v in params.items() if k not in ("vision", "mtp", "dflash")}
    extra = pcfg.speculative
    if bare or extra not in ("mtp", "dflash") or extra not in params:
        return target
    if drafts:  # a DFlash drafter's selector only where it draws the drafts
        head = params[extra]
        if extra == "dflash" and pcfg.draft_head != "selector":
            head = {k: v for k, v in head.items() if k != "selector"}
        return {**target, extra: head}
    upkeep = store_params if extra == "mtp" else context_params
    return {**target, extra: upkeep(params[extra])}


# The checkpoint images' pools: only the capture, the restore and the image steps touch them.
IMAGE_POOLS = ("ck_conv", "ck_rec", "ck_ctx", "ck_dk", "ck_dv")


# The drafter's rings: a bare round of 0 neither reads nor writes them (`steps.decode_step`).
RING_POOLS = ("dk", "dv")


def round_pools(pools: Pools, bare: bool = False) -> Pools:
    """The pools a decode round's call passes (donated): all but the checkpoint images', which
    no round touches, and for a `bare` round the drafter's rings (`with_images` puts them
    back); each leaf passed and given back costs the call host time, as `round_params`' do
    (`scripts/round_call_cost.py`)."""
    left = IMAGE_POOLS + (RING_POOLS if bare else ())
    return dataclasses.replace(pools, **dict.fromkeys(left))


def with_images(pools: Pools, held: Pools) -> Pools:
    """A round's `pools` (`round_pools`) with `held`'s pools it did not pass."""
    return dataclasses.replace(pools, **{f: getattr(held, f) for f in IMAGE_POOLS + RING_POOLS
                                         if getattr(pools, f) is None})


def reads_ring(pcfg: ProgramConfig, drafts: int) -> bool:
    """Whether a round of `drafts` drafts reads the drafter's rings (`DecodeInputs.context_from`
    its input): a DFlash round that drafts."""
    return pcfg.speculative == "dflash" and drafts > 0


def lean_rounds(pcfg: ProgramConfig) -> bool:
    """Whether rounds of 0 after a decode round write only their own position's MTP head K/V
    (`decode_step`'s `lean`): an MTP Program that has rounds of 0."""
    return pcfg.speculative == "mtp" and 0 in pcfg.round_drafts


# Rounds of upkeep after an MTP row's last bare round before it drafts again: the head's
# context then holds its last MTP_UPKEEP positions whole (the empty ones before are not read).
MTP_UPKEEP = 8


def bare_window(pcfg: ProgramConfig, drafter: DFlashConfig | None) -> int:
    """W when rounds of 0 may skip the drafter's upkeep (`decode_step`'s `bare`), in an
    adaptive Program: with DFlash whose drafter sees a sliding window of W positions (W rounds
    of upkeep after the last bare one, its context is whole again); with MTP, MTP_UPKEEP (the
    head's last W positions whole again); else 0."""
    if pcfg.draft_policy != "adaptive":
        return 0
    if pcfg.speculative == "mtp":
        return MTP_UPKEEP
    if drafter is None or pcfg.speculative != "dflash":
        return 0
    ring, kept = context_ring(drafter, pcfg)
    return 0 if ring >= pcfg.max_seq_len else kept


def round_key(pcfg: ProgramConfig, batch: int, drafts: int, bare: bool = False,
              lean: bool = False) -> StepKey:
    """The decode round of `batch` rows and `drafts` drafts a row: StepKey(DECODE, B) for the
    Program's num_speculative_tokens, StepKey(DECODE, B, extra=(K,)) for the other
    `round_drafts`, StepKey(DECODE, B, extra=(0, 1)) for a bare round of 0 and (0, 2) for a
    lean one."""
    if bare or lean:
        return StepKey(StepKind.DECODE, batch, extra=(0, 1 if bare else 2))
    if drafts == pcfg.num_speculative_tokens:
        return StepKey(StepKind.DECODE, batch)
    return StepKey(StepKind.DECODE, batch, extra=(drafts,))


def _image_executables(pcfg: ProgramConfig, pools: Pools) -> list[ExecutableSpec]:
    """The copies between checkpoints and the host (the context store's offload/reload)."""
    g, one = PAGE_GROUP, np.zeros(1, np.int32)
    pages = np.zeros(g, np.int32)
    kv = [jax.ShapeDtypeStruct((g, *shape), dtype) for shape, dtype in page_parts(pools, pcfg)]
    image = [jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype) for a in image_pools(pools)]
    return [
        ExecutableSpec(StepKey(StepKind.EXPORT_PAGES, g), bind(export_pages_step, pcfg=pcfg),
                       (pools, PageRows(pages)), background=True),
        ExecutableSpec(StepKey(StepKind.EXPORT_STATE, 1), export_state_step,
                       (pools, StateRow(one)), background=True),
        ExecutableSpec(StepKey(StepKind.IMPORT_PAGES, g), bind(import_pages_step, pcfg=pcfg),
                       (pools, PageImport(pages, *kv)), background=True),
        ExecutableSpec(StepKey(StepKind.IMPORT_STATE, 1), import_state_step,
                       (pools, StateImport(one, *image)), background=True)]
