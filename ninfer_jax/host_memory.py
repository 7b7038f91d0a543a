"""How the process's C heap treats XLA:CPU's per-call buffers.

XLA:CPU allocates an executable's temporary buffers on every call and frees them after (the demo
model's 4096-token scoring call: 64 MB), most with malloc, on the calling thread and on its
worker threads' arenas (a buffer the runtime maps itself, as one [4096, 4096] dot output was, is
beyond this setting). glibc served the large ones with fresh mappings and handed freed arena memory
back, so every call faulted in and zeroed tens of MB again (21,000-76,000 page faults a call).
`keep_freed_memory` has glibc serve every allocation from its heaps, keep what is freed, and grow
a heap with room to spare: ~1,500 faults, 146 against 167 ms a call (two turns each, one process
per turn). The cost: the process's resident memory stays at its peak instead of shrinking after
it. Only on XLA:CPU (an accelerator's buffers are device memory), only with glibc, once per
process, and not when NINFER_JAX_MALLOC=default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import jax

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_TOP_PAD = 512 << 20  # address space a heap grows by beyond a request (pages are touched lazily)

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to allocate from its heaps only, never trim them and grow them by
    _TOP_PAD, when the default backend is the CPU; returns whether the setting is in force
    (False: another backend, a libc without mallopt, or NINFER_JAX_MALLOC=default)."""
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
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, _TOP_PAD))
    applied = [mallopt(param, value) for param, value in settings]  # each one, none skipped
    return all(applied)
