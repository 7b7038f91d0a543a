"""PendingBatch: the move-only result of one model execution unit (DESIGN §6).

It freezes the batch membership and holds the provisional tokens; the provisional model state
stays in the Program's pools. It must be consumed exactly once, whole, by `Program.commit` or
`Program.abort_pending`. Rows carry `produced` (tokens proposed: 1 for prefill and plain decode;
with speculation, the target's tokens up to and including the first that corrects a draft,
1..K + 1) so the accepted-prefix rule `0 <= accepted <= produced` is the same for every kind.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from ninfer_jax.program.errors import PendingBatchError


class BatchKind(enum.Enum):
    PREFILL = "prefill"  # finalisation of a staged prefill: one row, its first token
    DECODE = "decode"  # a decode round: one token per row, or a speculative verify
    CONTROL = "control"  # forced control: one row, its forced tokens and the token after them


@dataclasses.dataclass(frozen=True)
class SequenceHandle:
    """A Program sequence as the Engine names it. `generation` guards against reuse of ids."""

    seq_id: int
    generation: int


class PendingBatch:
    """Provisional output of one step. Consume with Program.commit or Program.abort_pending."""

    def __init__(self, kind: BatchKind, handles: tuple[SequenceHandle, ...], tokens: Any,
                 batch_id: int, produced: Any = 1, logprobs: tuple[Any, Any, Any] | None = None,
                 forced: tuple[int, ...] = (), last: Any = None):
        """tokens: [B, W] int32 (W >= max produced), or anything `np.asarray` turns into it (a
        device array still being computed: the step was dispatched, and reading `tokens` waits
        for it); produced: an int for every row, or [B] (possibly on the device too);
        logprobs: when some row asked for them, (sampled [B, W] float32, top ids [B, W, N]
        int32, top log-probs [B, W, N] float32), read (and copied to the host) only on demand.
        forced (CONTROL only): the Frontend's tokens before the row's sampled one; a commit
        that accepts the row adopts them with it, none of them alone. last: a plain decode
        round's tokens as [B] where the step left them (the next round's input), or None."""
        self.last = last
        self._logprobs = logprobs
        self._logprobs_ready: tuple[np.ndarray, ...] | None = None
        self.kind = kind
        self.forced = forced
        self.handles = handles
        self._tokens = tokens
        self._tokens_ready: np.ndarray | None = None
        self._produced = produced
        self._produced_ready: np.ndarray | None = None
        self.batch_id = batch_id
        self._consumed = False

    @property
    def tokens(self) -> np.ndarray:
        """[B, W] int32 provisional tokens (waits for the step that computes them); row b's
        candidates are its first produced[b]."""
        if self._tokens_ready is None:
            self._tokens_ready = np.asarray(self._tokens, np.int32).reshape(self.batch, -1)
            self._tokens = None
        return self._tokens_ready

    @property
    def tokens_read(self) -> bool:
        """Whether `tokens` was read (the step is done and its tokens are on the host)."""
        return self._tokens_ready is not None

    @property
    def raw_tokens(self) -> Any:
        """The tokens as the step left them (on the device until `tokens` is read)."""
        return self._tokens if self._tokens_ready is None else self._tokens_ready

    @property
    def produced(self) -> np.ndarray:
        """[B] int32 candidate tokens per row."""
        if self._produced_ready is None:
            p = self._produced
            self._produced_ready = np.full(self.batch, p, np.int32) if isinstance(p, int) \
                else np.broadcast_to(np.asarray(p, np.int32), (self.batch,)).copy()
            self._produced = None
        return self._produced_ready

    def row_tokens(self, row: int) -> list[int]:
        """The candidates of one row: its first produced[row] tokens."""
        return [int(t) for t in self.tokens[row, : self.produced[row]]]

    def row_logprobs(self, row: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
        """Per candidate of one row: (its log-prob, ((id, log-prob) of the N most likely tokens,
        most likely first)). Empty when the step computed none."""
        if self._logprobs is None and self._logprobs_ready is None:
            return []
        if self._logprobs_ready is None:
            sampled, ids, lps = (np.asarray(a) for a in self._logprobs)
            self._logprobs_ready = (sampled.reshape(self.batch, -1),
                                    ids.reshape(self.batch, sampled.shape[-1], -1),
                                    lps.reshape(self.batch, sampled.shape[-1], -1))
            self._logprobs = None
        sampled, ids, lps = self._logprobs_ready
        return [(float(sampled[row, i]),
                 tuple(zip(ids[row, i].tolist(), lps[row, i].astype(float).tolist())))
                for i in range(int(self.produced[row]))]

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
        if isinstance(self._produced, int) and isinstance(accepted, (list, tuple)) \
                and len(accepted) == self.batch \
                and all(type(a) is int and 0 <= a <= self._produced for a in accepted):
            return np.array(accepted, np.int64)  # every row proposed the same count: no arrays
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
