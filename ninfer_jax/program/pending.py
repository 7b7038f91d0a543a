"""PendingBatch: the move-only result of one model execution unit (DESIGN §6).

It freezes the batch membership and holds the provisional tokens; the provisional model state
stays in the Program's pools. It must be consumed exactly once, whole, by `Program.commit` or
`Program.abort_pending`. Rows carry `produced` (tokens proposed; 1 for decode and prefill, K for
a later speculative verify) so the accepted-prefix rule `0 <= accepted <= produced` is the same
for every kind.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from ninfer_jax.program.errors import PendingBatchError


class BatchKind(enum.Enum):
    PREFILL = "prefill"  # finalisation of a staged prefill: one row, its first token
    DECODE = "decode"


@dataclasses.dataclass(frozen=True)
class SequenceHandle:
    """A Program sequence as the Engine names it. `generation` guards against reuse of ids."""

    seq_id: int
    generation: int


class PendingBatch:
    """Provisional output of one step. Consume with Program.commit or Program.abort_pending."""

    def __init__(self, kind: BatchKind, handles: tuple[SequenceHandle, ...], tokens: Any,
                 batch_id: int, produced: int = 1):
        """tokens: [B, produced] int32, or anything `np.asarray` turns into it (a device array
        still being computed: the step was dispatched, and reading `tokens` waits for it)."""
        self.kind = kind
        self.handles = handles
        self._tokens = tokens
        self._tokens_ready: np.ndarray | None = None
        self.produced = np.full(len(handles), produced, np.int32)  # [B]
        self.batch_id = batch_id
        self._consumed = False

    @property
    def tokens(self) -> np.ndarray:
        """[B, produced] int32 provisional tokens (waits for the step that computes them)."""
        if self._tokens_ready is None:
            self._tokens_ready = np.asarray(self._tokens, np.int32).reshape(self.batch, -1)
            self._tokens = None
        return self._tokens_ready

    @property
    def batch(self) -> int:
        return len(self.handles)

    @property
    def consumed(self) -> bool:
        return self._consumed

    def consume(self) -> None:
        if self._consumed:
            raise PendingBatchError(f"PendingBatch {self.batch_id} was already consumed")
        self._consumed = True

    def check_decisions(self, accepted: list[int] | tuple[int, ...]) -> np.ndarray:
        """Validates one decision per row: 0 <= accepted <= produced (0 = cancelled row)."""
        acc = np.asarray(accepted, np.int64)
        if acc.shape != (self.batch,):
            raise PendingBatchError(
                f"PendingBatch {self.batch_id} has {self.batch} rows, got {acc.size} decisions"
            )
        if (acc < 0).any() or (acc > self.produced).any():
            raise PendingBatchError(
                f"accepted counts {acc.tolist()} must be in 0..produced {self.produced.tolist()}"
            )
        return acc

    def __repr__(self) -> str:
        state = "consumed" if self._consumed else "pending"
        return f"PendingBatch(id={self.batch_id}, {self.kind.value}, B={self.batch}, {state})"
