"""The table of ahead-of-time compiled step executables, keyed by a typed key (STYLE §3).

Owns compilation: every executable the Program will ever run is compiled at start-up, with the
pools donated. A key can be compiled in the foreground (the call returns when it is ready) or
queued for a background thread, in the order the Program expects to need them (prefill and
B = 1 first, the largest B last). Background compiles never compete with requests being served:
`hold(True)` (the Engine, while it has requests) keeps the thread from starting another one; a
call of a key still queued moves it to the front and compiles it even when held (what a request
uses is compiled first), and waits for it. At interpreter exit queued compiles are dropped
(`_close_at_exit`). A key that was never requested raises; nothing compiles outside this table.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ninfer_jax.program import executable_cache
from ninfer_jax.program.errors import MissingExecutableError


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COMMIT = "commit"
    CAPTURE = "capture"
    RESTORE = "restore"
    EXPORT_PAGES = "export_pages"  # batch: pages per call
    IMPORT_PAGES = "import_pages"
    EXPORT_STATE = "export_state"
    IMPORT_STATE = "import_state"
    SCORE_WINDOW = "score_window"  # the CausalScoring purpose: batch windows of `length` tokens
    # batch contexts of `length` tokens, extra = (continuation rows, their length)
    SCORE_SHARED = "score_shared"
    VISION_ENCODE = "vision_encode"  # the vision tower on `length` (a bucket) packed patches


@dataclasses.dataclass(frozen=True)
class StepKey:
    kind: StepKind
    batch: int
    length: int = 0  # tokens per row, where the kind's shape is not fixed by the ProgramConfig
    extra: tuple[int, ...] = ()  # further shape numbers of a kind with more than two


def abstract_args(tree: Any, mesh: Mesh | None = None) -> Any:
    """Shapes only (no buffer is kept). On a mesh every leaf carries its placement: a device
    array or a placed ShapeDtypeStruct its own, a host array (a step's inputs) replicated on
    every device."""
    if mesh is None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    every = NamedSharding(mesh, PartitionSpec())

    def placed(a):
        sharding = a.sharding if isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding or every)

    return jax.tree.map(placed, tree)


def on_mesh(mesh: Mesh | None):
    """The context a step is traced in: its mesh (kernels that run per device read it, see
    `pools.attention`), or none."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def jit_step(fn: Callable, abstract: tuple, donate: tuple[str, ...], mesh: Mesh | None) -> Any:
    """fn jitted with `donate` donated. On a mesh its outputs are placed as its inputs: a
    returned Pools as the Pools it took (so the donated buffers alias and the next step takes
    them as they are), everything else replicated."""
    if mesh is None:
        return jax.jit(fn, donate_argnames=donate)
    from ninfer_jax.program.pools import Pools  # the pools module imports the kernels

    def is_pools(x):
        return isinstance(x, Pools)

    pools = next((a for a in abstract if is_pools(a)), None)
    every = NamedSharding(mesh, PartitionSpec())
    out = jax.eval_shape(fn, *abstract)
    shardings = jax.tree.map(
        lambda x: jax.tree.map(lambda a: a.sharding, pools) if is_pools(x) else every,
        out, is_leaf=is_pools)
    return jax.jit(fn, donate_argnames=donate, out_shardings=shardings)


def _lower_priority() -> None:
    """Background compiles yield the cores to the steps serving requests (Linux: per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class ExecutableTable:
    """StepKey -> compiled executable. Pools are donated (argument `pools`, by default).
    `mesh`: the tensor-parallel mesh the steps run on (`program.sharding`; None: one device)."""

    def __init__(self, mesh: Mesh | None = None):
        self.mesh = mesh
        self._table: dict[StepKey, Callable] = {}
        self._pending: dict[StepKey, concurrent.futures.Future] = {}
        self._jobs = _Jobs()  # queued background compiles, shared with the compile thread
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the worker and a waiting thread may both resolve a key
        self.compile_seconds: dict[StepKey, float] = {}

    def compile(self, key: StepKey, fn: Callable, *example_args: Any,
                background: bool = False, donate: tuple[str, ...] = ("pools",)) -> None:
        """Lowers `fn(*example_args)` for those shapes with the `donate` arguments donated and
        stores it; with `background`, on the table's compile thread (keys compile in the order
        given)."""
        abstract = tuple(abstract_args(a, self.mesh) for a in example_args)
        if not background:
            self._table[key] = self._build(key, fn, abstract, donate)
            return
        if self._thread is None:
            # A daemon, so a process that ends need not wait for compiles it will never use
            # (see _close_at_exit). It holds the table weakly: a table dropped without close()
            # (its Program garbage) stops compiling what nobody can call.
            self._thread = threading.Thread(
                target=_compile_loop, args=(weakref.ref(self), self._jobs), daemon=True,
                name="ninfer-compile")
            self._thread.start()
            _THREADS.add(self._thread)
            _LIVE.add(self)
            weakref.finalize(self, _drop_queued, self._jobs, self._pending, self._lock)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending[key] = future
        self._jobs.put(key, (fn, abstract, donate, self.mesh, future))

    def hold(self, held: bool) -> None:
        """While held, the compile thread starts no queued compile that nobody waits for (the
        one running finishes); released, it goes on in order."""
        self._jobs.hold(held)

    def close(self, wait: bool = False) -> None:
        """Drops the compiles not started yet (a call of such a key then raises); `wait` also
        waits for the one in progress."""
        if self._thread is None:
            return
        _drop_queued(self._jobs, self._pending, self._lock)
        if wait:
            self._thread.join()

    def _build(self, key: StepKey, fn: Callable, abstract: tuple,
               donate: tuple[str, ...]) -> Callable:
        executable, self.compile_seconds[key] = _build(fn, abstract, donate, self.mesh)
        return executable

    def _get(self, key: StepKey) -> Callable:
        executable = self._table.get(key)
        if executable is not None:
            return executable
        with self._lock:
            future = self._pending.get(key)
        if future is None:
            if key in self._table:
                return self._table[key]
            raise MissingExecutableError(
                f"no executable for {key}; compiled: {sorted(map(str, self.keys()))}")
        self._jobs.want(key)  # first in line, held or not
        try:
            executable = future.result()  # a compile error surfaces here
        except concurrent.futures.CancelledError:
            raise MissingExecutableError(f"{key} was dropped: the Program is closed") from None
        with self._lock:
            self._table[key] = executable
            self._pending.pop(key, None)
        return executable

    def memory(self, key: StepKey) -> dict[str, int]:
        """The compiled executable's buffer sizes in bytes (XLA's memory analysis): arguments,
        outputs, and temporaries (its working memory beside the pools). Waits for its compile."""
        m = self._get(key).memory_analysis()
        return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                "temp": int(m.temp_size_in_bytes)}

    def hlo_text(self, key: StepKey) -> str:
        """The compiled executable's optimized HLO (`program/hlo.py` reads it). Waits for its
        compile."""
        return self._get(key).as_text()

    def __call__(self, key: StepKey, *args: Any) -> Any:
        return self._get(key)(*args)

    def pending(self) -> list[StepKey]:
        """Queued keys not yet called or waited for (their compile may have finished)."""
        with self._lock:
            return list(self._pending)

    def wait(self, on_ready: Callable[[StepKey], None] | None = None) -> None:
        """Returns once every queued compile is done (raises the first compile error), calling
        `on_ready(key)` for each key of `pending()` as it is ready (in compile order)."""
        for key in self.pending():
            self._get(key)
            if on_ready is not None:
                on_ready(key)

    def is_ready(self, key: StepKey) -> bool:
        """Whether calling `key` would not wait for a compile (a failed one counts as not)."""
        if key in self._table:
            return True
        with self._lock:
            future = self._pending.get(key)
        return future is not None and future.done() and not future.cancelled() \
            and future.exception() is None

    @property
    def ready(self) -> bool:
        with self._lock:
            return all(f.done() for f in self._pending.values())

    def keys(self) -> list[StepKey]:
        with self._lock:
            return list(self._table) + list(self._pending)


def _build(fn: Callable, abstract: tuple, donate: tuple[str, ...],
           mesh: Mesh | None) -> tuple[Callable, float]:
    """(the executable of fn for those shapes with `donate` donated, compile seconds): from the
    executable cache when it holds one (`executable_cache`), else compiled and stored there."""
    start = time.perf_counter()
    name = (executable_cache.key(fn, abstract, donate, mesh)
            if executable_cache.directory() is not None else None)
    devices = None if mesh is None else list(mesh.devices.flat)
    executable = executable_cache.load(name, devices) if name else None
    if executable is None:
        with on_mesh(mesh):
            executable, fresh = executable_cache.compile_fresh(
                lambda: jit_step(fn, abstract, donate, mesh).lower(*abstract).compile())
        if name and fresh:
            executable_cache.save(name, executable)
    return executable, time.perf_counter() - start


class _Jobs:
    """The background compile queue: jobs in order, a hold, and keys someone waits for."""

    def __init__(self):
        self._cv = threading.Condition()
        self._order: list[tuple[StepKey, tuple]] = []
        self._wanted: set[StepKey] = set()
        self._held = False
        self._stopped = False

    def put(self, key: StepKey, job: tuple) -> None:
        with self._cv:
            self._order.append((key, job))
            self._cv.notify_all()

    def want(self, key: StepKey) -> None:
        with self._cv:
            if any(k == key for k, _ in self._order):
                self._wanted.add(key)
                self._cv.notify_all()

    def hold(self, held: bool) -> None:
        with self._cv:
            self._held = held
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._order.clear()
            self._cv.notify_all()

    def take(self) -> tuple[StepKey, tuple] | None:
        """The next job to compile (a wanted one first; none while held unless wanted), or
        None once stopped."""
        with self._cv:
            while True:
                if self._stopped:
                    return None
                at = next((i for i, (k, _) in enumerate(self._order) if k in self._wanted),
                          None)
                if at is None and self._order and not self._held:
                    at = 0
                if at is not None:
                    key, job = self._order.pop(at)
                    self._wanted.discard(key)
                    return key, job
                self._cv.wait()


def _compile_loop(table_ref: weakref.ref, jobs: _Jobs) -> None:
    """The background compile thread: builds queued jobs until told to stop or its table is
    gone (no strong reference to the table is held while compiling)."""
    _lower_priority()
    while (taken := jobs.take()) is not None:
        key, (fn, abstract, donate, mesh, future) = taken
        if table_ref() is None:
            break
        if not future.set_running_or_notify_cancel():
            continue
        try:
            executable, seconds = _build(fn, abstract, donate, mesh)
        except BaseException as e:  # noqa: BLE001 - delivered to whoever calls the key
            future.set_exception(e)
            continue
        table = table_ref()
        if table is not None:
            table.compile_seconds[key] = seconds
        del table
        future.set_result(executable)


def _drop_queued(jobs: _Jobs, pending: dict, lock: threading.Lock) -> None:
    """Cancels the compiles not started yet and stops the table's thread after the running one
    (close(), or the table garbage-collected)."""
    with lock:
        for future in pending.values():
            future.cancel()
    jobs.stop()


_LIVE: weakref.WeakSet[ExecutableTable] = weakref.WeakSet()
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Interpreter exit: queued compiles are dropped. A compile still running in a daemon thread
    would abort the process when finalization stops it, so it is waited for here; a command
    line that must not wait for it ends its process itself (`gateway.cli.run`)."""
    for table in list(_LIVE):
        table.close()
    for thread in list(_THREADS):
        thread.join()


def bind(fn: Callable, **static: Any) -> Callable:
    """fn with its static (hashable) keyword arguments fixed, keeping argument names for donation."""
    return functools.wraps(fn)(functools.partial(fn, **static))
