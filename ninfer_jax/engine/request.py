"""Request records and their lifecycle (DESIGN §3), with the legal transitions in one table.

Owns a request's state, its Program sequence handle (an opaque token), its budget and output
session, and the flags the consumer thread may set (cancel, consumer released). Only the worker
thread changes a record's state.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any

from ninfer_jax.engine.events import FinishReason
from ninfer_jax.sampling_params import SamplingParams


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


class InvariantError(RuntimeError):
    """An Engine invariant broke: shared state can no longer be explained; the Engine fails."""


@dataclasses.dataclass(eq=False)
class RequestRecord:
    request_id: int
    prompt: Any  # PreparedPrompt: token_ids, digest
    sampling: SamplingParams
    session: Any  # OutputSession
    submitted_at: float
    queue_deadline: float | None  # monotonic time by which it must be admitted
    deadline: float | None  # monotonic time by which it must finish
    publication_order: int
    session_key: str | None = None
    cache_scope: str | None = None  # prefix reuse stays within this scope (a tenant)
    reuse: bool = True  # False: no checkpoint is read or left by this request
    state: RequestState = RequestState.WAITING
    seq: Any = None  # the Program's SequenceHandle while it holds one
    plan: Any = None  # the sealed ResourcePlan while Materializing
    lane: int | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # published on the thinking channel
    cached_tokens: int = 0  # prompt tokens served from a checkpoint
    store_probed: bool = False  # the context store was searched for its prefix (once)
    txn: Any = None  # its MATERIALIZE RunningTransaction while it runs (a read in flight,
    #   or waiting for capacity after one)
    materialized: Any = None  # that transaction's committed ResourceResult, not yet adopted
    may_evict: bool = True  # admitted as the head (may evict inactive checkpoints)
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_string: str | None = None
    control: tuple[int, ...] = ()  # the forced tokens asked for, while ControlReady
    grammar: Any = None  # the Frontend's GrammarMatcher of a structured request, advanced
    #   with exactly the tokens committed to the Program
    cancel_requested: threading.Event = dataclasses.field(default_factory=threading.Event)
    acceptance: Any = None  # its drafts' RowAcceptance (`spec_policy`), from its first round

    def move(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise InvariantError(
                f"request {self.request_id}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)
