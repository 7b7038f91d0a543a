"""The DFlash speculative round: a block of K drafts in one drafter pass, then [spec]'s verify.

`dflash_verify_step(params, pools, inputs) -> (pools, outputs)` has the decode step's inputs and
outputs (`steps.DecodeInputs`, `steps.StepOutputs`). For B rows at their frontiers f: the drafter
(`models/dflash`) reads each row's context window (the ring of its slot, entries it holds at f,
`pools.context_positions`, from the row's `context_from`: past its last bare round) and the
block [last token, mask * K] at positions f .. f + K, and proposes K drafts, from the full
lm-head proposal or the candidate selector (`ProgramConfig.draft_head`); the target runs the
last token and the drafts at T = K + 1 positions, keeping its GDN state after each and
returning its `target_layer_ids` outputs; `speculative.accept` picks each row's tokens; the
drafter's context K/V of the T positions is written into the ring. A commit of n tokens
adopts the state after position n - 1; the ring entries of rejected positions are past the new
frontier, so no block reads them before a later step rewrites them.

Sampled rows: the full proposal draws each position under the row's full transform (as MTP's
drafts do); the selector draws from softmax(scores / temperature) over its top-k candidates,
each position given the token drawn before it: the conditional proposal q the acceptance rule
divides by. Greedy rows take argmaxes (q one-hot). Draws use the draft stream of the row's key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.dflash.model import block_hidden, block_logits, select
from ninfer_jax.models.qwen3_6 import ModelConfig, step
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.drafter_context import write_drafter_context
from ninfer_jax.program.pools import (
    PagedKV,
    Pools,
    context_positions,
    context_ring,
    context_written,
)
from ninfer_jax.program.sampling import SamplingArrays, count_tokens
from ninfer_jax.program.speculative import accept, draft_keys, draft_token
from ninfer_jax.program.steps import (
    DecodeInputs,
    StepOutputs,
    commit_step,
    gdn_state,
    widen,
    write_provisional,
)


def dflash_verify_step(params: dict, pools: Pools, inputs: DecodeInputs, *, cfg: ModelConfig,
                       pcfg: ProgramConfig, drafter: DFlashConfig, drafts: int | None = None
                       ) -> tuple[Pools, StepOutputs]:
    """A DFlash speculative round for B rows (module docstring): the block drafter's K drafts
    from each row's context window, the model over the last token and the drafts, the
    acceptance rule, then the drafter's context K/V of the T positions into the rings (K:
    `drafts`, default num_speculative_tokens). Row b
    proposes at most limit[b] tokens; its ring entries past them are rewritten before they are
    read."""
    pools = commit_step(pools, inputs.commit)
    slots, pos, limit = inputs.slots, inputs.positions, inputs.limit
    b = slots.shape[0]
    k = pcfg.num_speculative_tokens if drafts is None else drafts
    t = k + 1
    counts, masks = pools.output_counts[slots], pools.prompt_mask[slots]
    ring, kept = context_ring(drafter, pcfg)
    block_pos = pos[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    block = jnp.concatenate([inputs.token_ids[:, None],
                             jnp.full((b, k), drafter.mask_token_id, jnp.int32)], axis=1)
    embeds = params["embed"][block] * jnp.asarray(drafter.input_embedding_scale,
                                                  params["embed"].dtype)
    ctx_pos, ctx_ok = context_positions(pos, ring, kept)
    ctx_k = pools.dk[slots]
    hidden = block_hidden(params["dflash"], drafter, embeds, block_pos, ctx_k, pools.dv[slots],
                          ctx_pos, ctx_ok & context_written(ctx_k)
                          & (ctx_pos >= inputs.context_from[:, None]))[:, 1:]  # [B, K, H]
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = block_logits(drafter, hidden, head)  # [B, K, V]
    if pcfg.draft_head == "selector":
        drafts, probs = _select_drafts(params["dflash"], drafter, hidden, logits,
                                       inputs.token_ids, inputs.sampling, inputs.step_index,
                                       cfg.vocab_size)
    else:
        drafted, probs = [], []
        for j in range(k):  # the full proposal: each position under the row's transform
            draft = draft_token(logits[:, j], inputs.sampling, counts, masks,
                                inputs.step_index + j)
            counts = count_tokens(counts, draft.tokens, jnp.ones((b,), bool))
            drafted.append(draft.tokens)
            probs.append(draft.probs)
        drafts, probs = jnp.stack(drafted, axis=1), jnp.stack(probs, axis=1)
    kv = PagedKV(layers=pools.kv, page_tables=inputs.page_tables, lengths=pos,
                 num_valid=limit, impl=pcfg.attention_impl, pages_per_layer=pcfg.num_pages + 1)
    ids = jnp.concatenate([inputs.token_ids[:, None], drafts], axis=1)  # [B, T]
    out = step(params, cfg, ids, pos, gdn_state(pools, slots, pcfg), kv, limit, keep_states=True,
               feature_layers=drafter.target_layer_ids, moe_sharding=pcfg.moe_sharding)
    verified = accept(out.logits, drafts, probs, inputs.sampling, pools.output_counts[slots],
                      masks, inputs.step_index, limit)
    valid = jnp.arange(t)[None, :] < limit[:, None]
    pools = write_drafter_context(params, drafter, pools, slots, out.features, block_pos,
                                  valid, ring)
    pools = write_provisional(pools, out.kv.layers, out.gdn, out.hidden)
    return pools, StepOutputs(tokens=widen(verified.tokens, pcfg.verify_width), num=verified.num,
                              logprobs=verified.logprobs, top_ids=verified.top_ids,
                              top_logprobs=verified.top_logprobs)


def _select_drafts(dparams: dict, drafter: DFlashConfig, hidden: jax.Array, logits: jax.Array,
                   anchor: jax.Array, arrays: SamplingArrays, step_index: jax.Array,
                   vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """The candidate selector's drafts [B, K] and the distributions they were drawn from
    [B, K, V]: greedy rows take the best-scoring candidate (q one-hot); sampled rows draw from
    softmax(scores / temperature) over the top-k candidates on the draft stream, the
    conditional proposal q given the token chosen before."""
    b = hidden.shape[0]
    rows = jnp.arange(b)
    sampled = arrays.temperature > 0
    temperature = jnp.where(sampled, arrays.temperature, 1.0)[:, None]
    qs = []

    def choose(j: int, scores: jax.Array, candidates: jax.Array) -> jax.Array:
        best = jnp.argmax(scores, axis=-1)
        tempered = jax.nn.log_softmax(scores / temperature, axis=-1)
        keys = draft_keys(arrays.seed, step_index + j)
        drawn = jax.vmap(jax.random.categorical)(keys, tempered)
        index = jnp.where(sampled, drawn, best)
        q_k = jnp.where(sampled[:, None], jnp.exp(tempered),
                        jax.nn.one_hot(best, scores.shape[-1], dtype=jnp.float32))
        qs.append(jnp.zeros((b, vocab_size), jnp.float32).at[rows[:, None], candidates].add(q_k))
        return index

    drafts, _, _ = select(dparams, drafter, hidden, logits, anchor, choose)
    return drafts, jnp.stack(qs, axis=1)
