"""The consumer side of a request: a handle that iterates events, cancels, and returns a result.

Owns the capacity rule of DESIGN §3: capacity taken at submit is released exactly once, when both
`response_done` (the worker formed the final event) and `consumer_released` (the consumer
finished waiting, or dropped the handle) hold, in either order. Dropping a handle sets the
cancellation flag and releases the consumer; it never calls the Program.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from ninfer_jax.engine.events import (
    Channel,
    Delta,
    Event,
    Finished,
    GenerationResult,
    GenerationStart,
)


class CapacityToken:
    """One request's claim on the Engine's outstanding capacity; released exactly once."""

    def __init__(self, on_release: Callable[[], None]):
        self._lock = threading.Lock()
        self._response_done = False
        self._consumer_released = False
        self._released = False
        self._on_release = on_release

    def _maybe_release(self) -> None:
        if self._response_done and self._consumer_released and not self._released:
            self._released = True
            self._on_release()

    def response_done(self) -> None:
        with self._lock:
            self._response_done = True
            self._maybe_release()

    def consumer_released(self) -> None:
        with self._lock:
            self._consumer_released = True
            self._maybe_release()

    @property
    def released(self) -> bool:
        return self._released


class EventSink:
    """Where the worker puts a request's events (thread-safe); sync or asyncio consumers."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
        self._ended = threading.Event()  # set once the Finished event is in the sync queue

    def put(self, event: Event) -> None:
        if self._loop is None:
            self._sync.put(event)
            if isinstance(event, Finished):
                self._ended.set()
        else:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
            except RuntimeError:  # the consumer's loop is closed: nobody will read it
                pass

    def get(self, timeout: float | None) -> Event:
        return self._sync.get(timeout=timeout)

    def wait_ended(self, timeout: float | None) -> bool:
        """Waits until the Finished event is queued (every event before it is too)."""
        return self._ended.wait(timeout)

    async def aget(self) -> Event:
        return await self._async.get()


SETTLE_S = 10.0  # how long closing a running request waits for the Engine to end it


def _drop(cancel: threading.Event, capacity: CapacityToken, wake: Callable[[], None]) -> None:
    cancel.set()
    capacity.consumer_released()
    wake()


class _Collector:
    """Folds events into the final result."""

    def __init__(self, request_id: int, seed: int | None, decode: Callable | None):
        self.request_id, self.seed, self.decode = request_id, seed, decode
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list | None = None
        self.start: GenerationStart | None = None
        self.finished: Finished | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, GenerationStart):
            self.start = event
        elif isinstance(event, Delta):
            (self.reasoning if event.channel is Channel.THINKING else self.text).append(event.text)
            self.token_ids.extend(event.token_ids)
            if event.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(event.logprobs)  # O(1) a token, not a copy of them all
        else:
            self.finished = event

    def result(self) -> GenerationResult:
        f = self.finished
        return GenerationResult(
            request_id=self.request_id, text="".join(self.text),
            reasoning_text="".join(self.reasoning), token_ids=tuple(self.token_ids),
            finish_reason=f.finish_reason, usage=f.usage, seed=self.seed, error=f.error,
            stop_string=f.stop_string,
            logprobs=None if self.logprobs is None else tuple(self.logprobs), decode=self.decode)


class RequestHandle:
    """Iterate for events (GenerationStart, Delta..., Finished); `.result()` for the whole answer;
    `.cancel()` to stop it. Use it from one consumer thread (or one asyncio task)."""

    def __init__(self, request_id: int, sink: EventSink, cancel: threading.Event,
                 capacity: CapacityToken, wake: Callable[[], None], seed: int | None,
                 decode: Callable | None = None):
        self.request_id = request_id
        self._sink = sink
        self._cancel_flag = cancel
        self._capacity = capacity
        self._wake = wake
        self._collector = _Collector(request_id, seed, decode)
        self._finalizer = weakref.finalize(self, _drop, cancel, capacity, wake)

    def cancel(self) -> None:
        """Asks the Engine to stop this request; its Finished event (reason cancelled) follows."""
        self._cancel_flag.set()
        self._wake()

    @property
    def done(self) -> bool:
        return self._collector.finished is not None

    def _take(self, event: Event) -> Event:
        self._collector.add(event)
        if isinstance(event, Finished):
            self._finalizer.detach()
            self._capacity.consumer_released()
        return event

    def next_event(self, timeout: float | None = None) -> Event:
        """The next event; raises queue.Empty after `timeout` seconds, StopIteration when done."""
        if self.done:
            raise StopIteration
        return self._take(self._sink.get(timeout))

    def __iter__(self) -> Iterator[Event]:
        while not self.done:
            yield self.next_event()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Waits for the end and returns the committed output (any unread events are folded in);
        raises queue.Empty if it has not ended within `timeout` seconds. It sleeps until the
        end instead of waking for every event: on a small machine a consumer thread that runs
        once per token takes the cores the model runs on (8 streams of the demo model: 0.3 ms
        of a 4 ms round)."""
        if not self.done and not self._sink.wait_ended(timeout):
            raise queue.Empty
        while not self.done:
            self._take(self._sink.get(0))
        return self._collector.result()

    def release(self) -> None:
        """Stops listening without waiting: cancels if still running, releases capacity."""
        if self._finalizer.detach() is not None:
            _drop(self._cancel_flag, self._capacity, self._wake)

    def close(self, timeout: float | None = SETTLE_S) -> GenerationResult | None:
        """Ends the request for good: cancels it if still running, waits up to `timeout`
        seconds for the Engine to finish it (its sequence and capacity are then back), and
        releases the handle. Returns the result, or None if it did not end in time (the
        Engine then frees it when it does). Safe to call again, and after the end."""
        if self.done:
            return self._collector.result()
        self.cancel()
        try:
            return self.result(timeout)
        except queue.Empty:
            return None
        finally:
            self.release()


class AsyncRequestHandle(RequestHandle):
    """The asyncio flavour: `async for event in handle`, `await handle.aresult()`."""

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.done:
            yield self._take(await self._sink.aget())

    async def anext_event(self) -> Event:
        """The next event; raises StopAsyncIteration when done."""
        if self.done:
            raise StopAsyncIteration
        return self._take(await self._sink.aget())

    async def aresult(self) -> GenerationResult:
        while not self.done:
            self._take(await self._sink.aget())
        return self._collector.result()

    async def aclose(self, timeout: float | None = SETTLE_S) -> GenerationResult | None:
        """`close` for asyncio code (waits on the event loop, not a thread)."""
        if self.done:
            return self._collector.result()
        self.cancel()
        try:
            return await asyncio.wait_for(self.aresult(), timeout)
        except (TimeoutError, asyncio.CancelledError):
            return None
        finally:
            self.release()


class TextStream:
    """`for delta in engine.stream(...)`: one request's Deltas as they are committed (text in
    `delta.text`, its channel in `delta.channel`); `.result` holds the GenerationResult once
    it ended. Leaving early ends the request: any exception inside the iteration (a
    KeyboardInterrupt from an interrupted notebook cell included) cancels it and waits for the
    Engine to free it before the exception goes on; so does `close()`, or leaving a
    `with engine.stream(...) as stream:` block, which also covers an exception raised in the
    loop's body."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.result: GenerationResult | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> Delta:
        try:
            while self.result is None:
                event = self.handle.next_event()
                if isinstance(event, Delta):
                    return event
                if isinstance(event, Finished):
                    self.result = self.handle.result()
        except StopIteration:
            self.result = self.handle.result()
        except BaseException:
            self.close()
            raise
        raise StopIteration

    def close(self) -> GenerationResult | None:
        """Cancels the request if it is still running and waits for its end (see
        `RequestHandle.close`)."""
        if self.result is None:
            self.result = self.handle.close()
        return self.result

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTextStream:
    """`async for delta in engine.astream(...)`: TextStream for asyncio code (Jupyter's running
    loop included); `async with` ends the request on leaving the block."""

    def __init__(self, handle: AsyncRequestHandle):
        self.handle = handle
        self.result: GenerationResult | None = None

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            while not self.handle.done:
                event = await self.handle.anext_event()
                if isinstance(event, Delta):
                    return event
        except BaseException:
            await self.aclose()
            raise
        self.result = await self.handle.aresult()
        raise StopAsyncIteration

    async def aclose(self) -> GenerationResult | None:
        if self.result is None:
            self.result = await self.handle.aclose()
        return self.result

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
