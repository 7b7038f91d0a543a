"""`keep_freed_memory`: on XLA:CPU with glibc, a large buffer freed and allocated again (what
every XLA:CPU call does with its temporary buffer) reuses the heap's pages instead of faulting
in new ones; NINFER_JAX_MALLOC=default leaves malloc as it is. Each case runs in its own
process (the setting is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, ctypes.util, json, resource, threading
from ninfer_jax.host_memory import keep_freed_memory
kept = keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)


def rounds(size, out):
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


main, worker = [], []
rounds(64 << 20, main)  # the demo model's scoring call's temporary buffer
# an XLA worker thread's buffers come from its own arena
thread = threading.Thread(target=rounds, args=(24 << 20, worker))
thread.start()
thread.join()
print(json.dumps({"kept": kept, "main": main[1:], "worker": worker[1:]}))
"""


def _probe(**env) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, timeout=120,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_buffer_is_reused_without_page_faults():
    kept = _probe()
    assert kept["kept"] is True
    assert max(kept["main"] + kept["worker"]) <= 4  # the heaps' pages, already resident
    default = _probe(NINFER_JAX_MALLOC="default")
    assert default["kept"] is False
    assert min(default["main"]) >= 16  # above glibc's mmap threshold: fresh pages each time
