"""The worker's published summary (`EngineStats`) and its decode rounds' time (`RoundStats`).

Plain values, replaced whole: the worker builds one after each iteration and before any event
it publishes (`publication.Publication.refresh_stats`); other threads read the last one.
"""

from __future__ import annotations

import dataclasses

from ninfer_jax import display
from ninfer_jax.engine.catalog import CatalogStats
from ninfer_jax.engine.spec_stats import SpeculativeStats
from ninfer_jax.engine.tiers import TierStats
from ninfer_jax.engine.transactions import TransactionStats


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """The worker's decode rounds and where its time went in the iterations that ran them."""

    rounds: int = 0  # decode rounds dispatched (an aborted round ahead included)
    rows: int = 0  # their rows
    host_s: float = 0.0  # worker time in those iterations, less waiting for a round's tokens
    wait_s: float = 0.0  # waiting for a round's tokens: the host was ahead of the device

    @property
    def host_us_per_round(self) -> float:
        return 1e6 * self.host_s / max(self.rounds, 1)

    @property
    def host_us_per_row(self) -> float:
        return 1e6 * self.host_s / max(self.rows, 1)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The worker's published summary, replaced whole after every iteration and before any
    event it publishes: a consumer that has read an event reads stats that account for it."""

    available: bool
    waiting: int
    active: int
    outstanding: int
    capacity: int
    free_lanes: int
    total_lanes: int
    free_pages: int
    total_pages: int
    reserved_pages: int
    free_slots: int
    total_slots: int
    generated_tokens: int
    finished_requests: int
    backfilled: int  # requests admitted ahead of a blocked head by the backfill proof
    prefix: CatalogStats
    speculative: SpeculativeStats
    transactions: TransactionStats  # resource transitions (`transactions.py`)
    tiers: TierStats  # the context store (tiers=() when the Engine has none)
    rounds: RoundStats = RoundStats()  # decode rounds and the worker's host time per round

    def _repr_html_(self) -> str:
        return display.stats_html(self)

    _repr_pretty_ = display.pretty(display.stats_line)
