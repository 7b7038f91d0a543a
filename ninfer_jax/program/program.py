"""Program: the only entry to physical execution for one model package (DESIGN §2, §10).

Owns the device pools and the compiled step table; the host bookkeeping it shares with its test
double lives in `host.py`. It knows nothing of requests, queues, text or users. All executables
(prefill chunk, decode and commit for every exact B) are compiled here at start-up.
"""

from __future__ import annotations

import jax
import numpy as np

from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.errors import InfeasibleError
from ninfer_jax.program.executables import ExecutableTable, StepKey, StepKind, bind
from ninfer_jax.program.host import (
    GREEDY,
    CheckpointRecord,
    HostProgram,
    ProgramLimits,
    SeqRecord,
)
from ninfer_jax.program.pools import Pools
from ninfer_jax.program.sampling import sampling_arrays
from ninfer_jax.program.steps import (
    CaptureInputs,
    CommitInputs,
    DecodeInputs,
    PrefillInputs,
    RestoreInputs,
    capture_step,
    commit_step,
    decode_step,
    prefill_step,
    restore_step,
)


class Program(HostProgram):
    """Pools, allocators, sequences and the compiled steps of one model package."""

    def __init__(self, cfg: ModelConfig, params: dict, pcfg: ProgramConfig):
        if pcfg.max_seq_len > cfg.max_position_embeddings:
            raise InfeasibleError(
                f"max_seq_len {pcfg.max_seq_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}")
        pools = Pools.allocate(cfg, pcfg)
        super().__init__(ProgramLimits(
            max_seq_len=pcfg.max_seq_len, page_size=pcfg.page_size, total_pages=pcfg.num_pages,
            total_slots=pcfg.num_slots, max_concurrency=pcfg.max_concurrency,
            prefill_chunk=pcfg.prefill_chunk, vocab_size=cfg.vocab_size,
            total_checkpoint_slots=pcfg.num_checkpoint_slots,
            page_bytes=2 * pools.k.nbytes // pcfg.num_pages,
            checkpoint_state_bytes=(pools.ck_conv.nbytes + pools.ck_rec.nbytes)
            // max(pcfg.num_checkpoint_slots, 1)))
        self.cfg, self.pcfg = cfg, pcfg
        self.params = jax.tree.map(lambda a: jax.numpy.asarray(a, pcfg.dtype), params)
        self.pools = pools
        self.executables = ExecutableTable()
        self._compile_all()

    def _compile_all(self) -> None:
        cfg, pcfg = self.cfg, self.pcfg
        c, w = pcfg.prefill_chunk, pcfg.max_pages_per_seq
        prefill_example = PrefillInputs(
            token_ids=np.zeros((1, c), np.int32), start_pos=np.zeros(1, np.int32),
            num_valid=np.ones(1, np.int32), page_table=np.zeros((1, w), np.int32),
            slot=np.zeros(1, np.int32), reset=np.ones(1, bool),
            sampling=sampling_arrays([GREEDY]), step_index=np.zeros(1, np.int32))
        self.executables.compile(StepKey(StepKind.PREFILL, 1),
                                 bind(prefill_step, cfg=cfg, pcfg=pcfg),
                                 self.params, self.pools, prefill_example)
        for b in range(1, pcfg.max_concurrency + 1):
            decode_example = DecodeInputs(
                token_ids=np.zeros(b, np.int32), positions=np.zeros(b, np.int32),
                slots=np.arange(b, dtype=np.int32), page_tables=np.zeros((b, w), np.int32),
                sampling=sampling_arrays([GREEDY] * b), step_index=np.zeros(b, np.int32))
            self.executables.compile(StepKey(StepKind.DECODE, b),
                                     bind(decode_step, cfg=cfg, pcfg=pcfg),
                                     self.params, self.pools, decode_example)
            commit_example = _commit_inputs(np.zeros(b, np.int32), np.zeros(b, bool),
                                            np.zeros(b, np.int32), False)
            self.executables.compile(StepKey(StepKind.COMMIT, b), commit_step, self.pools,
                                     commit_example)
        if pcfg.num_checkpoint_slots:
            one = np.zeros(1, np.int32)
            self.executables.compile(StepKey(StepKind.CAPTURE, 1), capture_step, self.pools,
                                     CaptureInputs(slot=one, ckpt_slot=one))
            self.executables.compile(
                StepKey(StepKind.RESTORE, 1), restore_step, self.pools,
                RestoreInputs(ckpt_slot=one, slot=one,
                              prefix_ids=np.zeros((1, pcfg.max_seq_len), np.int32),
                              prefix_len=one, copy_src=one, copy_dst=one))

    def _run_prefill(self, seq: SeqRecord, start: int, chunk: list[int]) -> int:
        c, n = self.pcfg.prefill_chunk, len(chunk)
        inputs = PrefillInputs(
            token_ids=np.array([chunk + [0] * (c - n)], np.int32),
            start_pos=np.array([start], np.int32), num_valid=np.array([n], np.int32),
            page_table=self._page_table([seq]), slot=np.array([seq.slot], np.int32),
            reset=np.array([start == 0]), sampling=sampling_arrays([seq.sampling]),
            step_index=np.array([seq.generated], np.int32))
        self.pools, out = self.executables(StepKey(StepKind.PREFILL, 1), self.params, self.pools,
                                           inputs)
        return int(np.asarray(out.tokens)[0])

    def _run_decode(self, seqs: list[SeqRecord]) -> np.ndarray:
        inputs = DecodeInputs(
            token_ids=np.array([s.tokens[-1] for s in seqs], np.int32),
            positions=np.array([s.frontier for s in seqs], np.int32),
            slots=np.array([s.slot for s in seqs], np.int32),
            page_tables=self._page_table(seqs),
            sampling=sampling_arrays([s.sampling for s in seqs]),
            step_index=np.array([s.generated for s in seqs], np.int32))
        self.pools, out = self.executables(StepKey(StepKind.DECODE, len(seqs)), self.params,
                                           self.pools, inputs)
        return np.asarray(out.tokens)

    def _run_commit(self, seqs: list[SeqRecord], accept: np.ndarray, tokens: np.ndarray,
                    count: bool) -> None:
        inputs = _commit_inputs(np.array([s.slot for s in seqs], np.int32), accept,
                                tokens.astype(np.int32), count)
        self.pools = self.executables(StepKey(StepKind.COMMIT, len(seqs)), self.pools, inputs)

    def _run_capture(self, seq: SeqRecord, ckpt_slot: int) -> None:
        inputs = CaptureInputs(slot=np.array([seq.slot], np.int32),
                               ckpt_slot=np.array([ckpt_slot], np.int32))
        self.pools = self.executables(StepKey(StepKind.CAPTURE, 1), self.pools, inputs)

    def _run_restore(self, ckpt: CheckpointRecord, seq: SeqRecord,
                     copy_page: tuple[int, int] | None) -> None:
        prefix = np.zeros((1, self.pcfg.max_seq_len), np.int32)
        prefix[0, : ckpt.frontier] = ckpt.tokens
        src, dst = copy_page or (seq.pages[0], seq.pages[0])
        inputs = RestoreInputs(
            ckpt_slot=np.array([ckpt.slot], np.int32), slot=np.array([seq.slot], np.int32),
            prefix_ids=prefix, prefix_len=np.array([ckpt.frontier], np.int32),
            copy_src=np.array([src], np.int32), copy_dst=np.array([dst], np.int32))
        self.pools = self.executables(StepKey(StepKind.RESTORE, 1), self.pools, inputs)

    def _page_table(self, seqs: list[SeqRecord]) -> np.ndarray:
        table = np.zeros((len(seqs), self.pcfg.max_pages_per_seq), np.int32)
        for row, seq in enumerate(seqs):
            table[row, : len(seq.pages)] = seq.pages
        return table


def _commit_inputs(slots, accept, tokens, count: bool) -> CommitInputs:
    b = len(slots)
    return CommitInputs(slots=slots, accept=np.asarray(accept, bool), tokens=tokens,
                        count=np.full(b, count))
