"""What every endpoint of one server shares: the Engine, the served model's id, limits, metrics."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ninfer_jax.gateway.http.metrics import Metrics


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

    @property
    def engine_available(self) -> bool:
        return self.engine.available
