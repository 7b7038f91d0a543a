"""The scoring steps, pure functions: `score_window_step` `(params, WindowInputs) -> WindowScores`
and `score_shared_step` `(params, SharedInputs) -> WindowScores`.

Owns the device side of the CausalScoring purpose (DESIGN §9). In a window step every row holds
one or more windows (segments: short texts are packed), each starting from empty temporary
state (zero GDN state, restarted at every segment; attention only within the segment, so
nothing outlives the call and nothing is donated). A shared step scores continuations of common
contexts: it runs each context once, keeps its GDN state and K/V inside the call, and runs every
continuation row from its context's state, so a context with N continuations is read once, not
N times. Both turn hidden states into per-token target log-probs and greedy flags in chunks of
tokens. A chunk's [C, vocab] logits are the only vocabulary-wide buffer (the scoring staging);
no vocabulary row ever leaves the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6 import ContiguousKV, GDNState, ModelConfig, SegmentedCausalKV
from ninfer_jax.models.qwen3_6.layers import rms_norm
from ninfer_jax.models.qwen3_6.model import layer_loop, lm_head
from ninfer_jax.program.steps import _register

# Tokens per lm_head chunk are chosen so that one chunk's fp32 logits stay near this size. On
# XLA:CPU a smaller chunk keeps the log-softmax passes in cache (a 4096-token call of the demo
# model's head: 38 ms at 4 MiB, 45 at 16 MiB), but at least CPU_MIN_CHUNK tokens share each
# pass over the head's weights (MEDIUM's 131 MB head: 1.58 s a 4096-token call at 128 tokens a
# chunk, 1.47 at 256, 2.54 at 32).
LOGITS_CHUNK_BYTES = 64 << 20
CPU_LOGITS_CHUNK_BYTES = 4 << 20
CPU_MIN_CHUNK = 256


@_register(["token_ids", "target_ids", "target_mask", "num_valid", "positions", "segment_ids"])
@dataclasses.dataclass(frozen=True)
class WindowInputs:
    token_ids: jax.Array  # [B, L] int32, each row windows laid end to end (padded past num_valid)
    target_ids: jax.Array  # [B, L] int32, the token input position t predicts
    target_mask: jax.Array  # [B, L] bool, positions whose target is scored
    num_valid: jax.Array  # [B] int32, real tokens in the row (0 for a filler row)
    positions: jax.Array  # [B, L] int32, each token's position in its own window (from 0)
    # [B, L] int32, non-decreasing: the window each token belongs to (padding: the last one's)
    segment_ids: jax.Array


@_register(["context_ids", "context_len", "token_ids", "target_ids", "target_mask",
            "num_valid", "context_of"])
@dataclasses.dataclass(frozen=True)
class SharedInputs:
    context_ids: jax.Array  # [C, Lc] int32, each row a context from position 0 (padded)
    context_len: jax.Array  # [C] int32, the context's tokens (>= 1; 1 for a filler row)
    # [B, Lk] int32: a continuation's tokens but its last, the inputs after the context
    token_ids: jax.Array
    target_ids: jax.Array  # [B, Lk] int32, the continuation: target t follows input t - 1
    target_mask: jax.Array  # [B, Lk] bool, the continuation's tokens (none for a filler row)
    num_valid: jax.Array  # [B] int32, inputs in the row (the continuation's length - 1)
    context_of: jax.Array  # [B] int32, the row's context (an index into context_ids)


@_register(["logprobs", "is_greedy", "top_ids", "top_logprobs"])
@dataclasses.dataclass(frozen=True)
class WindowScores:
    logprobs: jax.Array  # [B, L] float32, log p(target | prefix); 0 where not scored
    is_greedy: jax.Array  # [B, L] bool, target == argmax of the logits; True where not scored
    top_ids: jax.Array  # [B, L, N] int32, the N most likely next tokens (N = top_logprobs)
    top_logprobs: jax.Array  # [B, L, N] float32, their log-probs (most likely first)


def logits_chunk(cfg: ModelConfig, num_tokens: int) -> int:
    """Tokens per lm_head chunk for a [num_tokens] batch: bounded by LOGITS_CHUNK_BYTES
    (CPU_LOGITS_CHUNK_BYTES, but at least CPU_MIN_CHUNK tokens, when tracing for the CPU
    backend)."""
    if jax.default_backend() == "cpu":
        return max(1, min(num_tokens, max(CPU_MIN_CHUNK,
                                          CPU_LOGITS_CHUNK_BYTES // (4 * cfg.vocab_size))))
    return max(1, min(num_tokens, LOGITS_CHUNK_BYTES // (4 * cfg.vocab_size)))


def target_scores(params: dict, cfg: ModelConfig, hidden: jax.Array, target_ids: jax.Array,
                  top_n: int = 0) -> tuple[jax.Array, ...]:
    """hidden [N, H] (the last layer's output: the final norm runs per chunk), target_ids [N]
    -> (log-probs [N] f32, is_greedy [N] bool, top ids [N, top_n] int32, top log-probs
    [N, top_n] f32).

    Log-softmax in fp32 over the full vocabulary; is_greedy uses argmax (first index on ties),
    as lm-evaluation-harness does. The top-N leave the chunk, never its vocabulary row.

    On XLA:CPU is_greedy comes from the passes log-softmax makes anyway: a target whose logit
    is the row's maximum is the argmax when no other logit equals it, which the sum's pass
    counts (exp(l - max) == 1 exactly at a maximum). Only a chunk where some target ties with
    another maximum, or where that count cannot be trusted, runs the argmax's own pass (a
    variadic reduce that took as long as the head's matmul).
    """
    n = hidden.shape[0]
    chunk = logits_chunk(cfg, n)
    cpu = jax.default_backend() == "cpu"
    num_chunks = -(-n // chunk)
    pad = num_chunks * chunk - n
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_chunks, chunk, -1)
    targets = jnp.pad(target_ids, (0, pad)).reshape(num_chunks, chunk)

    def one(xs):
        h, t = xs
        # The final norm here, not before the chunks: on XLA:CPU a norm after the last layer
        # joined that layer's four matmuls in one library fusion that ran at half their rate
        # (MEDIUM: 844 ms against ~380 for the same layer's matmuls apart).
        logits = lm_head(params, cfg, rms_norm(h, params["final_norm"], cfg.rms_norm_eps))
        peak = jnp.max(logits, axis=-1)
        e = jnp.exp(logits - peak[:, None])
        lse = peak + jnp.log(jnp.sum(e, axis=-1))
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        if cpu:
            at_peak = jnp.sum(jnp.where(e >= 1.0, 1.0, 0.0), axis=-1)  # fused with the sum
            is_peak = picked == peak
            greedy = jax.lax.cond(jnp.any(is_peak & (at_peak != 1.0)),
                                  lambda: jnp.argmax(logits, axis=-1) == t, lambda: is_peak)
        else:  # a GPU's conditional reads its predicate on the host: argmax is the cheaper
            greedy = jnp.argmax(logits, axis=-1) == t
        if top_n:
            values, ids = jax.lax.top_k(logits, top_n)
            top = (ids.astype(jnp.int32), values - lse[:, None])
        else:
            top = (jnp.zeros((h.shape[0], 0), jnp.int32), jnp.zeros((h.shape[0], 0)))
        return picked - lse, greedy, *top

    logprobs, greedy, top_ids, top_lps = jax.lax.map(one, (hidden, targets))
    return (logprobs.reshape(-1)[:n], greedy.reshape(-1)[:n],
            top_ids.reshape(n + pad, top_n)[:n], top_lps.reshape(n + pad, top_n)[:n])


def _scores(params: dict, cfg: ModelConfig, hidden: jax.Array, target_ids: jax.Array,
            mask: jax.Array, top_n: int) -> WindowScores:
    """hidden [B, L, H] (the last layer's output), target_ids and mask [B, L] -> the rows'
    scores."""
    b, length = target_ids.shape
    logprobs, greedy, top_ids, top_lps = target_scores(
        params, cfg, hidden.reshape(b * length, -1), target_ids.reshape(-1), top_n)
    return WindowScores(logprobs=jnp.where(mask, logprobs.reshape(b, length), 0.0),
                        is_greedy=greedy.reshape(b, length) | ~mask,
                        top_ids=top_ids.reshape(b, length, top_n),
                        top_logprobs=top_lps.reshape(b, length, top_n))


def score_window_step(params: dict, inputs: WindowInputs, *, cfg: ModelConfig,
                      top_n: int = 0) -> WindowScores:
    """Scores B rows of L positions, each window (segment) from empty state; with top_n, also
    each position's top_n most likely next tokens."""
    b = inputs.token_ids.shape[0]
    h = params["embed"][inputs.token_ids]
    gdn = GDNState.zeros(cfg, b, params["embed"].dtype)
    segments = inputs.segment_ids
    h, _, _, _ = layer_loop(params)(params, cfg, h, inputs.positions, gdn,
                                    SegmentedCausalKV(segments), inputs.num_valid,
                                    segments=segments)
    return _scores(params, cfg, h, inputs.target_ids, inputs.target_mask, top_n)


def score_shared_step(params: dict, inputs: SharedInputs, *, cfg: ModelConfig,
                      top_n: int = 0) -> WindowScores:
    """Scores B continuation rows of Lk targets after C shared contexts: each context runs once
    from empty state (its K/V kept in a contiguous buffer of Lc + Lk positions), then every row
    runs from its context's GDN state and K/V at positions context_len... The first target is
    scored from the context's last position, target t > 0 from input t - 1."""
    c, lc = inputs.context_ids.shape
    lk = inputs.token_ids.shape[1]
    dtype = params["embed"].dtype
    positions = jnp.broadcast_to(jnp.arange(lc, dtype=jnp.int32), (c, lc))
    kv = ContiguousKV.zeros(cfg, c, lc + lk, dtype)
    layers = layer_loop(params)
    h, gdn, kv, _ = layers(params, cfg, params["embed"][inputs.context_ids], positions,
                           GDNState.zeros(cfg, c, dtype), kv, inputs.context_len)
    last = h[jnp.arange(c), inputs.context_len - 1][inputs.context_of]  # [B, H]

    rows = inputs.context_of
    start = inputs.context_len[rows]
    gdn = jax.tree.map(lambda a: a[:, rows], gdn)
    kv = ContiguousKV(layers=jax.tree.map(lambda a: a[:, rows], kv.layers), lengths=start)
    positions = start[:, None] + jnp.arange(lk, dtype=jnp.int32)[None, :]
    h, _, _, _ = layers(params, cfg, params["embed"][inputs.token_ids], positions, gdn, kv,
                        inputs.num_valid)
    h = jnp.concatenate([last[:, None], h[:, : lk - 1]], axis=1)
    return _scores(params, cfg, h, inputs.target_ids, inputs.target_mask, top_n)
