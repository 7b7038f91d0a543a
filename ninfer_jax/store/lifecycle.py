"""The life of a store or proxy object: new -> open (set up) -> closed, closed being final.

Owns the one rule every store, facet and proxy node follows: before `setup()` and after
`close()` every entry point raises InvalidParam at once, naming the owner and the call; only
`close()` (idempotent), `wait` and `get_finished` stay callable after close, so completions of
jobs that were in flight at close can still be consumed. Guard a method with `@while_open`; its
object exposes the `Lifecycle` as `self.life`.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ninfer_jax.store.errors import InvalidParam


class State(enum.Enum):
    NEW = "new"  # constructed, setup() not done
    OPEN = "open"  # set up; every entry point works
    CLOSED = "closed"  # close() began; final


class Lifecycle:
    """A thread-safe state cell; `close()` reports whether resources were ever acquired."""

    def __init__(self, owner: str, opened: bool = False):
        self._owner = owner
        self._lock = threading.Lock()
        self._state = State.OPEN if opened else State.NEW
        self._was_open = opened

    @property
    def state(self) -> State:
        return self._state

    def require_new(self, entry: str) -> None:
        """For `setup`: a second setup, or one after close, is refused."""
        if self._state is State.OPEN:
            raise InvalidParam(f"{self._owner}: {entry} called twice; set up each object once")
        if self._state is State.CLOSED:
            raise InvalidParam(f"{self._owner}: {entry} called after close()")

    def open(self) -> None:
        with self._lock:
            if self._state is State.NEW:
                self._state, self._was_open = State.OPEN, True

    def require_open(self, entry: str) -> None:
        state = self._state
        if state is State.NEW:
            raise InvalidParam(f"{self._owner}: {entry} called before setup()")
        if state is State.CLOSED:
            raise InvalidParam(f"{self._owner}: {entry} called after close()")

    def require_set_up(self, entry: str) -> None:
        """For `wait`/`get_finished`: callable when open or closed, not before setup."""
        if not self._was_open:
            raise InvalidParam(f"{self._owner}: {entry} called before setup()")

    def close(self) -> bool:
        """Moves to CLOSED (idempotent); True if the object was ever set up."""
        with self._lock:
            self._state = State.CLOSED
            return self._was_open


F = TypeVar("F", bound=Callable[..., Any])


def while_open(method: F) -> F:
    """Raises InvalidParam naming the call unless `self.life` is open."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.life.require_open(method.__name__)
        return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]
