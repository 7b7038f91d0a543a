"""The scoring window step: `(params, WindowInputs) -> WindowScores`, a pure function.

Owns the device side of the CausalScoring purpose (DESIGN §9): every row is a window that starts
from empty temporary state (zero GDN state, `CausalKV`: attention only over the window's own
tokens, so nothing outlives the call and nothing is donated), runs the decoder stack, then turns
hidden states into per-token target log-probs and greedy flags in chunks of tokens. A chunk's
[C, vocab] logits are the only vocabulary-wide buffer (the scoring staging); no vocabulary row
ever leaves the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6 import CausalKV, GDNState, ModelConfig
from ninfer_jax.models.qwen3_6.layers import rms_norm
from ninfer_jax.models.qwen3_6.model import lm_head, run_layers
from ninfer_jax.program.steps import _register

# Tokens per lm_head chunk are chosen so that one chunk's fp32 logits stay near this size.
LOGITS_CHUNK_BYTES = 64 << 20


@_register(["token_ids", "target_ids", "target_mask", "num_valid"])
@dataclasses.dataclass(frozen=True)
class WindowInputs:
    token_ids: jax.Array  # [B, L] int32, each row a window from position 0 (padded past num_valid)
    target_ids: jax.Array  # [B, L] int32, the token input position t predicts
    target_mask: jax.Array  # [B, L] bool, positions whose target is scored
    num_valid: jax.Array  # [B] int32, real tokens in the row (0 for a filler row)


@_register(["logprobs", "is_greedy", "top_ids", "top_logprobs"])
@dataclasses.dataclass(frozen=True)
class WindowScores:
    logprobs: jax.Array  # [B, L] float32, log p(target | prefix); 0 where not scored
    is_greedy: jax.Array  # [B, L] bool, target == argmax of the logits; True where not scored
    top_ids: jax.Array  # [B, L, N] int32, the N most likely next tokens (N = top_logprobs)
    top_logprobs: jax.Array  # [B, L, N] float32, their log-probs (most likely first)


def logits_chunk(cfg: ModelConfig, num_tokens: int) -> int:
    """Tokens per lm_head chunk for a [num_tokens] batch: bounded by LOGITS_CHUNK_BYTES."""
    return max(1, min(num_tokens, LOGITS_CHUNK_BYTES // (4 * cfg.vocab_size)))


def target_scores(params: dict, cfg: ModelConfig, hidden: jax.Array, target_ids: jax.Array,
                  top_n: int = 0) -> tuple[jax.Array, ...]:
    """hidden [N, H] (final-normed), target_ids [N] -> (log-probs [N] f32, is_greedy [N] bool,
    top ids [N, top_n] int32, top log-probs [N, top_n] f32).

    Log-softmax in fp32 over the full vocabulary; is_greedy uses argmax (first index on ties),
    as lm-evaluation-harness does. The top-N leave the chunk, never its vocabulary row.
    """
    n = hidden.shape[0]
    chunk = logits_chunk(cfg, n)
    num_chunks = -(-n // chunk)
    pad = num_chunks * chunk - n
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_chunks, chunk, -1)
    targets = jnp.pad(target_ids, (0, pad)).reshape(num_chunks, chunk)

    def one(xs):
        h, t = xs
        logits = lm_head(params, cfg, h)  # [C, V] f32
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        if top_n:
            values, ids = jax.lax.top_k(logits, top_n)
            top = (ids.astype(jnp.int32), values - lse[:, None])
        else:
            top = (jnp.zeros((h.shape[0], 0), jnp.int32), jnp.zeros((h.shape[0], 0)))
        return picked - lse, jnp.argmax(logits, axis=-1) == t, *top

    logprobs, greedy, top_ids, top_lps = jax.lax.map(one, (hidden, targets))
    return (logprobs.reshape(-1)[:n], greedy.reshape(-1)[:n],
            top_ids.reshape(n + pad, top_n)[:n], top_lps.reshape(n + pad, top_n)[:n])


def score_window_step(params: dict, inputs: WindowInputs, *, cfg: ModelConfig,
                      top_n: int = 0) -> WindowScores:
    """Scores B windows of L positions, each from empty state at position 0; with top_n, also
    each position's top_n most likely next tokens."""
    b, length = inputs.token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    h = params["embed"][inputs.token_ids]
    gdn = GDNState.zeros(cfg, b, params["embed"].dtype)
    h, _, _, _ = run_layers(params, cfg, h, positions, gdn, CausalKV(), inputs.num_valid)
    hidden = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    logprobs, greedy, top_ids, top_lps = target_scores(
        params, cfg, hidden.reshape(b * length, -1), inputs.target_ids.reshape(-1), top_n)
    mask = inputs.target_mask
    return WindowScores(logprobs=jnp.where(mask, logprobs.reshape(b, length), 0.0),
                        is_greedy=greedy.reshape(b, length) | ~mask,
                        top_ids=top_ids.reshape(b, length, top_n),
                        top_logprobs=top_lps.reshape(b, length, top_n))
