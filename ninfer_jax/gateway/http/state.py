"""What every endpoint of one server shares: the Engine, the served model's id, limits, metrics."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from ninfer_jax.gateway.http.metrics import Metrics

T = TypeVar("T")
# Requests parsed, tokenized and rendered at once, off the event loop (each holds the GIL most
# of the time, so more would only queue behind it)
OFF_LOOP_THREADS = 4


@dataclasses.dataclass(frozen=True)
class ServerState:
    engine: Any  # ninfer_jax.api.Engine (or anything with its frontend/core/asubmit/stats)
    model_name: str
    metrics: Metrics
    api_keys: tuple[str, ...]  # accepted keys, each its own tenant; empty: auth off
    max_body_bytes: int
    body_timeout_s: float  # the whole body must arrive within this long of the head
    prompt_scorer: Any = None  # logprobs.PromptScorer for `echo` with logprobs; None: refused
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # bounds the CPU work of requests run off the event loop (`off_loop`)
    cpu_work: anyio.CapacityLimiter = dataclasses.field(
        default_factory=lambda: anyio.CapacityLimiter(OFF_LOOP_THREADS))

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread, at most OFF_LOOP_THREADS at once: parsing a body,
        tokenizing a prompt, rendering a template, compiling a grammar take seconds for a large
        legal request, and on the event loop they would stall `/health` and every other
        client. Its exceptions (ApiError for bad input) are raised here."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args),
                                              limiter=self.cpu_work)

    @property
    def engine_available(self) -> bool:
        return self.engine.available
