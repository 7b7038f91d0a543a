"""Request records and their lifecycle (DESIGN §3), with the legal transitions in one table.

Owns a request's state, its Program sequence handle (an opaque token), its budget and output
session, and the flags the consumer thread may set (cancel, consumer released). Only the worker
thread changes a record's state.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import TYPE_CHECKING

import numpy as np

from ninfer_jax.engine.events import FinishReason, InvariantError
from ninfer_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ninfer_jax.engine.spec_policy import RowAcceptance
    from ninfer_jax.engine.transactions import ResourceResult, RunningTransaction
    from ninfer_jax.frontend.grammar import GrammarMatcher
    from ninfer_jax.frontend.output_session import OutputSession
    from ninfer_jax.frontend.prompt import PreparedPrompt
    from ninfer_jax.program.pending import SequenceHandle


class RequestState(enum.Enum):
    WAITING = "waiting"
    MATERIALIZING = "materializing"
    PREFILL = "prefill"
    DECODE_READY = "decode_ready"
    CONTROL_READY = "control_ready"  # the Frontend asked for forced control before more decode
    TERMINAL_PENDING = "terminal_pending"
    FINISHED = "finished"


S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.MATERIALIZING, S.FINISHED}),
    S.MATERIALIZING: frozenset({S.PREFILL, S.FINISHED}),
    S.PREFILL: frozenset({S.PREFILL, S.DECODE_READY, S.CONTROL_READY, S.TERMINAL_PENDING}),
    S.DECODE_READY: frozenset({S.DECODE_READY, S.CONTROL_READY, S.TERMINAL_PENDING}),
    S.CONTROL_READY: frozenset({S.DECODE_READY, S.CONTROL_READY, S.TERMINAL_PENDING}),
    S.TERMINAL_PENDING: frozenset({S.FINISHED}),
    S.FINISHED: frozenset(),
}


@dataclasses.dataclass(eq=False)
class RequestRecord:
    request_id: int
    prompt: PreparedPrompt
    sampling: SamplingParams
    session: OutputSession  # the Frontend's text state of its output
    submitted_at: float
    queue_deadline: float | None  # monotonic time by which it must be admitted
    deadline: float | None  # monotonic time by which it must finish
    publication_order: int
    session_key: str | None = None
    cache_scope: str | None = None  # prefix reuse stays within this scope (a tenant)
    reuse: bool = True  # False: no checkpoint is read or left by this request
    state: RequestState = RequestState.WAITING
    seq: SequenceHandle | None = None  # the Program's sequence while it holds one
    lane: int | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # published on the thinking channel
    cached_tokens: int = 0  # prompt tokens served from a checkpoint
    store_probed: bool = False  # the context store was searched for its prefix (once)
    # its MATERIALIZE while it runs (a read in flight, or waiting for capacity after one), and
    # that transaction's committed result, not yet adopted
    txn: RunningTransaction | None = None
    materialized: ResourceResult | None = None
    may_evict: bool = True  # admitted as the head (may evict inactive checkpoints)
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_string: str | None = None
    control: tuple[int, ...] = ()  # the forced tokens asked for, while ControlReady
    # a structured request's grammar matcher, advanced with exactly the tokens committed
    grammar: GrammarMatcher | None = None
    cancel_requested: threading.Event = dataclasses.field(default_factory=threading.Event)
    acceptance: RowAcceptance | None = None  # its drafts' (`spec_policy`), from its first round

    def move(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise InvariantError(
                f"request {self.request_id}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    def next_mask(self) -> np.ndarray | None:
        """The allowed-token bitmask of its next token (None: unconstrained)."""
        return None if self.grammar is None else self.grammar.mask()

    def grammar_forced(self, most: int) -> tuple[int, ...]:
        """A grammar row's fast-forward (`GrammarMatcher.forced`): at most `most` tokens (one
        control step's; the rest follows the next sampled token) and one short of the budget,
        so a sampled token follows them. None for a request with stop strings or stop ids:
        forced text is never matched against them, and the grammar's text could hold one."""
        if self.grammar is None or self.sampling.stop or self.sampling.stop_token_ids:
            return ()
        room = self.sampling.max_new_tokens - self.completion_tokens - 1
        return self.grammar.forced()[:max(min(room, most), 0)]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)
