"""The Program's pure step functions: `(params, pools, inputs) -> (pools, outputs)`.

Pools are donated by the executable table. A step reads committed GDN state and penalty counts
from slot rows and writes its results only to the provisional rows (one per batch row) and to
K/V positions past the committed frontier. Committing copies accepted provisional rows into
their slots; prefill and decode do that first, for the previous step (their `commit` input), so
a steady decode round is one dispatch. Every row write is an in-bounds dynamic-update-slice
(unused or rejected rows go to a sink row), which XLA does in place: a scatter that dropped
indices, or a pool read and written by the same step, made it copy whole pools.
Page ids, slot ids and positions are data; only the batch size and chunk length are shapes.

With MTP speculation (`ProgramConfig.speculative == "mtp"`, K drafts, T = K + 1) a decode
round is `verify_step`: the head drafts K tokens from the slot's MTP context, the model runs
the last committed token and the drafts at T positions keeping its GDN state after each, the
acceptance rule (`speculative.accept`) picks each row's tokens, and the head's K/V at the new
positions is rewritten from the model's hidden states. A commit of n tokens adopts the state
after position n - 1. The head's K/V at position p depends on token p + 1, so the one at the
frontier's last position is written by the step that knows the token after it (the next
round, or the next prefill chunk): a step writes K/V only at positions >= frontier - 1.

With a DFlash drafter (`speculative == "dflash"`, `drafter` its config) a decode round is
`dflash_steps.dflash_verify_step`; prefill chunks also write the drafter's context K/V of their
positions into the slot's ring (`drafter_context`), so every committed position's context is
there before a block reads it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.qwen3_6 import GDNState, ModelConfig, step
from ninfer_jax.models.qwen3_6.model import lm_head
from ninfer_jax.models.qwen3_6.mtp import mtp_hidden, mtp_store
from ninfer_jax.models.qwen3_6.vision import encode
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.drafter_context import write_drafter_context
from ninfer_jax.program.pools import (
    PagedKV,
    Pools,
    context_positions,
    context_ring,
    write_rows,
)
from ninfer_jax.program.sampling import (
    SamplingArrays,
    apply_penalties,
    count_tokens,
    mark_prompt_tokens,
    sample,
    top_logprobs,
)
from ninfer_jax.program.speculative import accept, draft_token


def _register(data, meta=()):
    return functools.partial(jax.tree_util.register_dataclass, data_fields=list(data),
                             meta_fields=list(meta))


@_register(["slots", "tokens", "num", "count"])
@dataclasses.dataclass(frozen=True)
class CommitInputs:
    """What the last step's provisional rows 0..R-1 become (R: the batch of the step applying
    it, or max_concurrency for the standalone commit); a row not accepted (or unused) names
    the sink slot `num_slots`."""

    slots: jax.Array  # [R] int32, where provisional row r goes (num_slots: nowhere)
    tokens: jax.Array  # [R, T] int32, row r's tokens
    num: jax.Array  # [R] int32 in 1..T, positions adopted: the state after position num - 1
    count: jax.Array  # [R] bool, the first num tokens count toward penalties (not mid-prefill)


@_register(["commit", "token_ids", "start_pos", "num_valid", "page_table", "slot", "reset",
            "sampling", "step_index", "rope_positions", "vision_embeds", "vision_mask"])
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
    step_index: jax.Array  # [1] int32, the sampled token's position (the RNG stream index)
    # A model with a vision tower (None otherwise): the chunk's MRoPE positions [3, 1, C]
    # int32, and the vision embeddings [1, C, H] that replace the token embedding where
    # vision_mask [1, C] bool is set (image/video placeholders).
    rope_positions: jax.Array | None = None
    vision_embeds: jax.Array | None = None
    vision_mask: jax.Array | None = None


@_register(["commit", "token_ids", "positions", "slots", "page_tables", "sampling",
            "step_index", "limit", "rope_delta", "context_from"])
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    commit: CommitInputs  # the previous step's commit, applied first
    token_ids: jax.Array  # [B] int32, each row's last committed token
    positions: jax.Array  # [B] int32, its absolute position (= committed frontier)
    slots: jax.Array  # [B] int32, distinct state slots
    page_tables: jax.Array  # [B, max_pages_per_seq] int32
    sampling: SamplingArrays  # [B]
    step_index: jax.Array  # [B] int32, the first proposed token's position (the RNG index)
    limit: jax.Array  # [B] int32 in 1..T, most tokens row b may propose (its budget)
    # A model with a vision tower (None otherwise): [B] int32, each row's MRoPE delta; its
    # rope position is positions + rope_delta in all three rows (0 for a text-only prompt).
    rope_delta: jax.Array | None = None
    # A DFlash round that drafts (None for the others): [B] int32, the first position of each
    # row's ring a block may read: the one after its last bare round (`SeqRecord.context_from`,
    # 0: none), whose entries below it may hold an older position's (bare rounds write none).
    context_from: jax.Array | None = None


@_register(["patches", "pos_index", "pos_weight", "rope_hw", "segment"])
@dataclasses.dataclass(frozen=True)
class VisionEncodeInputs:
    """The packed patches of a prompt's images/videos padded to N (a bucket) and their
    `vision_layout` arrays."""

    patches: jax.Array  # [N, patch_dim] float32
    pos_index: jax.Array  # [N, 4] int32
    pos_weight: jax.Array  # [N, 4] float32
    rope_hw: jax.Array  # [N, 2] int32
    segment: jax.Array  # [N] int32


@_register(["slot", "ckpt_slot", "frontier", "context_from"])
@dataclasses.dataclass(frozen=True)
class CaptureInputs:
    slot: jax.Array  # [1] int32, the sequence's committed state slot
    ckpt_slot: jax.Array  # [1] int32, the checkpoint slot to fill
    frontier: jax.Array  # [1] int32, the sequence's committed frontier (the drafter's ring)
    context_from: jax.Array  # [1] int32, the ring's first readable position (`DecodeInputs`)


@_register(["ckpt_slot", "slot", "prefix_ids", "prefix_len", "copy_src", "copy_dst"])
@dataclasses.dataclass(frozen=True)
class RestoreInputs:
    ckpt_slot: jax.Array  # [1] int32
    slot: jax.Array  # [1] int32, the new sequence's state slot
    prefix_ids: jax.Array  # [1, max_seq_len] int32, the checkpoint's tokens (padded)
    prefix_len: jax.Array  # [1] int32, its frontier
    copy_src: jax.Array  # [1] int32, the shared partial page (or == copy_dst: no copy)
    copy_dst: jax.Array  # [1] int32, the sequence's own copy of it


@_register(["pages"])
@dataclasses.dataclass(frozen=True)
class PageRows:
    pages: jax.Array  # [G] int32 page ids (num_pages, the sink, for unused rows)


@_register(["pages", "k", "v", "k_scale", "v_scale"])
@dataclasses.dataclass(frozen=True)
class PageImport:
    pages: jax.Array  # [G] int32 page ids (num_pages, the sink, for unused rows)
    k: jax.Array  # [G, La, page_size, Hkv, D] page dtype, each page's K in every attention layer
    v: jax.Array  # [G, La, page_size, Hkv, D]
    k_scale: jax.Array | None = None  # [G, La, page_size, Hkv] float32 (INT8 pages; else None)
    v_scale: jax.Array | None = None

    @property
    def kv(self) -> tuple[jax.Array, ...]:
        """The pages' arrays in `Pools.kv`'s order."""
        return (self.k, self.v) if self.k_scale is None else (
            self.k, self.v, self.k_scale, self.v_scale)


@_register(["ckpt_slot"])
@dataclasses.dataclass(frozen=True)
class StateRow:
    ckpt_slot: jax.Array  # [1] int32


@_register(["ckpt_slot", "conv", "rec", "ctx", "dk", "dv"])
@dataclasses.dataclass(frozen=True)
class StateImport:
    ckpt_slot: jax.Array  # [1] int32
    conv: jax.Array  # [1, Ll, conv_dim, K-1]
    rec: jax.Array  # [1, Ll, Hv, dk, dv] float32
    ctx: jax.Array  # [1, H]
    dk: jax.Array | None = None  # [1, R + 1, Ld, Hkv_d, D_d], the drafter's context (or None)
    dv: jax.Array | None = None


@_register(["tokens", "num", "logprobs", "top_ids", "top_logprobs", "last"])
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    tokens: jax.Array  # [B, T] int32 proposed tokens (provisional until commit)
    num: jax.Array  # [B] int32, row b's candidates: its first num[b] tokens
    logprobs: jax.Array  # [B, T] float32 their log-probabilities (after penalties, temperature)
    top_ids: jax.Array  # [B, T, N] int32, each position's N most likely tokens (zeros unless
    #   a row of the batch asked for log-probs; `sampling.top_logprobs`)
    top_logprobs: jax.Array  # [B, T, N] float32, their log-probabilities
    # A plain decode step's tokens as [B] (None for the others): the next round's input when
    # it is dispatched before this one's tokens are read (`HostProgram.commit`).
    last: jax.Array | None = None


def commit_step(pools: Pools, inputs: CommitInputs) -> Pools:
    """Copies each provisional row's state after its num - 1-th position to its slot (rejected
    and unused rows to the sink slot) and counts its first num tokens toward penalties where
    `count` says so."""
    r_, t_ = inputs.tokens.shape
    rows = jnp.arange(r_, dtype=jnp.int32)
    at = jnp.clip(inputs.num - 1, 0, t_ - 1)
    sink = pools.output_counts.shape[0] - 1
    counts = pools.output_counts
    for r in range(r_):  # one element each: in place, no scatter
        for t in range(t_):
            row = jnp.where(inputs.count[r] & (t < inputs.num[r]), inputs.slots[r], sink)
            here = (row, inputs.tokens[r, t])
            counts = jax.lax.dynamic_update_slice(counts, (counts[here] + 1)[None, None], here)
    return dataclasses.replace(
        pools, conv=write_rows(pools.conv, inputs.slots, pools.prov_conv[rows, at]),
        rec=write_rows(pools.rec, inputs.slots, pools.prov_rec[rows, at]),
        ctx=write_rows(pools.ctx, inputs.slots, pools.prov_ctx[rows, at]), output_counts=counts)


def gdn_state(pools: Pools, slots: jax.Array, pcfg: ProgramConfig) -> GDNState:
    """The committed GDN state of B slots, in the model's layout [L, B, ...], updated by the
    layers with `pcfg.gdn_impl`."""
    return GDNState(conv=jnp.swapaxes(pools.conv[slots], 0, 1),
                    recurrent=jnp.swapaxes(pools.rec[slots], 0, 1), impl=pcfg.gdn_impl)


def _finish(pools: Pools, out, logits: jax.Array, counts: jax.Array, masks: jax.Array,
            inputs, ctx: jax.Array) -> tuple[Pools, StepOutputs]:
    """Writes the new K/V, the provisional GDN rows and MTP context (ctx [B, H]: position 0 of
    each row), and samples one token per row under its penalties."""
    b = logits.shape[0]
    one_position = GDNState(conv=out.gdn.conv[:, :, None], recurrent=out.gdn.recurrent[:, :, None])
    pools = write_provisional(pools, out.kv.layers, one_position, ctx[:, None])
    penalised = apply_penalties(logits, inputs.sampling, counts, masks)
    sampled = sample(penalised, inputs.sampling, inputs.step_index)
    top_ids, top_lps = top_logprobs(penalised, inputs.sampling)
    return pools, StepOutputs(tokens=sampled.tokens[:, None], num=jnp.ones((b,), jnp.int32),
                              logprobs=sampled.logprobs[:, None], top_ids=top_ids[:, None],
                              top_logprobs=top_lps[:, None], last=sampled.tokens)


def write_provisional(pools: Pools, kv_layers, gdn: GDNState, ctx: jax.Array) -> Pools:
    """The step's K/V pools, and its provisional rows: the GDN state after each of the step's
    positions (gdn with [L, B, T', ...] leaves, T' <= T) and the MTP context (ctx [B, T', H])."""
    rows = jnp.arange(ctx.shape[0], dtype=jnp.int32)

    def by_row(a: jax.Array) -> jax.Array:  # [L, B, T', ...] -> [B, T', L, ...]
        return jnp.moveaxis(a, 0, 2)

    return dataclasses.replace(
        pools.with_kv(kv_layers),
        prov_conv=write_rows(pools.prov_conv, rows, by_row(gdn.conv)),
        prov_rec=write_rows(pools.prov_rec, rows, by_row(gdn.recurrent)),
        prov_ctx=write_rows(pools.prov_ctx, rows, ctx))


def _mtp_kv(kv: PagedKV, cfg: ModelConfig, lengths: jax.Array, num_valid: jax.Array) -> PagedKV:
    """The same pools and page tables, addressed at the MTP head's attention layers, which do
    not read the entries bare rounds left empty (`decode_step`)."""
    return dataclasses.replace(kv, lengths=lengths, num_valid=num_valid,
                               first_layer=cfg.num_attention_layers, skip_empty=True)


def prefill_step(params: dict, pools: Pools, inputs: PrefillInputs, *, cfg: ModelConfig,
                 pcfg: ProgramConfig, drafter: DFlashConfig | None = None
                 ) -> tuple[Pools, StepOutputs]:
    """One staged-prefill chunk of one sequence; samples from the last valid position."""
    pools = commit_step(pools, inputs.commit)
    slot = inputs.slot
    fresh = inputs.reset[:, None]  # [1, 1]
    state = gdn_state(pools, slot, pcfg)
    gdn = dataclasses.replace(
        state, conv=jnp.where(fresh[None, :, :, None], 0, state.conv),
        recurrent=jnp.where(fresh[None, :, :, None, None], 0.0, state.recurrent))
    # A sequence from root starts with no generated tokens and this chunk's prompt tokens.
    counts = jnp.where(fresh, 0, pools.output_counts[slot])
    chunk_valid = jnp.arange(inputs.token_ids.shape[1])[None, :] < inputs.num_valid[:, None]
    mask = mark_prompt_tokens(jnp.where(fresh, False, pools.prompt_mask[slot]),
                              inputs.token_ids, chunk_valid)
    pools = dataclasses.replace(pools, output_counts=write_rows(pools.output_counts, slot, counts),
                                prompt_mask=write_rows(pools.prompt_mask, slot, mask))
    kv = PagedKV(layers=pools.kv, page_tables=inputs.page_table,
                 lengths=inputs.start_pos, num_valid=inputs.num_valid, impl=pcfg.attention_impl,
                 pages_per_layer=pcfg.num_pages + 1)
    last_at = inputs.num_valid - 1
    out = step(params, cfg, inputs.token_ids, inputs.start_pos, gdn, kv, inputs.num_valid,
               logits_at=last_at, feature_layers=_feature_layers(drafter),
               rope_positions=inputs.rope_positions, vision_embeds=inputs.vision_embeds,
               vision_mask=inputs.vision_mask, moe_sharding=pcfg.moe_sharding)
    ctx = jnp.take_along_axis(out.hidden, last_at[:, None, None], axis=1)[:, 0]
    pools, outputs = _finish(pools, out, out.logits[:, 0], counts, mask, inputs, ctx)
    if pcfg.speculative == "mtp":
        pools = _prefill_mtp(params, cfg, pools, out.hidden, inputs, kv, pcfg.moe_sharding)
    if drafter is not None:
        c = inputs.token_ids.shape[1]
        ring, _ = context_ring(drafter, pcfg)
        t = jnp.arange(c, dtype=jnp.int32)[None, :]
        nv = inputs.num_valid[:, None]
        # Only the chunk's last R valid positions: distinct ring entries.
        pools = write_drafter_context(params, drafter, pools, slot, out.features,
                               inputs.start_pos[:, None] + t, (t < nv) & (t >= nv - ring), ring)
    return pools, outputs


def _feature_layers(drafter: DFlashConfig | None) -> tuple[int, ...]:
    return () if drafter is None else drafter.target_layer_ids


def _prefill_mtp(params: dict, cfg: ModelConfig, pools: Pools, hidden: jax.Array,
                 inputs: PrefillInputs, kv: PagedKV, moe_sharding: str) -> Pools:
    """The MTP head's K/V for the chunk. Position p takes (hidden state p, token p + 1), from
    the position before the chunk (whose hidden state is the slot's context; none from root)
    to the one before the chunk's last: the last one's next token comes with the next chunk or
    the first round, which write it."""
    nv = inputs.num_valid
    before = jnp.where(inputs.reset, 0, 1)  # [1]
    ctx = pools.ctx[inputs.slot][:, None].astype(hidden.dtype)  # [1, 1, H]
    hidden = jnp.where(before[:, None, None] == 1,
                       jnp.concatenate([ctx, hidden[:, :-1]], axis=1), hidden)
    ids = inputs.token_ids
    next_ids = jnp.where(before[:, None] == 1, ids,
                         jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1))
    start = inputs.start_pos - before
    mkv = _mtp_kv(dataclasses.replace(kv, layers=pools.kv), cfg, start,
                  nv - 1 + before)
    _, mkv = mtp_hidden(params, cfg, hidden, next_ids, start, mkv, moe_sharding)
    return pools.with_kv(mkv.layers)


def decode_step(params: dict, pools: Pools, inputs: DecodeInputs, *, cfg: ModelConfig,
                pcfg: ProgramConfig, drafter: DFlashConfig | None = None, bare: bool = False,
                lean: bool = False) -> tuple[Pools, StepOutputs]:
    """One token for each of B rows, each at its own position with its own pages and slot.

    In a speculative Program it is the round of 0 drafts and keeps what the next verify round
    reads current, as a verify round would: the MTP head's K/V at the frontier's last position
    and the new one (`verify_step`), or the drafter's context K/V of the new position. Its
    tokens come back [B, 1] and its commit is as narrow (`executable_specs.round_width`).
    `bare` (DFlash with a sliding-window drafter): the drafter's rings are neither read nor
    written, nor passed (`executable_specs.round_pools`): the new position's entry keeps an
    older position's, which no block reads (a block reads only positions from the row's
    `context_from`, past its last bare round) and the window's moving past it leaves the
    context the upkeep would have left. `bare` (MTP, every row after a decode round): the
    head's K/V at the new position are zeros, which its attention does not read
    (`PagedKV.skip_empty`): the head's context lacks that position for good (what that
    costs the drafts: docs/speculative.md, bare rounds). `lean` (MTP): every row's last
    committed step was a decode round, which wrote the head's K/V at frontier - 1 with the
    token at the frontier (`SeqRecord.after_decode`), so only the new position's is written
    (what that saves: docs/speculative.md, lean rounds)."""
    pools = commit_step(pools, inputs.commit)
    slots, pos = inputs.slots, inputs.positions
    b = slots.shape[0]
    kv = PagedKV(layers=pools.kv, page_tables=inputs.page_tables,
                 lengths=pos, num_valid=jnp.ones((b,), jnp.int32),
                 impl=pcfg.attention_impl, pages_per_layer=pcfg.num_pages + 1)
    if pcfg.speculative == "mtp" and bare:
        # before the model reads the pools: written after that read (on which zeros do not
        # wait), the write made XLA copy both pools
        kv = kv.with_layers(_empty_mtp_entries(cfg, kv, pos))
        pools = pools.with_kv(kv.layers)
    rope = None if inputs.rope_delta is None else (pos + inputs.rope_delta)[:, None]
    ctx = pools.ctx[slots][:, None]  # the hidden state at frontier - 1, before this step's
    out = step(params, cfg, inputs.token_ids[:, None], pos,
               gdn_state(pools, slots, pcfg), kv, rope_positions=rope,
               feature_layers=() if bare else _feature_layers(drafter),
               moe_sharding=pcfg.moe_sharding)
    pools, outputs = _finish(pools, out, out.logits[:, 0], pools.output_counts[slots],
                             pools.prompt_mask[slots], inputs, out.hidden[:, 0])
    if pcfg.speculative == "mtp" and not bare:  # (hidden at a position, the token after it)
        if lean:  # the new position
            hidden, after, start = out.hidden, outputs.last[:, None], pos
        else:  # positions pos - 1 and pos
            hidden = jnp.concatenate([ctx.astype(out.hidden.dtype), out.hidden], axis=1)
            after = jnp.stack([inputs.token_ids, outputs.last], axis=1)
            start = pos - 1
        mkv = mtp_store(params, cfg, hidden, after, start,
                        _mtp_kv(kv.with_layers(pools.kv), cfg, start,
                                jnp.full((b,), after.shape[1], jnp.int32)), pcfg.moe_sharding)
        pools = pools.with_kv(mkv.layers)
    if drafter is not None and not bare:
        ring, _ = context_ring(drafter, pcfg)
        pools = write_drafter_context(params, drafter, pools, slots, out.features,
                                      pos[:, None], jnp.ones((b, 1), bool), ring)
    return pools, outputs


def _empty_mtp_entries(cfg: ModelConfig, kv: PagedKV, pos: jax.Array) -> tuple[jax.Array, ...]:
    """kv's layers with the MTP head's K/V at each row's position pos[b] zeros (an entry its
    attention skips). The head's layers are the pools' after the model's."""
    b = pos.shape[0]
    mkv = _mtp_kv(kv, cfg, pos, jnp.ones((b,), jnp.int32))
    empty = jnp.zeros((b, 1, *kv.layers[0].shape[2:]), jnp.float32)
    layers = kv.layers
    for layer in range(kv.layers[0].shape[0] // kv.pages_per_layer - cfg.num_attention_layers):
        layers = mkv.store(layers, jnp.int32(layer), empty, empty)
    return layers


def round_rope(inputs: DecodeInputs, t: int) -> jax.Array | None:
    """A round's MRoPE positions [B, T] (positions + 0..T-1 + each row's delta), or None for a
    model without a vision tower."""
    if inputs.rope_delta is None:
        return None
    return (inputs.positions + inputs.rope_delta)[:, None] + jnp.arange(t, dtype=jnp.int32)


def verify_step(params: dict, pools: Pools, inputs: DecodeInputs, *, cfg: ModelConfig,
                pcfg: ProgramConfig, drafts: int | None = None) -> tuple[Pools, StepOutputs]:
    """A speculative round for B rows (module docstring): K MTP drafts (`drafts`, default
    num_speculative_tokens), the model over the last token and the drafts, the acceptance
    rule, then the head's K/V from the model's hidden states. Row b proposes at most limit[b]
    tokens; positions past it write nothing that is ever read."""
    pools = commit_step(pools, inputs.commit)
    slots, pos, limit = inputs.slots, inputs.positions, inputs.limit
    b = slots.shape[0]
    k = pcfg.num_speculative_tokens if drafts is None else drafts
    counts, masks = pools.output_counts[slots], pools.prompt_mask[slots]
    kv = PagedKV(layers=pools.kv, page_tables=inputs.page_tables, lengths=pos,
                 num_valid=limit, impl=pcfg.attention_impl, pages_per_layer=pcfg.num_pages + 1)
    # Draft 1 from (hidden state at frontier - 1, last token); draft j from the head's own
    # output at the previous position and draft j - 1, up to the row's limit.
    hidden = pools.ctx[slots][:, None]
    token = inputs.token_ids
    proposed, probs = [], []
    layers = kv.layers
    for j in range(k):
        at = pos - 1 + j
        valid = (j < limit).astype(jnp.int32)
        hidden, mkv = mtp_hidden(params, cfg, hidden, token[:, None], at,
                                 _mtp_kv(kv.with_layers(layers), cfg, at, valid),
                                 pcfg.moe_sharding)
        layers = mkv.layers
        token, q = draft_token(lm_head(params, cfg, hidden[:, 0]), inputs.sampling, counts,
                               masks, inputs.step_index + j)
        counts = count_tokens(counts, token, jnp.ones((b,), bool))
        proposed.append(token)
        probs.append(q)
    drafted = jnp.stack(proposed, axis=1)  # [B, K]
    ids = jnp.concatenate([inputs.token_ids[:, None], drafted], axis=1)  # [B, T]
    out = step(params, cfg, ids, pos, gdn_state(pools, slots, pcfg), kv.with_layers(layers), limit,
               keep_states=True, rope_positions=round_rope(inputs, k + 1),
               moe_sharding=pcfg.moe_sharding)
    verified = accept(out.logits, drafted, jnp.stack(probs, axis=1), inputs.sampling,
                      pools.output_counts[slots], masks, inputs.step_index, limit)
    tokens, num = verified.tokens, verified.num
    # The head's K/V at positions pos..: (the model's hidden state there, the token after it).
    _, mkv = mtp_hidden(params, cfg, out.hidden, tokens, pos,
                        _mtp_kv(out.kv, cfg, pos, limit), pcfg.moe_sharding)
    pools = write_provisional(pools, mkv.layers, out.gdn, out.hidden)
    tokens = widen(tokens, pcfg.verify_width)
    return pools, StepOutputs(tokens=tokens, num=num, logprobs=verified.logprobs,
                              top_ids=verified.top_ids, top_logprobs=verified.top_logprobs)


def widen(tokens: jax.Array, width: int) -> jax.Array:
    """A round's tokens [B, T] -> [B, width], the last repeated (a round of fewer drafts than
    the Program's most commits with the same width)."""
    t = tokens.shape[1]
    return tokens if t == width else jnp.concatenate(
        [tokens, jnp.repeat(tokens[:, -1:], width - t, axis=1)], axis=1)


def capture_step(pools: Pools, inputs: CaptureInputs, *, pcfg: ProgramConfig,
                 drafter: DFlashConfig | None = None) -> Pools:
    """Copies a sequence's committed GDN state, MTP context and the drafter's context window
    (only the entries it holds at the frontier from its `context_from` on, the rest zero,
    which blocks skip: the image depends on the tokens and the last bare round alone) into a
    checkpoint slot (its K/V pages are shared)."""
    ck, slot = inputs.ckpt_slot, inputs.slot
    pools = dataclasses.replace(
        pools, ck_conv=write_rows(pools.ck_conv, ck, pools.conv[slot]),
        ck_rec=write_rows(pools.ck_rec, ck, pools.rec[slot]),
        ck_ctx=write_rows(pools.ck_ctx, ck, pools.ctx[slot]))
    if drafter is None:
        return pools
    pos, held = context_positions(inputs.frontier, *context_ring(drafter, pcfg))
    keep = (held & (pos >= inputs.context_from[:, None]))[:, :, None, None, None]
    return dataclasses.replace(
        pools, ck_dk=write_rows(pools.ck_dk, ck, jnp.where(keep, pools.dk[slot], 0)),
        ck_dv=write_rows(pools.ck_dv, ck, jnp.where(keep, pools.dv[slot], 0)))


def restore_step(pools: Pools, inputs: RestoreInputs, *, pcfg: ProgramConfig) -> Pools:
    """Starts a sequence from a checkpoint: its GDN state and MTP context, fresh penalty state
    with the prefix marked as prompt, and its own copy of the checkpoint's last page where the
    sequence writes into it (in every attention layer, the MTP head's included; INT8 pages
    with their scales)."""
    slot, ck = inputs.slot, inputs.ckpt_slot
    valid = jnp.arange(inputs.prefix_ids.shape[1])[None, :] < inputs.prefix_len[:, None]
    mask = mark_prompt_tokens(jnp.zeros_like(pools.prompt_mask[slot]), inputs.prefix_ids, valid)
    per_layer = pcfg.num_pages + 1
    layers = jnp.arange(pools.k.shape[0] // per_layer, dtype=jnp.int32) * per_layer
    src, dst = layers + inputs.copy_src, layers + inputs.copy_dst
    if pools.dk is not None:  # the drafter's context window
        pools = dataclasses.replace(pools, dk=write_rows(pools.dk, slot, pools.ck_dk[ck]),
                                    dv=write_rows(pools.dv, slot, pools.ck_dv[ck]))
    pools = pools.with_kv(tuple(a.at[dst].set(a[src]) for a in pools.kv))
    return dataclasses.replace(
        pools,
        conv=write_rows(pools.conv, slot, pools.ck_conv[ck]),
        rec=write_rows(pools.rec, slot, pools.ck_rec[ck]),
        ctx=write_rows(pools.ctx, slot, pools.ck_ctx[ck]),
        output_counts=write_rows(pools.output_counts, slot,
                                 jnp.zeros_like(pools.output_counts[slot])),
        prompt_mask=write_rows(pools.prompt_mask, slot, mask))


def _page_rows(pools: Pools, pages: jax.Array, pcfg: ProgramConfig) -> jax.Array:
    """[G, La] flat pool rows of `pages` in every attention layer."""
    per_layer = pcfg.num_pages + 1
    layers = jnp.arange(pools.k.shape[0] // per_layer, dtype=jnp.int32) * per_layer
    return pages[:, None] + layers[None, :]


def export_pages_step(pools: Pools, inputs: PageRows, *, pcfg: ProgramConfig):
    """Copies pages out of the pool: (pools unchanged, `Pools.kv`'s arrays at the pages:
    (k, v[, k_scale, v_scale]) [G, La, page_size, ...])."""
    rows = _page_rows(pools, inputs.pages, pcfg)
    return pools, tuple(a[rows] for a in pools.kv)


def import_pages_step(pools: Pools, inputs: PageImport, *, pcfg: ProgramConfig) -> Pools:
    """Writes whole pages into the pool, as they are (unused rows go to each layer's sink
    page)."""
    rows = _page_rows(pools, inputs.pages, pcfg)
    return pools.with_kv(tuple(a.at[rows].set(x.astype(a.dtype))
                               for a, x in zip(pools.kv, inputs.kv, strict=True)))


def export_state_step(pools: Pools, inputs: StateRow):
    """A checkpoint slot's state image: (pools unchanged, (conv, rec, ctx[, dk, dv]) [1, ...];
    dk, dv: the drafter's context window, with a drafter)."""
    ck = inputs.ckpt_slot
    image = (pools.ck_conv[ck], pools.ck_rec[ck], pools.ck_ctx[ck])
    if pools.ck_dk is not None:
        image += (pools.ck_dk[ck], pools.ck_dv[ck])
    return pools, image


def import_state_step(pools: Pools, inputs: StateImport) -> Pools:
    """Fills a checkpoint slot with a state image."""
    ck = inputs.ckpt_slot
    pools = dataclasses.replace(
        pools, ck_conv=write_rows(pools.ck_conv, ck, inputs.conv),
        ck_rec=write_rows(pools.ck_rec, ck, inputs.rec),
        ck_ctx=write_rows(pools.ck_ctx, ck, inputs.ctx))
    if pools.ck_dk is None:
        return pools
    return dataclasses.replace(pools, ck_dk=write_rows(pools.ck_dk, ck, inputs.dk),
                               ck_dv=write_rows(pools.ck_dv, ck, inputs.dv))


def vision_encode_step(vision_params: dict, inputs: VisionEncodeInputs, *, cfg: ModelConfig
                       ) -> jax.Array:
    """The vision tower (its weights only) on one bucket of patches: merged embeddings
    [N / merge_unit, H] in the weights' dtype (rows from padding are meaningless). Touches no
    pool."""
    return encode(vision_params, cfg.vision, inputs.patches, inputs.pos_index,
                  inputs.pos_weight, inputs.rope_hw, inputs.segment)
