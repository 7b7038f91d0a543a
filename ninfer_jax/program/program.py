"""Program: the only entry to physical execution for one model package (DESIGN §2, §10).

Owns the pools, the page and slot allocators, the active sequences with their committed
frontiers, resource plans sealed against `resource_revision`, the compiled step table, and the
one PendingBatch in flight. It knows nothing of requests, queues, text or users.

Lifecycle of a sequence: `plan_admission` (pure, may refuse with numbers) -> `materialize`
(slot + complete growth reservation) -> `prefill` chunk by chunk (the last chunk returns a
PendingBatch with the first token) -> `decode` rounds (PendingBatch) -> `commit` / `abort_pending`
-> `release` (pages and slot back, reservation returned).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Sequence

import jax
import numpy as np

from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.allocator import PageAllocator, SlotAllocator
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.errors import (
    InfeasibleError, PendingBatchError, ResourceError, StalePlanError,
)
from ninfer_jax.program.executables import ExecutableTable, StepKey, StepKind, bind
from ninfer_jax.program.pending import BatchKind, PendingBatch, SequenceHandle
from ninfer_jax.program.pools import Pools
from ninfer_jax.program.sampling import SamplingParams, sampling_arrays

GREEDY = SamplingParams(temperature=0.0)
from ninfer_jax.program.steps import (
    CommitInputs, DecodeInputs, PrefillInputs, commit_step, decode_step, prefill_step,
)


class SeqState(enum.Enum):
    PREFILL = "prefill"  # consuming its prompt in chunks
    ACTIVE = "active"  # decode-ready: its last token is committed output not yet in the state


@dataclasses.dataclass(frozen=True)
class ResourcePlan:
    """A sealed admission plan: valid only while Program's resource_revision is unchanged."""

    revision: int
    prompt_len: int
    max_new_tokens: int
    num_pages: int  # the complete growth reservation


@dataclasses.dataclass
class _Sequence:
    handle: SequenceHandle
    slot: int
    tokens: list[int]  # committed tokens: prompt, then generated
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    reserved: int  # pages still reserved (not yet allocated) for this sequence
    pages: list[int] = dataclasses.field(default_factory=list)
    frontier: int = 0  # positions whose K/V and GDN effect are committed
    state: SeqState = SeqState.PREFILL

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


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


class Program:
    """Pools, allocators, sequences and the compiled steps of one model package."""

    def __init__(self, cfg: ModelConfig, params: dict, pcfg: ProgramConfig):
        if pcfg.max_seq_len > cfg.max_position_embeddings:
            raise InfeasibleError(
                f"max_seq_len {pcfg.max_seq_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}")
        self.cfg, self.pcfg = cfg, pcfg
        self.params = jax.tree.map(lambda a: jax.numpy.asarray(a, pcfg.dtype), params)
        self.pools = Pools.allocate(cfg, pcfg)
        self.pages = PageAllocator(pcfg.num_pages)
        self.slots = SlotAllocator(pcfg.num_slots)
        self.resource_revision = 0
        self._seqs: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._batch_ids = itertools.count()
        self._pending: PendingBatch | None = None
        self.executables = ExecutableTable()
        self._compile_all()

    # Start-up ------------------------------------------------------------------------------
    def _compile_all(self) -> None:
        cfg, pcfg = self.cfg, self.pcfg
        prefill = bind(prefill_step, cfg=cfg, pcfg=pcfg)
        decode = bind(decode_step, cfg=cfg, pcfg=pcfg)
        self.executables.compile(StepKey(StepKind.PREFILL, 1), prefill, self.params, self.pools,
                                 self._prefill_inputs_example())
        for b in range(1, pcfg.max_concurrency + 1):
            self.executables.compile(StepKey(StepKind.DECODE, b), decode, self.params, self.pools,
                                     self._decode_inputs_example(b))
            self.executables.compile(StepKey(StepKind.COMMIT, b), commit_step, self.pools,
                                     _commit_inputs(np.zeros(b, np.int32), np.zeros(b, bool),
                                                    np.zeros(b, np.int32), np.zeros(b, bool)))

    def _prefill_inputs_example(self) -> PrefillInputs:
        c, w = self.pcfg.prefill_chunk, self.pcfg.max_pages_per_seq
        return PrefillInputs(
            token_ids=np.zeros((1, c), np.int32), start_pos=np.zeros(1, np.int32),
            num_valid=np.ones(1, np.int32), page_table=np.zeros((1, w), np.int32),
            slot=np.zeros(1, np.int32), reset=np.ones(1, bool),
            sampling=sampling_arrays([GREEDY]), step_index=np.zeros(1, np.int32))

    def _decode_inputs_example(self, b: int) -> DecodeInputs:
        w = self.pcfg.max_pages_per_seq
        return DecodeInputs(
            token_ids=np.zeros(b, np.int32), positions=np.zeros(b, np.int32),
            slots=np.arange(b, dtype=np.int32), page_tables=np.zeros((b, w), np.int32),
            sampling=sampling_arrays([GREEDY] * b), step_index=np.zeros(b, np.int32))

    # Feasibility and admission -------------------------------------------------------------
    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return -(-(prompt_len + max_new_tokens) // self.pcfg.page_size)

    def plan_admission(self, prompt_len: int, max_new_tokens: int) -> ResourcePlan:
        """Seals a plan for a new sequence from root; refuses what can never run, with numbers."""
        if prompt_len < 1:
            raise InfeasibleError(f"prompt_len must be >= 1, got {prompt_len}")
        if max_new_tokens < 1:
            raise InfeasibleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        total = prompt_len + max_new_tokens
        if total > self.pcfg.max_seq_len:
            raise InfeasibleError(
                f"prompt_len {prompt_len} + max_new_tokens {max_new_tokens} = {total} exceeds "
                f"max_seq_len {self.pcfg.max_seq_len}")
        need = self.pages_needed(prompt_len, max_new_tokens)
        if need > self.pages.num_pages:
            raise InfeasibleError(
                f"prompt_len {prompt_len} + max_new_tokens {max_new_tokens} needs {need} pages "
                f"of {self.pcfg.page_size}; the pool has {self.pages.num_pages} in total")
        return ResourcePlan(self.resource_revision, prompt_len, max_new_tokens, need)

    def can_start(self, plan: ResourcePlan) -> bool:
        """Whether `plan` can be materialized now (fresh, a free slot, enough unpromised pages)."""
        return (plan.revision == self.resource_revision and self.slots.num_free > 0
                and self.pages.num_available >= plan.num_pages)

    def materialize(self, plan: ResourcePlan, prompt_ids: Sequence[int],
                    sampling: SamplingParams = GREEDY) -> SequenceHandle:
        """Creates a sequence from root holding its complete growth reservation."""
        if plan.revision != self.resource_revision:
            raise StalePlanError(
                f"plan sealed at revision {plan.revision}, Program is at {self.resource_revision}")
        if len(prompt_ids) != plan.prompt_len:
            raise ResourceError(f"plan is for {plan.prompt_len} prompt tokens, got {len(prompt_ids)}")
        ids = [int(t) for t in prompt_ids]
        if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
            raise InfeasibleError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if not isinstance(sampling, SamplingParams):
            raise InfeasibleError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not self.can_start(plan):
            raise ResourceError(
                f"plan cannot start now: {self.slots.num_free} free slots, "
                f"{self.pages.num_available} available pages, {plan.num_pages} needed")
        slot = self.slots.allocate()
        self.pages.reserve(plan.num_pages)
        handle = SequenceHandle(next(self._ids), self.resource_revision)
        self._seqs[handle.seq_id] = _Sequence(
            handle=handle, slot=slot, tokens=ids, prompt_len=len(ids),
            max_new_tokens=plan.max_new_tokens, sampling=sampling, reserved=plan.num_pages)
        self.resource_revision += 1
        return handle

    def release(self, handle: SequenceHandle) -> None:
        """Returns a sequence's pages, unused reservation and slot. Not while it is pending."""
        seq = self._seq(handle)
        if self._pending is not None and handle in self._pending.handles:
            raise PendingBatchError(f"release of {handle} while its PendingBatch is unconsumed")
        for page in seq.pages:
            self.pages.decref(page)
        self.pages.unreserve(seq.reserved)
        self.slots.release(seq.slot)
        del self._seqs[handle.seq_id]
        self.resource_revision += 1

    # Execution -----------------------------------------------------------------------------
    def prefill(self, handle: SequenceHandle) -> PendingBatch | None:
        """Runs the next prefill chunk; the last one returns the PendingBatch of the first token."""
        self._check_idle()
        seq = self._seq(handle)
        if seq.state is not SeqState.PREFILL:
            raise ResourceError(f"{handle} is not prefilling")
        c = self.pcfg.prefill_chunk
        start = seq.frontier
        chunk = seq.tokens[start : start + c]
        n = len(chunk)
        self._grow(seq, start + n)
        inputs = PrefillInputs(
            token_ids=np.array([chunk + [0] * (c - n)], np.int32),
            start_pos=np.array([start], np.int32), num_valid=np.array([n], np.int32),
            page_table=self._page_table([seq]), slot=np.array([seq.slot], np.int32),
            reset=np.array([start == 0]), sampling=sampling_arrays([seq.sampling]),
            step_index=np.array([seq.generated], np.int32))
        self.pools, out = self.executables(StepKey(StepKind.PREFILL, 1), self.params, self.pools,
                                           inputs)
        if start + n < seq.prompt_len:  # not the last chunk: adopt its state now
            self._commit_rows([seq], np.array([True]), np.zeros(1, np.int32), count=False)
            seq.frontier = start + n
            return None
        tokens = np.asarray(out.tokens, np.int32)[:, None]
        self._pending = PendingBatch(BatchKind.PREFILL, (handle,), tokens, next(self._batch_ids))
        return self._pending

    def decode(self, handles: Sequence[SequenceHandle]) -> PendingBatch:
        """One token for each of the B decode-ready sequences (exact B, no padding)."""
        self._check_idle()
        seqs = [self._seq(h) for h in handles]
        if len({s.handle.seq_id for s in seqs}) != len(seqs) or not seqs:
            raise PendingBatchError(f"decode needs distinct sequences, got {list(handles)}")
        for s in seqs:
            if s.state is not SeqState.ACTIVE:
                raise ResourceError(f"{s.handle} is not decode-ready")
            if s.generated >= s.max_new_tokens:
                raise ResourceError(f"{s.handle} already generated its {s.max_new_tokens} tokens")
            self._grow(s, s.frontier + 1)
        b = len(seqs)
        inputs = DecodeInputs(
            token_ids=np.array([s.tokens[-1] for s in seqs], np.int32),
            positions=np.array([s.frontier for s in seqs], np.int32),
            slots=np.array([s.slot for s in seqs], np.int32),
            page_tables=self._page_table(seqs),
            sampling=sampling_arrays([s.sampling for s in seqs]),
            step_index=np.array([s.generated for s in seqs], np.int32))
        self.pools, out = self.executables(StepKey(StepKind.DECODE, b), self.params, self.pools,
                                           inputs)
        tokens = np.asarray(out.tokens, np.int32)[:, None]
        self._pending = PendingBatch(BatchKind.DECODE, tuple(handles), tokens,
                                     next(self._batch_ids))
        return self._pending

    def commit(self, batch: PendingBatch, accepted: Sequence[int]) -> None:
        """Adopts each row's accepted prefix of its provisional tokens (0 = cancelled row)."""
        if batch is not self._pending:
            raise PendingBatchError(f"{batch!r} is not the Program's pending batch")
        acc = batch.check_decisions(accepted)
        batch.consume()
        self._pending = None
        seqs = [self._seq(h) for h in batch.handles]
        self._commit_rows(seqs, acc > 0, batch.tokens[:, 0], count=True)
        for seq, a, toks in zip(seqs, acc, batch.tokens):
            if a == 0:
                continue
            seq.frontier = seq.prompt_len if batch.kind is BatchKind.PREFILL else seq.frontier + 1
            seq.tokens.extend(int(t) for t in toks[:a])
            seq.state = SeqState.ACTIVE

    def abort_pending(self, batch: PendingBatch) -> None:
        """Drops the batch: committed state stays exactly as before the step."""
        if batch is not self._pending:
            raise PendingBatchError(f"{batch!r} is not the Program's pending batch")
        batch.consume()
        self._pending = None

    # Queries -------------------------------------------------------------------------------
    def tokens(self, handle: SequenceHandle) -> list[int]:
        return list(self._seq(handle).tokens)

    def num_generated(self, handle: SequenceHandle) -> int:
        return self._seq(handle).generated

    def is_prefilling(self, handle: SequenceHandle) -> bool:
        return self._seq(handle).state is SeqState.PREFILL

    def stats(self) -> ProgramStats:
        return ProgramStats(
            total_pages=self.pages.num_pages, free_pages=self.pages.num_free,
            reserved_pages=self.pages.num_reserved, available_pages=self.pages.num_available,
            total_slots=self.slots.num_slots, free_slots=self.slots.num_free,
            num_sequences=len(self._seqs), resource_revision=self.resource_revision)

    # Internals -----------------------------------------------------------------------------
    def _seq(self, handle: SequenceHandle) -> _Sequence:
        seq = self._seqs.get(handle.seq_id)
        if seq is None or seq.handle != handle:
            raise ResourceError(f"unknown or stale sequence handle {handle}")
        return seq

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise PendingBatchError(f"{self._pending!r} must be committed or aborted first")

    def _grow(self, seq: _Sequence, num_positions: int) -> None:
        """Draws pages from the sequence's reservation until `num_positions` fit."""
        while len(seq.pages) * self.pcfg.page_size < num_positions:
            if seq.reserved == 0:
                raise ResourceError(f"{seq.handle} outgrew its reservation")
            seq.pages.append(self.pages.allocate_reserved())
            seq.reserved -= 1

    def _page_table(self, seqs: list[_Sequence]) -> np.ndarray:
        table = np.zeros((len(seqs), self.pcfg.max_pages_per_seq), np.int32)
        for row, seq in enumerate(seqs):
            table[row, : len(seq.pages)] = seq.pages
        return table

    def _commit_rows(self, seqs: list[_Sequence], accept: np.ndarray, tokens: np.ndarray,
                     count: bool) -> None:
        b = len(seqs)
        inputs = _commit_inputs(np.array([s.slot for s in seqs], np.int32), accept,
                                tokens.astype(np.int32), np.full(b, count))
        self.pools = self.executables(StepKey(StepKind.COMMIT, b), self.pools, inputs)


def _commit_inputs(slots, accept, tokens, count) -> CommitInputs:
    return CommitInputs(slots=slots, accept=np.asarray(accept, bool), tokens=tokens,
                        count=np.asarray(count, bool))
