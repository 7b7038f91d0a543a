"""The DFlash drafter's context window in the pools: computing and writing its entries.

Owns turning the target's features at a step's positions into the drafter's context K/V and
writing them into the sequences' rings (`pools.context_ring`); the prefill chunk and the DFlash
verify step both call it. Reading the ring is the verify step's (`dflash_steps`).
"""

from __future__ import annotations

import dataclasses

import jax

from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.dflash.model import context_kv
from ninfer_jax.program.pools import Pools, write_context


def write_drafter_context(params: dict, drafter: DFlashConfig, pools: Pools,
                          slots: jax.Array, features: jax.Array, positions: jax.Array,
                          valid: jax.Array, ring: int) -> Pools:
    """The drafter's context K/V of the step's positions (features [B, T, F * H] of the
    target's `target_layer_ids`, positions [B, T]) written into the slots' rings where valid
    [B, T] (the rest to the sink entry)."""
    k, v = context_kv(params["dflash"], drafter, features, positions)
    return dataclasses.replace(
        pools, dk=write_context(pools.dk, slots, positions, valid, ring, k),
        dv=write_context(pools.dv, slots, positions, valid, ring, v))
