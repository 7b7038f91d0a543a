"""Statistics of speculative decoding, as the Engine observes its decode rounds.

Owns the frozen summary published in `EngineStats.speculative` (counted by the draft policy,
`engine/spec_policy.py`). A verify row is one row of a decode round with drafts that committed
tokens (cancelled rows commit none and are not counted). Per draft position i (0-based) a row
attempted the draft when its limit allowed i + 2 or more tokens that round, and accepted it when
the round produced more than i + 1 tokens (the Program's acceptance rule, before any stop
truncates the row).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    method: str  # what drafted: "mtp", "dflash" ("off": speculation off)
    num_speculative_tokens: int  # the most drafts a round may make (0: speculation off)
    verify_rows: int  # rows of rounds with drafts that committed tokens
    committed_tokens: int  # tokens those rows committed
    mean_accepted_tokens: float  # committed tokens per verify row, the bonus token included
    acceptance_by_position: tuple[float, ...]  # [K] accepted / attempted drafts at position i
    policy: str = "fixed"  # how a round's K is chosen: "adaptive" or "fixed"
    rounds_by_drafts: tuple[tuple[int, int], ...] = ()  # (K, decode rounds that drafted K)
    # The chosen rounds' expected tokens per second over a round of 0 drafts', as the policy
    # estimated them (0.0 before it measured both)
    estimated_gain: float = 0.0
    # (K, B, the policy's round milliseconds): a new (K, B) at once, a changed time up to ~64
    # rounds late (`DraftPolicy.stats`)
    round_ms: tuple[tuple[int, int, float], ...] = ()
    bare_rounds: int = 0  # rounds of 0 drafts that skipped the drafter's upkeep (DFlash, MTP)
