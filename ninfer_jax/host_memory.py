"""How the process's C heap treats XLA:CPU's per-call buffers.

XLA:CPU allocates an executable's temporary buffer with malloc on every call and frees it after
(the demo model's 4096-token scoring call: 64 MB). glibc serves an allocation above its mmap
threshold (32 MB at most) with a fresh mapping and unmaps it on free, so every call faulted in
and zeroed all of those pages again: ~8% of that call on 2 cores (135 against 147 ms a call).
`keep_freed_memory` has glibc serve every allocation from its heap and keep what is freed for
the next call. The cost: the process's resident memory stays at its peak instead of shrinking
after it. Only on XLA:CPU (an accelerator's buffers are device memory), only with glibc, once
per process, and not when NINFER_JAX_MALLOC=default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import jax

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to allocate from its heap only and never trim it, when the default
    backend is the CPU; returns whether the setting is in force (False: another backend, a
    libc without mallopt, or NINFER_JAX_MALLOC=default)."""
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    if os.environ.get("NINFER_JAX_MALLOC") == "default" or jax.default_backend() != "cpu":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # M_TRIM_THRESHOLD takes an int: the largest one
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
