"""The Program's pure step functions: `(params, pools, inputs) -> (pools, outputs)`.

Pools are donated by the executable table. A step reads committed GDN state and penalty counts
from slot rows and writes its results only to the provisional rows (one per batch row) and to
K/V positions past the committed frontier. Committing copies accepted provisional rows into
their slots; prefill and decode do that first, for the previous step (their `commit` input), so
a steady decode round is one dispatch. Every row write is an in-bounds dynamic-update-slice
(unused or rejected rows go to a sink row), which XLA does in place: a scatter that dropped
indices, or a pool read and written by the same step, made it copy whole pools.
Page ids, slot ids and positions are data; only the batch size and chunk length are shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6 import GDNState, ModelConfig, step
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.pools import PagedKV, Pools, write_rows
from ninfer_jax.program.sampling import (
    SamplingArrays,
    apply_penalties,
    mark_prompt_tokens,
    sample,
)


def _register(data, meta=()):
    return functools.partial(jax.tree_util.register_dataclass, data_fields=list(data),
                             meta_fields=list(meta))


@_register(["slots", "tokens", "count"])
@dataclasses.dataclass(frozen=True)
class CommitInputs:
    """What the last step's provisional rows 0..R-1 become (R: the batch of the step applying
    it, or max_concurrency for the standalone commit); a row not accepted (or unused) names
    the sink slot `num_slots`."""

    slots: jax.Array  # [R] int32, where provisional row r goes (num_slots: nowhere)
    tokens: jax.Array  # [R] int32, row r's sampled token
    count: jax.Array  # [R] bool, the token counts toward penalties (False for mid-prefill)


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


def commit_step(pools: Pools, inputs: CommitInputs) -> Pools:
    """Copies each provisional row to its slot (rejected and unused rows to the sink slot) and
    counts its token toward penalties where `count` says so."""
    rows = jnp.arange(inputs.slots.shape[0], dtype=jnp.int32)
    sink = pools.output_counts.shape[0] - 1
    counted = jnp.where(inputs.count, inputs.slots, sink)
    counts = pools.output_counts
    for r in range(inputs.slots.shape[0]):  # one element each: in place, no scatter
        at = (counted[r], inputs.tokens[r])
        counts = jax.lax.dynamic_update_slice(counts, (counts[at] + 1)[None, None], at)
    return dataclasses.replace(
        pools, conv=write_rows(pools.conv, inputs.slots, pools.prov_conv[rows]),
        rec=write_rows(pools.rec, inputs.slots, pools.prov_rec[rows]), output_counts=counts)


def _gdn_state(pools: Pools, slots: jax.Array) -> GDNState:
    """The committed GDN state of B slots, in the model's layout [L, B, ...]."""
    return GDNState(conv=jnp.swapaxes(pools.conv[slots], 0, 1),
                    recurrent=jnp.swapaxes(pools.rec[slots], 0, 1))


def _finish(pools: Pools, out, logits: jax.Array, counts: jax.Array, masks: jax.Array,
            inputs) -> tuple[Pools, StepOutputs]:
    """Writes the new K/V and the provisional GDN rows, and samples one token per row under its
    penalties."""
    b = logits.shape[0]
    rows = jnp.arange(b, dtype=jnp.int32)
    pools = dataclasses.replace(
        pools, k=out.kv.layers[0], v=out.kv.layers[1],
        prov_conv=write_rows(pools.prov_conv, rows, jnp.swapaxes(out.gdn.conv, 0, 1)),
        prov_rec=write_rows(pools.prov_rec, rows, jnp.swapaxes(out.gdn.recurrent, 0, 1)))
    sampled = sample(apply_penalties(logits, inputs.sampling, counts, masks), inputs.sampling,
                     inputs.step_index)
    return pools, StepOutputs(tokens=sampled.tokens, logprobs=sampled.logprobs)


def prefill_step(params: dict, pools: Pools, inputs: PrefillInputs, *, cfg: ModelConfig,
                 pcfg: ProgramConfig) -> tuple[Pools, StepOutputs]:
    """One staged-prefill chunk of one sequence; samples from the last valid position."""
    pools = commit_step(pools, inputs.commit)
    slot = inputs.slot
    fresh = inputs.reset[:, None]  # [1, 1]
    state = _gdn_state(pools, slot)
    gdn = GDNState(conv=jnp.where(fresh[None, :, :, None], 0, state.conv),
                   recurrent=jnp.where(fresh[None, :, :, None, None], 0.0, state.recurrent))
    # A sequence from root starts with no generated tokens and this chunk's prompt tokens.
    counts = jnp.where(fresh, 0, pools.output_counts[slot])
    chunk_valid = jnp.arange(inputs.token_ids.shape[1])[None, :] < inputs.num_valid[:, None]
    mask = mark_prompt_tokens(jnp.where(fresh, False, pools.prompt_mask[slot]),
                              inputs.token_ids, chunk_valid)
    pools = dataclasses.replace(pools, output_counts=write_rows(pools.output_counts, slot, counts),
                                prompt_mask=write_rows(pools.prompt_mask, slot, mask))
    kv = PagedKV(layers=(pools.k, pools.v), page_tables=inputs.page_table,
                 lengths=inputs.start_pos, num_valid=inputs.num_valid, impl=pcfg.attention_impl,
                 pages_per_layer=pcfg.num_pages + 1)
    out = step(params, cfg, inputs.token_ids, inputs.start_pos, gdn, kv, inputs.num_valid)
    last = jnp.take_along_axis(out.logits, (inputs.num_valid - 1)[:, None, None], axis=1)[:, 0]
    return _finish(pools, out, last, counts, mask, inputs)


def decode_step(params: dict, pools: Pools, inputs: DecodeInputs, *, cfg: ModelConfig,
                pcfg: ProgramConfig) -> tuple[Pools, StepOutputs]:
    """One token for each of B rows, each at its own position with its own pages and slot."""
    pools = commit_step(pools, inputs.commit)
    slots = inputs.slots
    b = slots.shape[0]
    kv = PagedKV(layers=(pools.k, pools.v), page_tables=inputs.page_tables,
                 lengths=inputs.positions, num_valid=jnp.ones((b,), jnp.int32),
                 impl=pcfg.attention_impl, pages_per_layer=pcfg.num_pages + 1)
    out = step(params, cfg, inputs.token_ids[:, None], inputs.positions,
               _gdn_state(pools, slots), kv)
    return _finish(pools, out, out.logits[:, 0], pools.output_counts[slots],
                   pools.prompt_mask[slots], inputs)


def capture_step(pools: Pools, inputs: CaptureInputs) -> Pools:
    """Copies a sequence's committed GDN state into a checkpoint slot (its K/V pages are shared)."""
    return dataclasses.replace(
        pools, ck_conv=write_rows(pools.ck_conv, inputs.ckpt_slot, pools.conv[inputs.slot]),
        ck_rec=write_rows(pools.ck_rec, inputs.ckpt_slot, pools.rec[inputs.slot]))


def restore_step(pools: Pools, inputs: RestoreInputs, *, pcfg: ProgramConfig) -> Pools:
    """Starts a sequence from a checkpoint: its GDN state, fresh penalty state with the prefix
    marked as prompt, and its own copy of the checkpoint's partial last page (in every
    attention layer)."""
    slot, ck = inputs.slot, inputs.ckpt_slot
    valid = jnp.arange(inputs.prefix_ids.shape[1])[None, :] < inputs.prefix_len[:, None]
    mask = mark_prompt_tokens(jnp.zeros_like(pools.prompt_mask[slot]), inputs.prefix_ids, valid)
    per_layer = pcfg.num_pages + 1
    layers = jnp.arange(pools.k.shape[0] // per_layer, dtype=jnp.int32) * per_layer
    src, dst = layers + inputs.copy_src, layers + inputs.copy_dst
    return dataclasses.replace(
        pools,
        conv=write_rows(pools.conv, slot, pools.ck_conv[ck]),
        rec=write_rows(pools.rec, slot, pools.ck_rec[ck]),
        output_counts=write_rows(pools.output_counts, slot,
                                 jnp.zeros_like(pools.output_counts[slot])),
        prompt_mask=write_rows(pools.prompt_mask, slot, mask),
        k=pools.k.at[dst].set(pools.k[src]),
        v=pools.v.at[dst].set(pools.v[src]))
