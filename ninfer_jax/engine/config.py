"""EngineCoreConfig: the worker's static settings, validated when made."""

from __future__ import annotations

import dataclasses
import math
import numbers

from ninfer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineCoreConfig:
    max_queue: int = 64  # outstanding requests (waiting + running + unconsumed) before overload
    queue_timeout_s: float | None = None  # default time a request may wait for admission
    idle_wait_s: float = 0.05
    prefix_reuse: bool = True  # checkpoint prompts and turns; reuse the longest exact prefix
    backfill_window: int = 8  # waiting requests behind a blocked head that may borrow
    # Dispatch a decode round before the previous round's output is turned into events, so
    # the host's work per round runs while the device computes (see `_run_unit`).
    overlap: bool = True

    def __post_init__(self):
        for name in ("max_queue", "backfill_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r:.40}")
        for name in ("queue_timeout_s", "idle_wait_s"):
            value = getattr(self, name)
            if value is None and name == "queue_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number of seconds > 0, "
                                  f"got {value!r:.40}")
        for name in ("prefix_reuse", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r:.40}")
