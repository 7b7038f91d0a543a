"""The table of ahead-of-time compiled step executables, keyed by a typed key (STYLE §3).

Owns compilation: every executable the Program will ever run is compiled at start-up (prefill
chunk, decode and commit for every exact B in 1..max_concurrency), with the pools donated. A key
that was not compiled raises; nothing compiles after start-up.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Any, Callable

import jax

from ninfer_jax.program.errors import MissingExecutableError


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COMMIT = "commit"
    CAPTURE = "capture"
    RESTORE = "restore"


@dataclasses.dataclass(frozen=True)
class StepKey:
    kind: StepKind
    batch: int


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class ExecutableTable:
    """StepKey -> compiled executable. Pools are always donated (argument `pools`)."""

    def __init__(self):
        self._table: dict[StepKey, Callable] = {}
        self.compile_seconds: dict[StepKey, float] = {}

    def compile(self, key: StepKey, fn: Callable, *example_args: Any) -> None:
        """Lowers `fn(*example_args)` for those shapes with `pools` donated, and stores it."""
        start = time.perf_counter()
        jitted = jax.jit(fn, donate_argnames=("pools",))
        self._table[key] = jitted.lower(*map(_abstract, example_args)).compile()
        self.compile_seconds[key] = time.perf_counter() - start

    def __call__(self, key: StepKey, *args: Any) -> Any:
        try:
            executable = self._table[key]
        except KeyError:
            raise MissingExecutableError(
                f"no executable for {key}; compiled: {sorted(map(str, self._table))}"
            ) from None
        return executable(*args)

    def keys(self) -> list[StepKey]:
        return list(self._table)


def bind(fn: Callable, **static: Any) -> Callable:
    """fn with its static (hashable) keyword arguments fixed, keeping argument names for donation."""
    return functools.wraps(fn)(functools.partial(fn, **static))
