"""Acceptance statistics of speculative decoding, as the Engine observes its decode rounds.

Owns the worker-side counter and the frozen summary published in `EngineStats.speculative`.
A verify row is one row of a speculative decode round that committed tokens (cancelled rows
commit none and are not counted). Per draft position i (0-based) a row attempted the draft when
its budget allowed i + 2 or more tokens that round, and accepted it when the round produced more
than i + 1 tokens (the Program's acceptance rule, before any stop truncates the row).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    method: str  # what drafted: "mtp", "dflash" ("off": speculation off)
    num_speculative_tokens: int  # K drafts per round (0: speculation off)
    verify_rows: int  # rows of speculative rounds that committed tokens
    committed_tokens: int  # tokens those rows committed
    mean_accepted_tokens: float  # committed tokens per verify row, the bonus token included
    acceptance_by_position: tuple[float, ...]  # [K] accepted / attempted drafts at position i


class SpeculativeCounter:
    """Counts verify rows; only the Engine's worker thread touches it."""

    def __init__(self, num_speculative_tokens: int, method: str = "off"):
        self.k, self.method = num_speculative_tokens, method
        self.rows = 0
        self.tokens = 0
        self.attempted = [0] * self.k
        self.accepted = [0] * self.k

    def add_row(self, produced: int, committed: int, budget: int) -> None:
        """One row: `produced` candidates, `committed` of them kept, `budget` tokens it was
        still allowed before the round."""
        self.rows += 1
        self.tokens += committed
        for i in range(min(self.k, budget - 1)):
            self.attempted[i] += 1
            self.accepted[i] += produced > i + 1

    def snapshot(self) -> SpeculativeStats:
        return SpeculativeStats(
            method=self.method, num_speculative_tokens=self.k, verify_rows=self.rows, committed_tokens=self.tokens,
            mean_accepted_tokens=self.tokens / self.rows if self.rows else 0.0,
            acceptance_by_position=tuple(a / n if n else 0.0
                                         for a, n in zip(self.accepted, self.attempted)))
