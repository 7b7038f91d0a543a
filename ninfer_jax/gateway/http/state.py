"""What every endpoint of one server shares: the Engine, the served model's id, limits, metrics."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ninfer_jax.gateway.http.metrics import Metrics

if TYPE_CHECKING:
    from ninfer_jax.api import Engine
    from ninfer_jax.gateway.http.logprobs import PromptScorer

T = TypeVar("T")
# Requests are parsed, rendered and tokenized off the event loop in two lanes: bodies up to
# LARGE_BODY_BYTES in SMALL_LANE threads, larger ones in one thread of their own, so a burst
# of maximal bodies neither delays an ordinary request nor keeps the event loop from the GIL
# (scripts/bench.py --suite=server, "event loop" row: with 8 bodies of 3.8 MiB at once and
# every request in one pool of 1 / 2 / 4 threads, /health took up to 45 / 81-135 / 170-285 ms)
LARGE_BODY_BYTES = 256 << 10
SMALL_LANE = 2


@dataclasses.dataclass(frozen=True)
class ServerState:
    engine: Engine
    model_name: str
    metrics: Metrics
    api_keys: tuple[str, ...]  # accepted keys, each its own tenant; empty: auth off
    max_body_bytes: int
    body_timeout_s: float  # the whole body must arrive within this long of the head
    prompt_scorer: PromptScorer | None = None  # for `echo` with logprobs; None: refused
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # the two lanes of request work run off the event loop (`off_loop`)
    small_work: anyio.CapacityLimiter = dataclasses.field(
        default_factory=lambda: anyio.CapacityLimiter(SMALL_LANE))
    large_work: anyio.CapacityLimiter = dataclasses.field(
        default_factory=lambda: anyio.CapacityLimiter(1))

    async def off_loop(self, fn: Callable[..., T], *args: Any, body_bytes: int = 0) -> T:
        """`fn(*args)` on a worker thread of the lane for a body of `body_bytes`: parsing a
        body, rendering a template, tokenizing a prompt, compiling a grammar take seconds for a
        large legal request, and on the event loop they would stall `/health` and every other
        client. Its exceptions (ApiError for bad input) are raised here."""
        lane = self.large_work if body_bytes > LARGE_BODY_BYTES else self.small_work
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=lane)

    @property
    def engine_available(self) -> bool:
        return self.engine.available
