"""Persistent XLA compilation cache set-up (DESIGN §15): a second process reuses compiled code."""

from __future__ import annotations

import os
import tempfile

import jax

_DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "ninfer_jax_xla_cache")
OFF = "off"  # NINFER_JAX_CACHE_DIR=off: the public API leaves jax's cache settings alone


def enable_persistent_cache(path: str | None = None) -> str:
    """Points jax's persistent compilation cache at `path` (or $NINFER_JAX_CACHE_DIR, or a temp dir).

    Caches every executable regardless of compile time or size, so repeated runs of the same
    config (tests, CLI invocations) skip compilation. Returns the directory used.
    """
    path = path or os.environ.get("NINFER_JAX_CACHE_DIR") or _DEFAULT_DIR
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def ensure_persistent_cache() -> str | None:
    """What `Engine.open` and `Scorer.open` call: the persistent cache as the CLI has it, unless
    jax already has a cache directory (the caller configured its own; that one is kept) or
    $NINFER_JAX_CACHE_DIR is "off". So a notebook's second session, or a second script, loads
    its executables instead of compiling them. Returns the directory in use (None: none)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if os.environ.get("NINFER_JAX_CACHE_DIR") == OFF:
        return None
    return enable_persistent_cache()
