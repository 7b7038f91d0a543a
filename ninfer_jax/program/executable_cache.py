"""Whole executables kept across processes, beside jax's persistent compilation cache.

jax's cache skips XLA's compile, but a process still traces and lowers every step to find its
entry: for the embedded model 0.9 s of the prefill step and 0.4 s of decode at B = 1 on 2 cores,
the whole of a warm start's compile time and the stall before the second token of the README
main job. This cache keys a step by what decides its executable without tracing it (this
package's source, jax and the backend, the step function and its static arguments, the
argument shapes, dtypes and placements, donation, the mesh, XLA/jax settings) and stores the
compiled executable itself (`jax.experimental.serialize_executable`): a hit is a file read and a
load (~0.2 s for those two steps). It lives in `<jax_compilation_cache_dir>/ninfer-executables`
and is on exactly when jax's persistent cache is (`compile_cache`); entries are trusted as
jax's are (both hold machine code). Anything unreadable is a miss: the step is compiled as
before and the entry rewritten.

Only an executable XLA compiled in that very call is stored (jax reported a miss in its
persistent cache, and no hit): one jax loaded from its own cache, directly or through its
in-memory cache of an earlier load, re-serializes without some of its functions on XLA:CPU
(jax 0.10.2: "Function negate_power_fusion not found" when the entry ran). So a step whose
StableHLO jax's cache already holds under another key of ours (after an edit that left the
step's HLO as it was) keeps loading through jax's cache, tracing and lowering as before.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import jax
import jaxlib

log = logging.getLogger("ninfer_jax")

SUBDIR = "ninfer-executables"
_PACKAGES = ("ninfer_jax", "pallas_kernels")
# jax settings that name where things are kept or how they are logged, not what is compiled
_UNRELATED = ("cache", "log", "explain", "debug_nans", "traceback", "profil")
_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")


@functools.cache
def code_digest() -> str:
    """sha256 of every Python source of this package and the kernels (names and bytes)."""
    digest = hashlib.sha256()
    for name in _PACKAGES:
        root = pathlib.Path(__import__(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _fn_name(fn: Callable) -> str | None:
    """The step and its bound static arguments (never an object address), or None for a
    function whose name does not say what it computes (a closure, a lambda, a local)."""
    if isinstance(fn, functools.partial):
        inner = _fn_name(fn.func)
        if inner is None:
            return None
        static = sorted((k, repr(v)) for k, v in fn.keywords.items())
        return f"{inner}{static}{[repr(a) for a in fn.args]}"
    qualname = getattr(fn, "__qualname__", "<unknown>")
    if "<" in qualname or getattr(fn, "__closure__", None):
        return None
    return f"{fn.__module__}.{qualname}"


def _leaf(x: Any) -> str:
    return (f"{tuple(x.shape)}/{x.dtype}/{getattr(x, 'weak_type', False)}/"
            f"{getattr(x, 'sharding', None)!r}")


def key(fn: Callable, abstract: tuple, donate: tuple[str, ...], mesh: Any) -> str | None:
    """The entry's name: a digest of everything that decides the compiled executable (None:
    `fn` is not a module-level function, or one with static arguments bound, so what it
    captured would be missing from the name; such a step is never cached)."""
    name = _fn_name(fn)
    if name is None:
        return None
    leaves, tree = jax.tree.flatten(abstract)
    backend = jax.devices()[0].client
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items()
                      if not any(word in k for word in _UNRELATED))
    parts = [code_digest(), jax.__version__, jaxlib.__version__, backend.platform,
             backend.platform_version,
             [(d.id, d.device_kind) for d in jax.devices()], name, str(tree),
             [_leaf(x) for x in leaves], list(donate), repr(mesh), settings,
             [(var, os.environ.get(var)) for var in _ENV]]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


# This process's entries loaded, stored, and dropped as unreadable (read by tests and stats)
counts = {"loaded": 0, "stored": 0, "dropped": 0}
_compiling = threading.local()  # per thread: what jax's persistent cache said while compiling
_EVENTS = {"/jax/compilation_cache/cache_misses": "miss", "/jax/compilation_cache/cache_hits": "hit"}


def _on_jax_event(event: str, **_: Any) -> None:
    seen = _EVENTS.get(event)
    if seen is not None and hasattr(_compiling, "seen"):
        _compiling.seen.add(seen)


jax.monitoring.register_event_listener(_on_jax_event)


def compile_fresh(compile_fn: Callable[[], Any]) -> tuple[Any, bool]:
    """(compile_fn(), whether XLA compiled it in this call: jax's persistent cache missed and
    nothing was loaded, from that cache or jax's in-memory one; only such an executable may be
    stored)."""
    _compiling.seen = set()
    try:
        executable = compile_fn()
        return executable, _compiling.seen == {"miss"}
    finally:
        del _compiling.seen


def directory() -> pathlib.Path | None:
    """Where entries live; None while jax's persistent cache is off."""
    root = jax.config.jax_compilation_cache_dir
    return pathlib.Path(root) / SUBDIR if root else None


def load(name: str, devices: list | None = None) -> Any | None:
    """The executable stored under `name`, loaded onto `devices` (a mesh's, in its order; None:
    the default device), or None."""
    folder = directory()
    if folder is None:
        return None
    path = folder / f"{name}.exe"
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        from jax.experimental import serialize_executable

        executable = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices or jax.devices()[:1])
        counts["loaded"] += 1
        return executable
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a damaged or foreign entry is a miss, not an error
        log.warning("executable cache: dropping unreadable %s (%s: %s)", path.name,
                    type(e).__name__, e)
        path.unlink(missing_ok=True)
        counts["dropped"] += 1
        return None


def save(name: str, executable: Any) -> None:
    """Stores `executable` under `name` (written whole, then renamed: readers never see part of
    it). One that cannot be serialized, or a full disk, leaves no entry."""
    folder = directory()
    if folder is None:
        return
    try:
        from jax.experimental import serialize_executable

        blob = pickle.dumps(serialize_executable.serialize(executable))
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, folder / f"{name}.exe")
            counts["stored"] += 1
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
    except Exception as e:  # noqa: BLE001 - the step runs without an entry
        log.warning("executable cache: not stored (%s: %s)", type(e).__name__, e)
