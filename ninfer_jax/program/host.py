"""The Program's host-side bookkeeping, shared by the device Program and its test double.

Owns (DESIGN §2, §10) the sequences (`sequences.py`) and their committed frontiers, the page
and slot allocators, admission plans sealed against `resource_revision`, growth reservations,
and the rule that one PendingBatch at a time is consumed exactly once. Not the checkpoints:
`self.checkpoints` (`checkpoints.py`) owns their records, slots and page references.
Subclasses supply only the execution (`_run_*`: model steps and checkpoint copies), so the
real Program and `ninfer_jax.testing.FakeProgram` keep identical resource accounting. Imports
no jax.

Lifecycle of a sequence: `plan_admission` (pure, may refuse with numbers) -> `materialize`
(slot + complete growth reservation) -> `prefill` chunk by chunk (the last chunk returns a
PendingBatch with the first token) -> `decode` rounds (PendingBatch) -> `commit` / `abort_pending`
-> `release` (pages and slot back, reservation returned). Capture, restore (`materialize` from
a checkpoint source), export and import of checkpoints: see `checkpoints.py`.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ninfer_jax.program.allocator import PageAllocator, SlotAllocator
from ninfer_jax.program.checkpoints import (
    CheckpointCopies,
    CheckpointId,
    CheckpointImage,
    Checkpoints,
)
from ninfer_jax.program.errors import (
    InfeasibleError,
    PendingBatchError,
    ResourceError,
    StalePlanError,
)
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.program.pending import BatchKind, PendingBatch, SequenceHandle
from ninfer_jax.program.sequences import SeqRecord, SeqState
from ninfer_jax.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class Admission:
    """The Program's answer to "may this sequence start?" (DESIGN §5): `plan` sealed at the
    current revision; `fits` when it can start now; otherwise `evict`: the fewest checkpoints
    of the evictable ones offered (a prefix, in the order offered) whose release makes it fit,
    or None when no release would (it waits for active sequences to finish)."""

    plan: ResourcePlan
    fits: bool
    evict: tuple[CheckpointId, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ResourcePlan:
    """A sealed admission plan: valid only while resource_revision is unchanged."""

    revision: int
    prompt_len: int
    max_new_tokens: int
    num_pages: int  # the complete growth reservation (pages not shared with the source)
    source: CheckpointId | None = None  # materialize from this checkpoint, else from root
    cached_tokens: int = 0  # the source's frontier: positions not prefilled again


@dataclasses.dataclass(frozen=True)
class ProgramStats:
    total_pages: int
    free_pages: int
    reserved_pages: int
    available_pages: int
    total_slots: int
    free_slots: int
    num_sequences: int
    resource_revision: int
    num_checkpoints: int = 0
    free_checkpoint_slots: int = 0
    bare_rounds: int = 0  # decode rounds of 0 that skipped the drafter's upkeep


class HostProgram(CheckpointCopies):
    """Sequences, allocators, plans and PendingBatch rules; execution left to subclasses."""

    def __init__(self, limits: ProgramLimits):
        self.limits = limits
        self.pages = PageAllocator(limits.total_pages)
        self.slots = SlotAllocator(limits.total_slots)
        self.resource_revision = 0
        self._seqs: dict[int, SeqRecord] = {}
        self._ids = itertools.count()
        self.checkpoints = Checkpoints(limits, self.pages, self._ids)
        self._batch_ids = itertools.count()
        self._pending: PendingBatch | None = None
        self.bare_rounds = 0
        # A committed plain decode round whose tokens stay on the device (`commit`): the next
        # round of the same rows takes them there; anything else reads them first (`_resolve`).
        self._unread: PendingBatch | None = None

    # Execution supplied by subclasses --------------------------------------------------------
    @abc.abstractmethod
    def _run_prefill(self, seq: SeqRecord, start: int, chunk: list[int]) -> tuple[int, Any]:
        """Runs one chunk at positions start.. of seq; returns (the token sampled after it, its
        log-probs as PendingBatch takes them, or None when the sequence asked for none)."""

    @abc.abstractmethod
    def _run_decode(self, seqs: list[SeqRecord], limits: np.ndarray,
                    last: Any = None, drafts: int | None = None, bare: bool = False) -> tuple:
        """Starts a round of `drafts` drafts a row (one of `limits.round_drafts`; None: the
        most): row b proposes 1..limits[b] tokens (limits <= drafts + 1). Returns
        (tokens [B, W >= limits], produced [B], log-probs or None: see PendingBatch), and
        optionally a 4th, the round's tokens as [B] (PendingBatch.last: the next round of the
        same rows may then be dispatched before this one's tokens are read); any may be
        an array still being computed that np.asarray waits for. `last`: the rows' last
        tokens as the previous round left them ([B], possibly still on the device), or None
        (each row's `tokens[-1]`). `bare`: a round of 0 that skips the drafter's upkeep
        (`limits.context_window`)."""

    @abc.abstractmethod
    def _run_commit(self, seqs: list[SeqRecord], accepted: np.ndarray, tokens: np.ndarray,
                    count: bool) -> None:
        """Adopts the provisional state after accepted[b] positions of row b (0: the row is
        rejected); its first accepted[b] tokens ([B, W], W >= accepted) count toward penalties
        when `count`."""

    def _prepare_media(self, prompt_ids: list[int], media: Sequence) -> tuple:
        """(RopeIndex, placeholder positions [M], each medium's first placeholder position)
        for a prompt with images/videos; raises InfeasibleError when they do not fit."""
        raise InfeasibleError("this Program takes no images or videos")

    def check_media(self, prompt_ids: Sequence[int], media: Sequence) -> None:
        """Raises InfeasibleError unless a prompt with these images/videos can be admitted
        (what `materialize` would refuse about them), naming why."""
        self._prepare_media([int(t) for t in prompt_ids], tuple(media))

    def _run_encode(self, seq: SeqRecord) -> Any:
        """The vision embeddings [M, H] of the sequence's media."""
        raise InfeasibleError("this Program takes no images or videos")

    def close(self) -> None:
        """Releases what the execution side holds beyond its pools (nothing by default)."""

    def wait_compiled(self, progress: bool | None = False) -> None:
        """Returns once every step executable is compiled (the host side compiles none)."""

    def hold_compiles(self, held: bool) -> None:
        """While held, background compiles of executables no step has asked for wait (the
        Engine holds them while it serves requests); the host side compiles none."""

    def warm_up_next(self) -> bool:
        """Runs one step executable that no step ran yet, touching no sequence's state (the
        Engine calls it while idle); True if it ran one. The host side has none."""
        return False

    # Feasibility and admission -------------------------------------------------------------
    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return -(-(prompt_len + max_new_tokens) // self.limits.page_size)

    def check_admissible(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raises InfeasibleError (with the numbers) for what could never run, even from root
        with everything free. Reads only static limits, so any thread may call it."""
        lim = self.limits
        if prompt_len < 1:
            raise InfeasibleError(f"prompt_len must be >= 1, got {prompt_len}")
        if max_new_tokens < 1:
            raise InfeasibleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        total = prompt_len + max_new_tokens
        if total > lim.max_seq_len:
            raise InfeasibleError(
                f"prompt_len {prompt_len} + max_new_tokens {max_new_tokens} = {total} exceeds "
                f"max_seq_len {lim.max_seq_len}")
        need = self.pages_needed(prompt_len, max_new_tokens)
        if need > lim.total_pages:
            raise InfeasibleError(
                f"prompt_len {prompt_len} + max_new_tokens {max_new_tokens} needs {need} pages "
                f"of {lim.page_size}; the pool has {lim.total_pages} in total")

    def plan_admission(self, prompt_len: int, max_new_tokens: int,
                       source: CheckpointId | None = None) -> ResourcePlan:
        """Seals a plan for a new sequence, from root or from checkpoint `source` (whose
        frontier must be below prompt_len: the last prompt token is always prefilled)."""
        self.check_admissible(prompt_len, max_new_tokens)
        need = self.pages_needed(prompt_len, max_new_tokens)
        if source is None:
            return ResourcePlan(self.resource_revision, prompt_len, max_new_tokens, need)
        frontier = self.checkpoints.record(source).frontier
        if not 1 <= frontier < prompt_len:
            raise ResourceError(
                f"checkpoint frontier {frontier} must be in [1, prompt_len={prompt_len})")
        return ResourcePlan(self.resource_revision, prompt_len, max_new_tokens,
                            need - self.checkpoints.shared_pages(frontier), source, frontier)

    def admission(self, prompt_len: int, max_new_tokens: int,
                  source: CheckpointId | None = None,
                  evictable: Sequence[CheckpointId] = ()) -> Admission:
        """Plans a sequence (see plan_admission) and says whether it fits now, after releasing
        some of the `evictable` checkpoints (never `source`), or not until capacity is freed."""
        plan = self.plan_admission(prompt_len, max_new_tokens, source)
        if self.can_start(plan):
            return Admission(plan, True)
        evict = self.release_to_fit(plan.num_pages, [c for c in evictable if c != source])
        return Admission(plan, False, evict)

    def release_to_fit(self, num_pages: int, evictable: Sequence[CheckpointId]
                       ) -> tuple[CheckpointId, ...] | None:
        """The fewest checkpoints, a prefix of `evictable`, whose release leaves a free slot
        and `num_pages` unpromised pages (() when they are there already), or None."""
        if not self.slots.num_free:
            return None
        short = num_pages - self.pages.num_available
        return () if short <= 0 else self.checkpoints.release_to_free(short, evictable)

    def backfill_fits(self, sequences: Sequence[tuple[int, int]]) -> bool:
        """The backfill proof (DESIGN §5): sequences of these (prompt_len, max_new_tokens) could
        all hold their full reservations at once, from root, with every checkpoint released."""
        pages = sum(self.pages_needed(p, m) for p, m in sequences)
        return pages <= self.limits.total_pages and len(sequences) <= self.limits.total_slots

    def can_start(self, plan: ResourcePlan) -> bool:
        """Whether `plan` can be materialized now (fresh, a free slot, enough unpromised pages)."""
        return (plan.revision == self.resource_revision and self.slots.num_free > 0
                and self.pages.num_available >= plan.num_pages)

    def materialize(self, plan: ResourcePlan, prompt_ids: Sequence[int],
                    sampling: SamplingParams = GREEDY,
                    stop_ids: Sequence[int] = (), media: Sequence = ()) -> SequenceHandle:
        """Creates a sequence from root holding its complete growth reservation. `stop_ids`:
        the ids that end its output (the Engine's), never sampled before `sampling.min_tokens`
        generated tokens. `media`: the prompt's images and videos (`frontend.vision
        .VisionInput`, in the order of their placeholder runs)."""
        if plan.revision != self.resource_revision:
            raise StalePlanError(
                f"plan sealed at revision {plan.revision}, Program is at {self.resource_revision}")
        if len(prompt_ids) != plan.prompt_len:
            raise ResourceError(f"plan is for {plan.prompt_len} prompt tokens, got {len(prompt_ids)}")
        ids = [int(t) for t in prompt_ids]
        if min(ids) < 0 or max(ids) >= self.limits.vocab_size:
            raise InfeasibleError(f"prompt token ids must be in [0, {self.limits.vocab_size})")
        if not isinstance(sampling, SamplingParams):
            raise InfeasibleError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.temperature > 0 and sampling.seed is None:
            raise InfeasibleError("sampling.seed is required when temperature > 0")
        stop_ids = tuple(int(t) for t in stop_ids)
        if any(not 0 <= t < self.limits.vocab_size for t in stop_ids):
            raise InfeasibleError(f"stop ids must be in [0, {self.limits.vocab_size})")
        media = tuple(media)
        vision = self._prepare_media(ids, media) if media else (None, None, ())
        if not self.can_start(plan):
            raise ResourceError(
                f"plan cannot start now: {self.slots.num_free} free slots, "
                f"{self.pages.num_available} available pages, {plan.num_pages} needed")
        ckpt = (None if plan.source is None
                else self.checkpoints.source(plan.source, ids, media, vision[2]))
        slot = self.slots.allocate()
        self.pages.reserve(plan.num_pages)
        handle = SequenceHandle(next(self._ids), self.resource_revision)
        seq = SeqRecord(handle=handle, slot=slot, tokens=ids, prompt_len=len(ids),
                        max_new_tokens=plan.max_new_tokens, sampling=sampling,
                        reserved=plan.num_pages, stop_ids=stop_ids, media=media,
                        rope=vision[0], vision_at=vision[1], media_starts=tuple(vision[2]))
        self._seqs[handle.seq_id] = seq
        if ckpt is not None:  # restore: share its pages, copy the one after them on write
            seq.pages = self.checkpoints.share(ckpt)
            shared = len(seq.pages)
            self._grow(seq, ckpt.frontier)
            copy_page = (ckpt.pages[shared], seq.pages[-1]) if len(seq.pages) > shared else None
            seq.frontier = ckpt.frontier
            self._run_restore(ckpt, seq, copy_page)
        self.resource_revision += 1
        return handle

    # Checkpoints: owned by `self.checkpoints` (checkpoints.py) -------------------------------
    def can_capture(self) -> bool:
        return self.checkpoints.can_capture()

    def reserve_publication(self, handle: SequenceHandle) -> bool:
        """`Checkpoints.reserve_publication` for a live sequence; the slot is released with
        the sequence if unused."""
        return self.checkpoints.reserve_publication(self._seq(handle).handle)

    def has_publication_slot(self, handle: SequenceHandle) -> bool:
        return self.checkpoints.has_publication_slot(self._seq(handle).handle)

    def capture(self, handle: SequenceHandle, *, publication: bool = False) -> CheckpointId:
        """Checkpoints a sequence at its committed frontier (its tokens minus the last one
        sampled, whose effect is not yet in the state). Needs a free checkpoint slot, or with
        `publication` the one the sequence reserved."""
        self._resolve()
        seq = self._seq(handle)
        if self._pending is not None and handle in self._pending.handles:
            raise PendingBatchError(f"capture of {handle} while its PendingBatch is unconsumed")
        if seq.state not in (SeqState.ACTIVE, SeqState.PREFILL) or seq.frontier < 1:
            raise ResourceError(f"{handle} has no committed frontier to capture")
        ckpt = self.checkpoints.capture(handle, seq.tokens[: seq.frontier], seq.pages,
                                        seq.media_before(seq.frontier), publication,
                                        lambda slot: self._run_capture(seq, slot))
        self.resource_revision += 1
        return ckpt

    def export_checkpoint(self, ckpt_id: CheckpointId,
                          pages: Sequence[int] | None = None) -> CheckpointImage:
        """The checkpoint's pages (all, or the listed page indices) and state image on the host.
        Waits for the copies; the checkpoint stays as it was."""
        self._check_idle()
        return self.checkpoints.export(ckpt_id, pages, self._run_export)

    def can_import(self, frontier: int) -> bool:
        return self.checkpoints.can_import(frontier)

    def import_checkpoint(self, image: CheckpointImage) -> CheckpointId:
        """A new checkpoint holding `image` (a reload from the context store)."""
        self._check_idle()
        ckpt = self.checkpoints.import_image(image, self._run_import)
        self.resource_revision += 1
        return ckpt

    def release_checkpoint(self, ckpt_id: CheckpointId) -> None:
        self.checkpoints.release(ckpt_id)
        self.resource_revision += 1

    def checkpoint_footprint(self) -> tuple[int, int]:
        return self.checkpoints.footprint()

    def checkpoint_tokens(self, ckpt_id: CheckpointId) -> tuple[int, ...]:
        return self.checkpoints.record(ckpt_id).tokens

    def checkpoint_pages(self, ckpt_id: CheckpointId) -> tuple[int, ...]:
        return tuple(self.checkpoints.record(ckpt_id).pages)

    def release(self, handle: SequenceHandle) -> None:
        """Returns a sequence's pages, unused reservation and slot. Not while it is pending."""
        self._resolve()
        seq = self._seq(handle)
        if self._pending is not None and handle in self._pending.handles:
            raise PendingBatchError(f"release of {handle} while its PendingBatch is unconsumed")
        for page in seq.pages:
            self.pages.decref(page)
        self.pages.unreserve(seq.reserved)
        self.slots.release(seq.slot)
        self.checkpoints.drop_publication(handle)
        del self._seqs[handle.seq_id]
        self.resource_revision += 1

    # Execution -----------------------------------------------------------------------------
    def prefill(self, handle: SequenceHandle, stop_at: int | None = None,
                mask: np.ndarray | None = None) -> PendingBatch | None:
        """Runs the next prefill chunk; the last one returns the PendingBatch of the first token.
        `stop_at` (a position inside the prompt): a chunk that would pass it ends there, so the
        sequence can be captured at that frontier. `mask`: the tokens the first generated token
        may be ([mask_words] uint32 bitmask; None: any)."""
        self._check_idle()
        self._resolve()
        seq = self._seq(handle)
        checked = self._check_mask(mask)
        if seq.state is not SeqState.PREFILL:
            raise ResourceError(f"{handle} is not prefilling")
        seq.mask = checked
        start = seq.frontier
        end = start + self.limits.prefill_chunk
        if stop_at is not None and start < stop_at < min(end, seq.prompt_len):
            end = stop_at
        chunk = seq.tokens[start:end]
        if seq.media and seq.vision_embeds is None and np.any(
                (seq.vision_at >= start) & (seq.vision_at < start + len(chunk))):
            seq.vision_embeds = self._run_encode(seq)
        self._grow(seq, start + len(chunk))
        token, logprobs = self._run_prefill(seq, start, chunk)
        if start + len(chunk) < seq.prompt_len:  # not the last chunk: adopt its state now
            self._run_commit([seq], np.ones(1, np.int32),
                             np.zeros((1, self.limits.verify_width), np.int32), count=False)
            seq.frontier = start + len(chunk)
            return None
        tokens = np.array([[token]], np.int32)
        self._pending = PendingBatch(BatchKind.PREFILL, (handle,), tokens, next(self._batch_ids),
                                     logprobs=logprobs)
        return self._pending

    def decode(self, handles: Sequence[SequenceHandle],
               caps: Sequence[int | None] | None = None,
               masks: Sequence[np.ndarray | None] | None = None,
               drafts: int | None = None, bare: bool = False) -> PendingBatch:
        """A round for each of the B decode-ready sequences (exact B, no padding): one token
        per row, or with speculation up to drafts + 1 (`drafts`: one of limits.round_drafts,
        None: the most; never past a row's max_new_tokens, nor
        past caps[b] when given: the Engine's limit before the row's next forced control).
        `masks[b]`: the tokens row b's next token may be (a [mask_words] uint32 bitmask, or
        None: any); a masked row proposes exactly one token (drafting is off for it).
        `bare`: a round of 0 may skip the drafter's upkeep (with `limits.context_window`, once
        that round is compiled, and with MTP when every row's last step was a decode round;
        else ignored): the same tokens, and the rows' drafter contexts lack this position
        (DFlash: a block reads a row's ring only past its last bare round, the whole window
        once `context_stale` rounds of upkeep ran; MTP: for good, the head's attention skips
        it) with `context_stale` rounds of upkeep to go."""
        self._check_idle()
        seqs = [self._seq(h) for h in handles]
        if caps is not None and len(caps) != len(seqs):
            raise PendingBatchError(f"decode of {len(seqs)} rows got {len(caps)} caps")
        if masks is not None and len(masks) != len(seqs):
            raise PendingBatchError(f"decode of {len(seqs)} rows got {len(masks)} masks")
        checked = [self._check_mask(m) for m in (masks or [None] * len(seqs))]
        drafts = self.limits.round_drafts[-1] if drafts is None else drafts
        if drafts not in self.limits.round_drafts:
            raise PendingBatchError(f"drafts must be one of the compiled round_drafts "
                                    f"{self.limits.round_drafts}, got {drafts!r}")
        if not seqs or len({s.handle.seq_id for s in seqs}) != len(seqs):
            raise PendingBatchError(f"decode needs distinct sequences, got {list(handles)}")
        if len(seqs) > self.limits.max_concurrency:
            raise PendingBatchError(
                f"decode of {len(seqs)} rows exceeds max_concurrency {self.limits.max_concurrency}")
        # MTP: the entry at frontier - 1 is written by the round after a prefill or a
        # verify, never left as the pages held it
        bare = bool(bare) and drafts == 0 and self.limits.context_window > 0 \
            and (self.limits.speculative != "mtp" or all(s.after_decode for s in seqs)) \
            and self.round_ready(0, len(seqs), bare=True)
        self.bare_rounds += bare
        limits = np.zeros(len(seqs), np.int32)
        for i, s in enumerate(seqs):
            if s.state is not SeqState.ACTIVE:
                raise ResourceError(f"{s.handle} is not decode-ready")
            if s.generated >= s.max_new_tokens:
                raise ResourceError(f"{s.handle} already generated its {s.max_new_tokens} tokens")
            limits[i] = min(drafts + 1, s.max_new_tokens - s.generated)
            cap = None if caps is None else caps[i]
            if cap is not None:
                if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
                    raise ResourceError(f"decode cap of row {i} must be an int >= 1, got {cap!r}")
                limits[i] = min(int(limits[i]), int(cap))
            if checked[i] is not None:
                limits[i] = 1
        last = None
        if self._unread is not None and self._unread.handles == tuple(handles):
            last = self._unread.last  # chained: the previous round's, where it left them
        else:
            self._resolve()
        for i, s in enumerate(seqs):
            s.mask = checked[i]
            self._grow(s, s.frontier + int(limits[i]))
            if bare:  # no block reads its ring up to here (even if the round is dropped)
                s.context_from = s.frontier + 1
        # The step runs on the device after this returns; reading batch.tokens waits for it.
        tokens, produced, logprobs, *ids = self._run_decode(seqs, limits, last, drafts, bare)
        self._pending = PendingBatch(BatchKind.DECODE, tuple(handles), tokens,
                                     next(self._batch_ids), produced, logprobs,
                                     last=ids[0] if ids else None)
        return self._pending

    def round_ready(self, drafts: int, batch: int, bare: bool = False) -> bool:
        """Whether a decode round of `drafts` drafts and `batch` rows (`bare`: the round of 0
        that skips the drafter's upkeep) runs without waiting for its compile (any thread)."""
        return True

    def context_stale(self, handle: SequenceHandle) -> int:
        """Rounds of upkeep until the sequence's drafter context is whole again after its last
        bare round (MTP: over its last `limits.context_window` positions) (0: whole; always 0
        without `limits.context_window`). What a restored
        checkpoint's context lacks is not counted: its blocks still read only written
        entries."""
        s = self._seq(handle)
        if not s.context_from:
            return 0
        return max(0, s.context_from + self.limits.context_window - s.frontier)

    def control(self, handle: SequenceHandle, forced: Sequence[int],
                mask: np.ndarray | None = None) -> PendingBatch:
        """Forced control (DESIGN §3 ControlReady): runs `forced` (the Frontend's tokens, never
        sampled) after the sequence's last token and samples the token after them. Returns a
        CONTROL PendingBatch with that one candidate; committing it adopts the forced tokens
        and the candidate together. The draw is keyed by its position, so it is the token a
        sequence whose prompt already held the forced tokens would draw there. `mask`: the
        tokens the one after the forced ones may be (None: any)."""
        self._check_idle()
        self._resolve()
        seq = self._seq(handle)
        checked = self._check_mask(mask)
        if seq.state is not SeqState.ACTIVE:
            raise ResourceError(f"{handle} is not decode-ready")
        ids = [int(t) for t in forced]
        if not ids or min(ids) < 0 or max(ids) >= self.limits.vocab_size:
            raise ResourceError(f"forced tokens must be 1 or more ids in [0, "
                                f"{self.limits.vocab_size}), got {ids[:8]}")
        if seq.generated + len(ids) + 1 > seq.max_new_tokens:
            raise ResourceError(
                f"{handle}: {len(ids)} forced tokens and the one after them exceed max_new_tokens "
                f"{seq.max_new_tokens} ({seq.generated} generated)")
        chunk = [seq.tokens[-1], *ids]  # the last token is not in the state yet
        if len(chunk) > self.limits.prefill_chunk:
            raise ResourceError(f"{len(ids)} forced tokens exceed the prefill chunk "
                                f"{self.limits.prefill_chunk} (minus the last token)")
        seq.mask = checked
        self._grow(seq, seq.frontier + len(chunk))
        token, logprobs = self._run_prefill(seq, seq.frontier, chunk)
        self._pending = PendingBatch(BatchKind.CONTROL, (handle,), np.array([[token]], np.int32),
                                     next(self._batch_ids), logprobs=logprobs, forced=tuple(ids))
        return self._pending

    def commit(self, batch: PendingBatch, accepted: Sequence[int]) -> None:
        """Adopts each row's accepted prefix of its provisional tokens (0 = cancelled row)."""
        if batch is not self._pending:
            raise PendingBatchError(f"{batch!r} is not the Program's pending batch")
        acc = batch.check_decisions(accepted)
        batch.consume()
        self._pending = None
        self._resolve()
        seqs = [self._seq(h) for h in batch.handles]
        if (batch.last is not None and not batch.tokens_read
                and bool((acc == 1).all())):
            # Every row takes its one token: commit without waiting for the step; the tokens
            # stay where it left them until read (`_resolve`) or taken by the next round.
            self._run_commit(seqs, acc.astype(np.int32), batch.raw_tokens, count=True)
            for seq in seqs:
                seq.frontier += 1
                seq.unread += 1
                seq.state = SeqState.ACTIVE
                seq.after_decode = True
            self._unread = batch
            return
        self._run_commit(seqs, acc.astype(np.int32), batch.tokens, count=True)
        for seq, a, toks in zip(seqs, acc, batch.tokens):
            if a == 0:
                continue
            if batch.kind is BatchKind.PREFILL:
                seq.frontier = seq.prompt_len
            elif batch.kind is BatchKind.CONTROL:  # the last token and the forced ones
                seq.frontier += 1 + len(batch.forced)
                seq.tokens.extend(batch.forced)
            else:
                seq.frontier += a
            seq.tokens.extend(int(t) for t in toks[:a])
            seq.state = SeqState.ACTIVE
            seq.after_decode = batch.kind is BatchKind.DECODE

    def abort_pending(self, batch: PendingBatch) -> None:
        """Drops the batch: committed state stays exactly as before the step."""
        if batch is not self._pending:
            raise PendingBatchError(f"{batch!r} is not the Program's pending batch")
        batch.consume()
        self._pending = None

    # Queries -------------------------------------------------------------------------------
    def tokens(self, handle: SequenceHandle) -> list[int]:
        self._resolve()
        return list(self._seq(handle).tokens)

    def num_generated(self, handle: SequenceHandle) -> int:
        return self._seq(handle).generated

    def frontier(self, handle: SequenceHandle) -> int:
        """Positions whose effect the sequence's state holds (what `capture` would keep)."""
        return self._seq(handle).frontier

    def is_prefilling(self, handle: SequenceHandle) -> bool:
        return self._seq(handle).state is SeqState.PREFILL

    @property
    def pending(self) -> PendingBatch | None:
        return self._pending

    def handles(self) -> list[SequenceHandle]:
        return [s.handle for s in self._seqs.values()]

    def stats(self) -> ProgramStats:
        return ProgramStats(
            total_pages=self.pages.num_pages, free_pages=self.pages.num_free,
            reserved_pages=self.pages.num_reserved, available_pages=self.pages.num_available,
            total_slots=self.slots.num_slots, free_slots=self.slots.num_free,
            num_sequences=len(self._seqs), resource_revision=self.resource_revision,
            num_checkpoints=len(self.checkpoints),
            free_checkpoint_slots=self.checkpoints.num_free_slots, bare_rounds=self.bare_rounds)

    # Internals -----------------------------------------------------------------------------
    def _seq(self, handle: SequenceHandle) -> SeqRecord:
        seq = self._seqs.get(handle.seq_id)
        if seq is None or (seq.handle is not handle and seq.handle != handle):
            raise ResourceError(f"unknown or stale sequence handle {handle}")
        return seq

    def _check_mask(self, mask: np.ndarray | None) -> np.ndarray | None:
        """A token mask as the steps take it (or None); a wrong shape or dtype, or a mask that
        allows nothing, is refused."""
        if mask is None:
            return None
        mask = np.asarray(mask)
        if mask.shape != (self.limits.mask_words,) or mask.dtype != np.uint32:
            raise ResourceError(f"a token mask must be [{self.limits.mask_words}] uint32, got "
                                f"{mask.shape} {mask.dtype}")
        if not mask.any():
            raise ResourceError("a token mask must allow at least one token")
        return mask

    def _resolve(self) -> None:
        """Appends the tokens of a round committed unread (`commit`) to its sequences (reading
        them waits for its step)."""
        batch, self._unread = self._unread, None
        if batch is None:
            return
        for handle, token in zip(batch.handles, batch.tokens[:, 0].tolist()):
            seq = self._seqs[handle.seq_id]
            seq.tokens.append(token)
            seq.unread -= 1

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise PendingBatchError(f"{self._pending!r} must be committed or aborted first")

    def _grow(self, seq: SeqRecord, num_positions: int) -> None:
        """Draws pages from the sequence's reservation until `num_positions` fit."""
        while len(seq.pages) * self.limits.page_size < num_positions:
            if seq.reserved == 0:
                raise ResourceError(f"{seq.handle} outgrew its reservation")
            seq.pages.append(self.pages.allocate_reserved())
            seq.reserved -= 1
