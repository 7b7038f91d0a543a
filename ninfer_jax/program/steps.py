"""The Program's pure step functions: `(params, pools, inputs) -> (pools, outputs)`.

Pools are donated by the executable table; every step writes only K/V pages (at positions past
the committed frontier) and the provisional GDN rows. `commit_step` is the only function that
changes committed state (GDN slots, penalty counts), for exactly the rows it is told to accept.
Prefill and decode begin by applying the previous step's commit (their `commit` input), so a
steady decode is one dispatch per round; the standalone commit runs only before a step that
takes no commit (capture, restore). Page ids, slot ids and positions are data; only the batch
size and chunk length are shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6 import GDNState, ModelConfig, step
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.pools import PagedKV, Pools
from ninfer_jax.program.sampling import (
    SamplingArrays,
    apply_penalties,
    mark_prompt_tokens,
    sample,
)


def _register(data, meta=()):
    return functools.partial(jax.tree_util.register_dataclass, data_fields=list(data),
                             meta_fields=list(meta))


@_register(["slots", "accept", "tokens", "count"])
@dataclasses.dataclass(frozen=True)
class CommitInputs:
    """Which provisional rows of the last step become committed state. Always max_concurrency
    rows (one per provisional row); unused rows carry an out-of-range slot and are dropped."""

    slots: jax.Array  # [Bmax] int32, the slot of provisional row r (num_slots: nothing)
    accept: jax.Array  # [Bmax] bool, adopt row r's provisional state
    tokens: jax.Array  # [Bmax] int32, row r's sampled token
    count: jax.Array  # [Bmax] bool, the token counts toward penalties (False for mid-prefill)


@_register(["commit", "token_ids", "start_pos", "num_valid", "page_table", "slot", "reset",
            "sampling", "step_index"])
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    commit: CommitInputs  # the previous step's commit, applied first
    token_ids: jax.Array  # [1, C] int32, the chunk (padded past num_valid)
    start_pos: jax.Array  # [1] int32, absolute position of token_ids[0, 0]
    num_valid: jax.Array  # [1] int32, real tokens in the chunk
    page_table: jax.Array  # [1, max_pages_per_seq] int32
    slot: jax.Array  # [1] int32, the sequence's committed state slot
    reset: jax.Array  # [1] bool, first chunk from root: start from zero state
    sampling: SamplingArrays  # [1] per-row sampling settings
    step_index: jax.Array  # [1] int32, generated tokens committed so far (the RNG stream index)


@_register(["commit", "token_ids", "positions", "slots", "page_tables", "sampling",
            "step_index"])
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    commit: CommitInputs  # the previous step's commit, applied first
    token_ids: jax.Array  # [B] int32, each row's last committed token
    positions: jax.Array  # [B] int32, its absolute position (= committed frontier)
    slots: jax.Array  # [B] int32, distinct state slots
    page_tables: jax.Array  # [B, max_pages_per_seq] int32
    sampling: SamplingArrays  # [B]
    step_index: jax.Array  # [B] int32


@_register(["slot", "ckpt_slot"])
@dataclasses.dataclass(frozen=True)
class CaptureInputs:
    slot: jax.Array  # [1] int32, the sequence's committed state slot
    ckpt_slot: jax.Array  # [1] int32, the checkpoint slot to fill


@_register(["ckpt_slot", "slot", "prefix_ids", "prefix_len", "copy_src", "copy_dst"])
@dataclasses.dataclass(frozen=True)
class RestoreInputs:
    ckpt_slot: jax.Array  # [1] int32
    slot: jax.Array  # [1] int32, the new sequence's state slot
    prefix_ids: jax.Array  # [1, max_seq_len] int32, the checkpoint's tokens (padded)
    prefix_len: jax.Array  # [1] int32, its frontier
    copy_src: jax.Array  # [1] int32, the shared partial page (or == copy_dst: no copy)
    copy_dst: jax.Array  # [1] int32, the sequence's own copy of it


@_register(["tokens", "logprobs"])
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    tokens: jax.Array  # [B] int32 sampled next tokens (provisional until commit)
    logprobs: jax.Array  # [B] float32 their log-probabilities (after penalties, temperature)


def _next_tokens(pools: Pools, slots, logits, sampling, step_index) -> StepOutputs:
    logits = apply_penalties(logits, sampling, pools.output_counts[slots], pools.prompt_mask[slots])
    out = sample(logits, sampling, step_index)
    return StepOutputs(tokens=out.tokens, logprobs=out.logprobs)


def _write_provisional(pools: Pools, gdn: GDNState) -> Pools:
    return dataclasses.replace(
        pools,
        prov_conv=jax.lax.dynamic_update_slice_in_dim(pools.prov_conv, gdn.conv, 0, axis=1),
        prov_rec=jax.lax.dynamic_update_slice_in_dim(pools.prov_rec, gdn.recurrent, 0, axis=1),
    )


def prefill_step(params: dict, pools: Pools, inputs: PrefillInputs, *, cfg: ModelConfig,
                 pcfg: ProgramConfig) -> tuple[Pools, StepOutputs]:
    """One staged-prefill chunk of one sequence; samples from the last valid position."""
    pools = commit_step(pools, inputs.commit)
    slot = inputs.slot
    keep = ~inputs.reset[:, None, None, None, None]
    gdn = GDNState(conv=jnp.where(keep[..., 0], pools.conv[:, slot], 0),
                   recurrent=jnp.where(keep, pools.rec[:, slot], 0.0))
    # A sequence from root starts with no generated tokens and this chunk's prompt tokens.
    fresh = inputs.reset[:, None]
    counts = jnp.where(fresh, 0, pools.output_counts[slot])
    chunk_valid = jnp.arange(inputs.token_ids.shape[1])[None, :] < inputs.num_valid[:, None]
    mask = mark_prompt_tokens(jnp.where(fresh, False, pools.prompt_mask[slot]),
                              inputs.token_ids, chunk_valid)
    pools = dataclasses.replace(pools, output_counts=pools.output_counts.at[slot].set(counts),
                                prompt_mask=pools.prompt_mask.at[slot].set(mask))
    kv = PagedKV(layers=(pools.k, pools.v), page_tables=inputs.page_table,
                 lengths=inputs.start_pos, num_valid=inputs.num_valid, impl=pcfg.attention_impl)
    out = step(params, cfg, inputs.token_ids, inputs.start_pos, gdn, kv, inputs.num_valid)
    pools = dataclasses.replace(pools, k=out.kv.layers[0], v=out.kv.layers[1])
    pools = _write_provisional(pools, out.gdn)
    last = jnp.take_along_axis(out.logits, (inputs.num_valid - 1)[:, None, None], axis=1)[:, 0]
    return pools, _next_tokens(pools, slot, last, inputs.sampling, inputs.step_index)


def decode_step(params: dict, pools: Pools, inputs: DecodeInputs, *, cfg: ModelConfig,
                pcfg: ProgramConfig) -> tuple[Pools, StepOutputs]:
    """One token for each of B rows, each at its own position with its own pages and slot."""
    pools = commit_step(pools, inputs.commit)
    slots = inputs.slots
    gdn = GDNState(conv=pools.conv[:, slots], recurrent=pools.rec[:, slots])
    b = slots.shape[0]
    kv = PagedKV(layers=(pools.k, pools.v), page_tables=inputs.page_tables,
                 lengths=inputs.positions, num_valid=jnp.ones((b,), jnp.int32),
                 impl=pcfg.attention_impl)
    out = step(params, cfg, inputs.token_ids[:, None], inputs.positions, gdn, kv)
    pools = dataclasses.replace(pools, k=out.kv.layers[0], v=out.kv.layers[1])
    pools = _write_provisional(pools, out.gdn)
    return pools, _next_tokens(pools, slots, out.logits[:, 0], inputs.sampling,
                               inputs.step_index)


def commit_step(pools: Pools, inputs: CommitInputs) -> Pools:
    """Adopts the provisional GDN rows of accepted rows into their slots; counts their tokens.
    Rows with an out-of-range slot (or not accepted) change nothing."""
    slots = jnp.where(inputs.accept, inputs.slots, pools.conv.shape[1])  # rejected: dropped

    def adopt(committed, provisional):
        return committed.at[:, slots].set(provisional, mode="drop")

    counted = jnp.where(inputs.count, slots, pools.output_counts.shape[0])
    counts = pools.output_counts.at[counted, inputs.tokens].add(1, mode="drop")
    return dataclasses.replace(pools, conv=adopt(pools.conv, pools.prov_conv),
                               rec=adopt(pools.rec, pools.prov_rec), output_counts=counts)


def capture_step(pools: Pools, inputs: CaptureInputs) -> Pools:
    """Copies a sequence's committed GDN state into a checkpoint slot (its K/V pages are shared)."""
    return dataclasses.replace(
        pools, ck_conv=pools.ck_conv.at[:, inputs.ckpt_slot].set(pools.conv[:, inputs.slot]),
        ck_rec=pools.ck_rec.at[:, inputs.ckpt_slot].set(pools.rec[:, inputs.slot]))


def restore_step(pools: Pools, inputs: RestoreInputs) -> Pools:
    """Starts a sequence from a checkpoint: its GDN state, fresh penalty state with the prefix
    marked as prompt, and its own copy of the checkpoint's partial last page."""
    slot, ck = inputs.slot, inputs.ckpt_slot
    valid = jnp.arange(inputs.prefix_ids.shape[1])[None, :] < inputs.prefix_len[:, None]
    mask = mark_prompt_tokens(jnp.zeros_like(pools.prompt_mask[slot]), inputs.prefix_ids, valid)
    src, dst = inputs.copy_src, inputs.copy_dst
    return dataclasses.replace(
        pools,
        conv=pools.conv.at[:, slot].set(pools.ck_conv[:, ck]),
        rec=pools.rec.at[:, slot].set(pools.ck_rec[:, ck]),
        output_counts=pools.output_counts.at[slot].set(0),
        prompt_mask=pools.prompt_mask.at[slot].set(mask),
        k=pools.k.at[:, dst].set(pools.k[:, src]),
        v=pools.v.at[:, dst].set(pools.v[:, src]))
