"""Speculative decoding's acceptance rule on the device: drafts in, committed candidates out.

Owns: the full per-row distribution (`transformed_probs`), the draft-side draw (`draft_token`)
and the rule that turns a verify step's target logits [B, T, V] (T = K + 1 positions) and K
drafts per row into the tokens a row commits (`accept`). All three are pure, jit-friendly and
shape-static; every row follows its own `SamplingArrays`, so greedy, sampled and penalised rows
share one executable and a row's output does not depend on its neighbours.

    draft = draft_token(draft_logits, arrays, counts_j, prompt_mask, step_index + j)  # j < K
    out = accept(target_logits, drafts, draft_probs, arrays, counts, prompt_mask, step_index,
                 limit)  # commit out.tokens[:, :out.num]

Does not own: the models that produce the logits, the state of rejected positions (the Program
rolls KV/GDN state back to the accepted prefix), committing the penalty counts or advancing the
step index (the Program applies `count_tokens` and advances `step_index` by `num` on commit),
or the choice of K.

Penalties are exact: target position i sees `counts` plus the drafts before i, which were all
accepted if position i is reached. Greedy rows accept the longest prefix of drafts equal to the
target's argmaxes and add the target's token after it. Sampled rows follow Leviathan et al. /
Chen et al.: draft x at position i is accepted with probability min(1, p_i(x) / q_i(x)); the
first rejected position draws from normalize(max(0, p_i - q_i)) (p_i itself if that is all zero)
and ends the row; after K acceptances the bonus token is `sample()`'s own draw at step
`step_index + K`. Each committed token is then distributed as non-speculative sampling would
draw it.

Streams: `sample()` keys a row by fold_in(key(seed), step). Drafting, the acceptance uniforms
and the residual draws fold a purpose tag into that key, so none of them shares randomness with
the target's stream or with each other. The tokens a round commits depend only on the keys of
the steps they fill (below `step_index + num`); draws past them go unused, so the next round,
which starts at `step_index + num`, draws fresh.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ninfer_jax.program.sampling import (
    SamplingArrays,
    apply_penalties,
    count_tokens,
    draw_logits,
    row_keys,
    sample,
    token_logprobs,
    top_logprobs,
)

# Purpose tags folded into a row's step key; `sample()` uses the untagged key.
DRAFT_STREAM = 1
ACCEPT_STREAM = 2
RESAMPLE_STREAM = 3


class Draft(NamedTuple):
    tokens: jax.Array  # [B] int32
    probs: jax.Array  # [B, V] float32, the distribution `tokens` was drawn from


class Verified(NamedTuple):
    tokens: jax.Array  # [B, T] int32; tokens[:, :num] are committed, later ones repeat the last
    num: jax.Array  # [B] int32 in 1..limit
    logprobs: jax.Array  # [B, T] float32, log p_i(tokens[:, i]), tempered and penalised target
    top_ids: jax.Array  # [B, T, N] int32, position i's most likely tokens (`top_logprobs`)
    top_logprobs: jax.Array  # [B, T, N] float32, their log-probabilities


def _stream(keys: jax.Array, purpose: int) -> jax.Array:
    """Row keys [B] (`row_keys`) -> the same rows' keys on `purpose`'s stream."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, purpose)


def draft_keys(seed: jax.Array, step_index: jax.Array) -> jax.Array:
    """Rows' keys [B] on the draft stream at step_index [B]: what a drafter that draws its
    tokens itself (the DFlash selector) draws with."""
    return _stream(row_keys(seed, step_index), DRAFT_STREAM)


def _probs(penalised: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Penalised logits [B, V] -> the distribution each row samples from, [B, V] float32."""
    vocab_size = penalised.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(penalised, axis=-1), vocab_size, dtype=jnp.float32)
    sampled = arrays.temperature > 0
    filtered = jax.lax.cond(
        jnp.any(sampled),
        lambda: jax.nn.softmax(draw_logits(penalised, arrays), axis=-1).astype(jnp.float32),
        lambda: greedy,
    )
    return jnp.where(sampled[:, None], filtered, greedy)


def transformed_probs(
    logits: jax.Array, arrays: SamplingArrays, counts: jax.Array, prompt_mask: jax.Array
) -> jax.Array:
    """logits [B, V] float32 -> [B, V] float32, the distribution a row samples from after its
    full transform: penalties (`apply_penalties`), temperature, top-k, top-p, min-p. Greedy rows
    (temperature 0): one-hot at the argmax of the penalised logits (ties to the lowest id)."""
    return _probs(apply_penalties(logits, arrays, counts, prompt_mask), arrays)


def draft_token(
    logits: jax.Array,
    arrays: SamplingArrays,
    counts: jax.Array,
    prompt_mask: jax.Array,
    step_index: jax.Array,
) -> Draft:
    """One draft per row from the draft model's logits [B, V] under the row's full transform.
    counts [B, V] int32 include the row's earlier drafts; step_index [B] int32 is the step of the
    drafted token (the row's committed count plus the draft's position). Greedy rows take the
    argmax; sampled rows draw from `probs` on the draft stream."""
    penalised = apply_penalties(logits, arrays, counts, prompt_mask)
    probs = _probs(penalised, arrays)
    greedy = jnp.argmax(penalised, axis=-1).astype(jnp.int32)

    def draw() -> jax.Array:
        keys = draft_keys(arrays.seed, step_index)
        return jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)

    sampled = arrays.temperature > 0
    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)
    return Draft(tokens=jnp.where(sampled, drawn, greedy), probs=probs)


def _check_shapes(target_logits, drafts, draft_probs, counts, prompt_mask, step_index, limit):
    if target_logits.ndim != 3 or target_logits.shape[1] < 2:
        raise ValueError(
            f"target_logits must be [B, T, V] with T = K + 1 >= 2, got {target_logits.shape}")
    b, t, v = target_logits.shape
    expected = {
        "drafts": (drafts, (b, t - 1)),
        "draft_probs": (draft_probs, (b, t - 1, v)),
        "counts": (counts, (b, v)),
        "prompt_mask": (prompt_mask, (b, v)),
        "step_index": (step_index, (b,)),
        "limit": (limit, (b,)),
    }
    for name, (array, shape) in expected.items():
        if tuple(array.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for target_logits "
                             f"{target_logits.shape}, got {tuple(array.shape)}")
    for name in ("drafts", "step_index", "limit"):
        if not jnp.issubdtype(expected[name][0].dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {expected[name][0].dtype}")


def accept(
    target_logits: jax.Array,
    drafts: jax.Array,
    draft_probs: jax.Array,
    arrays: SamplingArrays,
    counts: jax.Array,
    prompt_mask: jax.Array,
    step_index: jax.Array,
    limit: jax.Array,
) -> Verified:
    """Verifies K drafts per row against the target.

    target_logits [B, T, V] float32 (T = K + 1; position i predicts the token after drafts[:, :i]);
    drafts [B, K] int32; draft_probs [B, K, V] float32, the distributions the drafts were drawn
    from (`draft_token`'s probs); counts [B, V] int32, the committed generated-token counts;
    prompt_mask [B, V] bool; step_index [B] int32, the tokens each row has committed; limit [B]
    int32, the most tokens a row may commit (clipped to 1..T). Drafts outside [0, V) are never
    accepted. Returns `Verified(tokens [B, T], num [B], logprobs [B, T])`; see the module
    docstring for the rule. Shapes and dtypes are checked at trace time (ValueError)."""
    _check_shapes(target_logits, drafts, draft_probs, counts, prompt_mask, step_index, limit)
    num_rows, num_pos, vocab_size = target_logits.shape
    k = num_pos - 1
    drafts = drafts.astype(jnp.int32)
    step_index = step_index.astype(jnp.int32)

    seen = [counts]  # the counts position i sees: committed ones plus drafts[:, :i]
    for j in range(k):
        seen.append(count_tokens(seen[-1], drafts[:, j], jnp.ones(num_rows, bool)))
    per_position = {"in_axes": (1, None, 1, None), "out_axes": 1}
    penalised = jax.vmap(apply_penalties, **per_position)(
        target_logits, arrays, jnp.stack(seen, axis=1), prompt_mask
    )

    rows = jnp.arange(num_rows)
    sampled = arrays.temperature > 0
    greedy = jnp.argmax(penalised[:, :k], axis=-1).astype(jnp.int32)  # [B, K]
    in_vocab = (drafts >= 0) & (drafts < vocab_size)
    matches = (drafts == greedy) & in_vocab
    steps = step_index[:, None] + jnp.arange(k, dtype=jnp.int32)  # [B, K]

    def speculative() -> tuple[jax.Array, jax.Array]:
        p = jax.vmap(_probs, in_axes=(1, None), out_axes=1)(penalised[:, :k], arrays)
        ids = jnp.clip(drafts, 0, vocab_size - 1)[..., None]
        p_x = jnp.take_along_axis(p, ids, axis=-1)[..., 0]
        q_x = jnp.take_along_axis(draft_probs, ids, axis=-1)[..., 0]
        keys = jax.vmap(row_keys, in_axes=(None, 1), out_axes=1)(arrays.seed, steps)  # [B, K]
        accept_keys = jax.vmap(_stream, in_axes=(1, None), out_axes=1)(keys, ACCEPT_STREAM)
        u = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys)
        ok = jnp.where(sampled[:, None], (u * q_x < p_x) & in_vocab, matches)

        at = jnp.minimum(_leading_true(ok), k - 1)  # the first rejection
        p_at = p[rows, at]
        residual = jnp.maximum(p_at - draft_probs[rows, at], 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_at)
        resample_keys = _stream(keys[rows, at], RESAMPLE_STREAM)
        resampled = jax.vmap(jax.random.categorical)(resample_keys, jnp.log(residual))
        return ok, resampled.astype(jnp.int32)

    # An all-greedy batch skips the target transform and the draws at run time.
    ok, resampled = jax.lax.cond(
        jnp.any(sampled), speculative, lambda: (matches, jnp.zeros(num_rows, jnp.int32))
    )
    accepted = _leading_true(ok)  # [B] in 0..K
    bonus = sample(penalised[:, k], arrays, step_index + k).tokens
    correction = jnp.where(sampled, resampled, greedy[rows, jnp.minimum(accepted, k - 1)])
    last = jnp.where(accepted == k, bonus, correction)

    pos = jnp.arange(num_pos)[None, :]
    candidates = jnp.where(pos < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
    num = jnp.minimum(accepted + 1, jnp.clip(limit, 1, num_pos)).astype(jnp.int32)
    tokens = jnp.where(pos < num[:, None], candidates, candidates[rows, num - 1][:, None])
    logprobs = jax.vmap(token_logprobs, in_axes=(1, None, 1), out_axes=1)(
        penalised, arrays, tokens
    )
    top_ids, top_lps = jax.vmap(top_logprobs, in_axes=(1, None), out_axes=1)(penalised, arrays)
    return Verified(tokens=tokens, num=num, logprobs=logprobs, top_ids=top_ids,
                    top_logprobs=top_lps)


def _leading_true(flags: jax.Array) -> jax.Array:
    """[B, K] bool -> [B] int32, the length of each row's leading run of True."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
