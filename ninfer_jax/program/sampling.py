"""Token sampling inside the decode step: per-row settings as arrays, penalties, seeded draws.

Owns: `SamplingArrays` (one row per batch row, so one executable serves greedy, sampled and
penalised rows together), the host-side validation that builds it (`SamplingParams`,
`sampling_arrays`, numpy only), the per-slot penalty state (`output_counts [B, V] int32`,
`prompt_mask [B, V] bool`) and the pure, jit-friendly device functions the Program's steps call:

    logits = apply_penalties(logits, arrays, output_counts, prompt_mask)
    out = sample(logits, arrays, step_index)            # out.tokens [B], out.logprobs [B]
    # ... on commit, with accepted [B] bool:
    output_counts = count_tokens(output_counts, out.tokens, accepted)

Does not own: which slot a row lives in (the Program gathers and scatters the penalty rows by slot
id), stop conditions, or how seeds are chosen for requests that gave none (the caller assigns one).

Order of operations (Hugging Face's and vLLM's): penalties on the raw logits, then greedy rows take
the argmax (ties -> lowest id); sampled rows divide by temperature, keep top-k, then top-p over the
renormalised top-k distribution, then min-p, and draw from what is left. Every filter is a value
threshold, so tokens tied with the last kept value are all kept and the kept set does not depend on
sort order.

Determinism: a row's key is `fold_in(key(seed), step_index)` where `step_index` is the absolute
position of the token being drawn. The same (seed, position, logits row) gives the same token
whatever rows share the batch, whatever was reused from a checkpoint, and whether the tokens
before it were sampled or forced (DESIGN §3 ControlReady): a request whose output was forced to
start with some tokens samples what a request whose prompt already held them samples.

Speculative verify builds on these functions in `speculative.py` (the acceptance rule): position
i of a row sees the counts after the draft's first i tokens, `draw_logits` gives the distribution
drafts are judged against, and a row whose drafts are all accepted draws its next token with
`sample()` at `step_index + K`, as a plain decode step would.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from ninfer_jax.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SamplingParamsError,
    as_sampling_params,
)

RNG_IMPL = "threefry2x32"  # fixed, so streams do not depend on jax's default PRNG setting
MAX_STOP_IDS = MAX_STOP_TOKEN_IDS + 8  # a row's ending ids: its stop_token_ids and EOS ids


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "min_tokens",
        "stop_ids",
        "logprobs",
        "allowed",
        "constrained",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32 in (0, 1], 1 = off
    min_p: jax.Array  # [B] float32 in [0, 1], 0 = off
    presence_penalty: jax.Array  # [B] float32, 0 = off
    frequency_penalty: jax.Array  # [B] float32, 0 = off
    repetition_penalty: jax.Array  # [B] float32 > 0, 1 = off
    seed: jax.Array  # [B] uint32, the request's RNG seed
    min_tokens: jax.Array  # [B] int32, stop_ids are not sampled before this many tokens
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32, the row's ending ids (vocab size: unused)
    logprobs: jax.Array  # [B] bool, the row wants its tokens' top-N log-probs
    allowed: jax.Array  # [B, W] uint32, constrained rows' allowed tokens: bit i of word j is
    #   token 32 j + i (W = ceil(V / 32) in the Program; tokens past 32 W are not allowed)
    constrained: jax.Array  # [B] bool, the row samples only tokens `allowed` holds


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["tokens", "logprobs"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32, log p(token) after penalties and temperature, before filters


# ---------------------------------------------------------------- host side (numpy only)


def sampling_arrays(rows: Sequence[Mapping[str, Any] | Any],
                    stop_ids: Sequence[Sequence[int]] | None = None,
                    vocab_size: int = 2**31 - 1,
                    masks: Sequence[np.ndarray | None] | None = None,
                    mask_words: int = 1) -> SamplingArrays:
    """Validates per-row settings (dicts, `SamplingParams` or dataclasses with those field names)
    and stacks them into numpy-backed `SamplingArrays` of batch len(rows). Greedy rows without a
    seed get seed 0 (unused). `stop_ids[b]`: the ids row b may not sample while it has generated
    fewer than its `min_tokens` (at most MAX_STOP_IDS; unused entries are `vocab_size`, which
    the device drops). `masks[b]`: row b's allowed-token bitmask, [mask_words] uint32 (the
    grammar's, `frontend/grammar.py`), or None for an unconstrained row. Raises
    `SamplingParamsError` naming the row and field."""
    if len(rows) == 0:
        raise SamplingParamsError("sampling_arrays needs at least one row")
    stops = np.full((len(rows), MAX_STOP_IDS), vocab_size, np.int32)
    for i, ids in enumerate(stop_ids or ()):
        if len(ids) > MAX_STOP_IDS:
            raise SamplingParamsError(f"row {i}: at most {MAX_STOP_IDS} stop ids, got {len(ids)}")
        stops[i, : len(ids)] = ids
    params = []
    for i, row in enumerate(rows):
        try:
            params.append(as_sampling_params(row))
        except (SamplingParamsError, TypeError) as e:
            raise SamplingParamsError(f"row {i}: {e}") from None
        if params[-1].temperature > 0 and params[-1].seed is None:
            raise SamplingParamsError(
                f"row {i}: seed is required when temperature > 0 (the Engine assigns one to "
                "requests that gave none, so a rerun can reproduce the tokens)")

    allowed = np.zeros((len(rows), mask_words), np.uint32)
    constrained = np.zeros(len(rows), bool)
    for i, mask in enumerate(masks or ()):
        if mask is None:
            continue
        mask = np.asarray(mask)
        if mask.shape != (mask_words,) or mask.dtype != np.uint32:
            raise SamplingParamsError(f"row {i}: the token mask must be [{mask_words}] uint32, "
                                      f"got {mask.shape} {mask.dtype}")
        allowed[i], constrained[i] = mask, True

    def column(name: str, dtype: Any) -> np.ndarray:
        return np.asarray([getattr(p, name) for p in params], dtype=dtype)

    return SamplingArrays(
        temperature=column("temperature", np.float32),
        top_k=column("top_k", np.int32),
        top_p=column("top_p", np.float32),
        min_p=column("min_p", np.float32),
        presence_penalty=column("presence_penalty", np.float32),
        frequency_penalty=column("frequency_penalty", np.float32),
        repetition_penalty=column("repetition_penalty", np.float32),
        seed=np.asarray([0 if p.seed is None else p.seed for p in params], dtype=np.uint32),
        min_tokens=column("min_tokens", np.int32),
        stop_ids=stops,
        logprobs=np.asarray([p.logprobs is not None for p in params], dtype=bool),
        allowed=allowed,
        constrained=constrained,
    )


# ---------------------------------------------------------------- device side (pure jnp)


def mark_prompt_tokens(prompt_mask: jax.Array, token_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """Adds tokens to the prompt mask. prompt_mask [B, V] bool; token_ids [B, T] int32;
    valid [B, T] bool (padding is False). Fixed T, so a staged-prefill chunk can call it."""
    num_rows, vocab_size = prompt_mask.shape
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], token_ids.shape)
    ids = jnp.where(valid, token_ids, vocab_size)  # out of range: dropped
    return prompt_mask.at[rows, ids].set(True, mode="drop")


def init_penalty_state(
    prompt_ids: jax.Array, prompt_lens: jax.Array, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """Fresh penalty state for B sequences: prompt_ids [B, T] int32 (right-padded), prompt_lens
    [B] int32 -> (output_counts [B, V] int32 zeros, prompt_mask [B, V] bool)."""
    num_rows, max_len = prompt_ids.shape
    valid = jnp.arange(max_len)[None, :] < prompt_lens[:, None]
    prompt_mask = mark_prompt_tokens(jnp.zeros((num_rows, vocab_size), bool), prompt_ids, valid)
    return jnp.zeros((num_rows, vocab_size), jnp.int32), prompt_mask


def count_tokens(output_counts: jax.Array, tokens: jax.Array, accept: jax.Array) -> jax.Array:
    """Commit: output_counts [B, V] int32 += one-hot(tokens [B]) where accept [B] bool."""
    rows = jnp.arange(output_counts.shape[0])
    return output_counts.at[rows, tokens].add(accept.astype(output_counts.dtype))


def apply_penalties(
    logits: jax.Array, arrays: SamplingArrays, output_counts: jax.Array, prompt_mask: jax.Array
) -> jax.Array:
    """logits [B, V] float32 -> penalised logits [B, V] float32. Rows whose penalties are off come
    back bit-identical.

    Repetition (Hugging Face): over prompt ∪ generated tokens, positive logits are divided by the
    penalty and negative ones multiplied. Then presence and frequency (OpenAI), over generated
    tokens only: logit -= presence * (count > 0) + frequency * count. Then `min_tokens`: while a
    row has generated fewer (the sum of its counts), its `stop_ids` are set to -inf. Last, a
    constrained row's tokens outside its `allowed` mask are set to -inf (constrained decoding).
    Each of the last two runs only when some row of the batch needs it: a batch without them
    pays one predicate.
    """
    generated = output_counts > 0
    seen = prompt_mask | generated
    rep = arrays.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    logits = (
        logits
        - arrays.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
        - arrays.presence_penalty[:, None] * generated.astype(logits.dtype)
    )
    logits = jax.lax.cond(jnp.any(arrays.min_tokens > 0),
                          lambda: _suppress_stops(logits, arrays, output_counts), lambda: logits)
    return jax.lax.cond(jnp.any(arrays.constrained), lambda: apply_token_mask(logits, arrays),
                        lambda: logits)


def unpack_mask(allowed: jax.Array, vocab_size: int) -> jax.Array:
    """allowed [B, W] uint32 bitmasks -> [B, vocab_size] bool (ids past 32 W: False)."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [B, W, 32]
    flat = bits.reshape(allowed.shape[0], -1).astype(bool)
    if flat.shape[1] >= vocab_size:
        return flat[:, :vocab_size]
    return jnp.pad(flat, ((0, 0), (0, vocab_size - flat.shape[1])))


def apply_token_mask(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """logits [B, V] with each constrained row's disallowed tokens at -inf (others unchanged)."""
    keep = unpack_mask(arrays.allowed, logits.shape[-1]) | ~arrays.constrained[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def _suppress_stops(logits: jax.Array, arrays: SamplingArrays,
                    output_counts: jax.Array) -> jax.Array:
    """logits [B, V] with each row's stop_ids at -inf while it is below its min_tokens."""
    num_rows, vocab_size = logits.shape
    early = jnp.sum(output_counts, axis=-1) < arrays.min_tokens  # [B]
    ids = jnp.where(early[:, None], arrays.stop_ids, vocab_size)  # [B, S]; V: dropped
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def _tempered(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """(logits - row max) / temperature, with temperature 1 for greedy rows. Shifting first keeps
    a tiny temperature from overflowing to inf (and inf - inf to NaN); the row max becomes 0."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    return (logits - jnp.max(logits, axis=-1, keepdims=True)) / t


def _sorted_thresholds(scaled: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """The top-k and top-p value thresholds [B, 1] from one descending sort per row."""
    vocab_size = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # [B, V] descending
    k = jnp.clip(arrays.top_k, 1, vocab_size)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    thr_k = jnp.where(arrays.top_k[:, None] > 0, kth, -jnp.inf)

    in_top_k = ordered >= thr_k
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    # Exclusive prefix mass; a function of the sorted values only, so tied tokens fare alike.
    mass_before = jnp.concatenate(
        [jnp.zeros_like(probs[:, :1]), jnp.cumsum(probs, axis=-1)[:, :-1]], axis=-1
    )
    top_p = arrays.top_p[:, None]
    keep_p = in_top_k & ((mass_before < top_p) | (top_p >= 1))
    keep_p = keep_p.at[:, 0].set(True)  # the top token, whatever rounding did to the mass
    thr_p = jnp.min(jnp.where(keep_p, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.maximum(thr_k, thr_p)


CANDIDATES = 256  # top-k / top-p are settled among a row's this many most likely tokens


def _candidates(scaled: jax.Array, candidates: int) -> tuple[jax.Array, jax.Array]:
    """A row's `candidates` largest values, descending, and their ids: ([B, N], [B, N]).

    On CPU a barrier keeps XLA:CPU's TopK call (~0.03 ms for 256 of 4,096 values): without it
    the simplifier folds later slices of the result into the decomposed sort, which then stays
    a full sort of the row (~0.9 ms). One barrier per output: the SPMD partitioner (tensor
    parallel) aborts on a barrier over top_k's tuple (jax 0.10.2), and XLA:GPU on any."""
    values, ids = jax.lax.top_k(scaled, min(candidates, scaled.shape[-1]))
    return jax.lax.platform_dependent(
        values, ids.astype(jnp.int32),
        cpu=lambda v, i: (jax.lax.optimization_barrier(v), jax.lax.optimization_barrier(i)),
        default=lambda v, i: (v, i))


def _candidate_thresholds(scaled: jax.Array, arrays: SamplingArrays, values: jax.Array
                          ) -> tuple[jax.Array, jax.Array]:
    """The top-k and top-p threshold [B, 1] from a row's largest values alone (`values` [B, N],
    descending), and whether that is the row's threshold [B] (else it needs the full sort).

    The rule is `_sorted_thresholds`'s over the first N sorted values: the top-k set's mass
    (its normaliser summed over the whole vocabulary) accumulated in value order. It settles
    the row when its top-k lies within the N (top_k <= N; N = V settles every row) or when the
    mass before the N-th value already reaches top_p (that value and every smaller one is
    dropped). A token past the N tied with the N-th value fares as the value threshold says,
    as in the sorted path."""
    n, vocab_size = values.shape[-1], scaled.shape[-1]
    top_k, top_p = arrays.top_k[:, None], arrays.top_p[:, None]
    k_within = (top_k >= 1) & ((top_k <= n) | (n == vocab_size))
    kth = jnp.take_along_axis(values, jnp.clip(top_k, 1, n) - 1, axis=-1)
    thr_k = jnp.where(top_k > 0, kth, -jnp.inf)
    norm = jnp.sum(jnp.where(scaled >= thr_k, jnp.exp(scaled), 0.0), axis=-1, keepdims=True)
    probs = jnp.where(values >= thr_k, jnp.exp(values), 0.0) / norm
    mass_before = jnp.concatenate(
        [jnp.zeros_like(probs[:, :1]), jnp.cumsum(probs, axis=-1)[:, :-1]], axis=-1)
    keep_p = (values >= thr_k) & ((mass_before < top_p) | (top_p >= 1))
    keep_p = keep_p.at[:, 0].set(True)
    thr_p = jnp.min(jnp.where(keep_p, values, jnp.inf), axis=-1, keepdims=True)
    settled = k_within | ((top_k == 0) & (top_p < 1) & (mass_before[:, -1:] >= top_p))
    return jnp.maximum(thr_k, thr_p), settled[:, 0]


def _thresholds(scaled: jax.Array, arrays: SamplingArrays, values: jax.Array) -> jax.Array:
    """Each row's top-k / top-p value threshold [B, 1] (-inf: neither is set). A row settled
    by its candidates (`_candidate_thresholds`) takes theirs; the full descending sort runs
    only when a sampled row is not settled (a top-p whose kept set is wider than the
    candidates, or a top-k above them), and serves only such rows, so a row's threshold does
    not depend on the rows beside it."""
    filtering = (arrays.top_k > 0) | (arrays.top_p < 1)
    candidate, settled = _candidate_thresholds(scaled, arrays, values)
    unsettled = filtering & ~settled & (arrays.temperature > 0)
    full = jax.lax.cond(
        jnp.any(unsettled),
        lambda: _sorted_thresholds(scaled, arrays),
        lambda: jnp.full((scaled.shape[0], 1), -jnp.inf, scaled.dtype),
    )
    threshold = jnp.where(settled[:, None], candidate, full)
    return jnp.where(filtering[:, None], threshold, -jnp.inf)


def truncation_mask(scaled: jax.Array, arrays: SamplingArrays,
                    candidates: int = CANDIDATES) -> jax.Array:
    """The tokens a sampled row may draw: scaled [B, V] float32 (tempered, row max 0) -> [B, V]
    bool. Every filter is a value threshold on `scaled`.

    top-k keeps values >= the k-th largest; top-p keeps value v when the probability mass of
    values strictly greater than v (under the renormalised top-k distribution) is < top_p, so the
    top token always stays; min-p keeps p >= min_p * p_max. Top-k and top-p are settled among a
    row's `candidates` most likely tokens (`jax.lax.top_k`) when those hold its kept set; the
    full sort (the costly part: ~0.9 ms for 4,096 values on a CPU core, against ~0.05 ms for
    256 candidates) runs only for a row they do not settle (`_thresholds`).

    The top-p boundary, exactly: the kept set is the smallest set of most likely tokens whose
    mass is >= top_p (OpenAI's and Hugging Face's rule), so a set whose mass equals top_p exactly
    is complete and the next token is dropped; then every token tied with the smallest kept
    value is kept too (Hugging Face keeps whichever of them its sort puts first). The min-p
    boundary keeps p == min_p * p_max.
    """
    threshold = _thresholds(scaled, arrays, _candidates(scaled, candidates)[0])
    keep_min_p = jnp.exp(scaled) >= arrays.min_p[:, None]  # p / p_max, as the row max is 0
    return (scaled >= threshold) & keep_min_p


def row_keys(seed: jax.Array, step_index: jax.Array) -> jax.Array:
    """seed [B] uint32, step_index [B] int32 -> [B] typed keys fold_in(key(seed), step_index)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s, impl=RNG_IMPL), i))(
        seed, step_index
    )


def draw_logits(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """The log-weights a sampled row draws from: logits [B, V] float32 (already penalised) ->
    tempered logits [B, V] with the tokens the filters drop at -inf. Its softmax is the row's
    full sampling distribution."""
    scaled = _tempered(logits, arrays.temperature)
    return jnp.where(truncation_mask(scaled, arrays), scaled, -jnp.inf)


def token_logprobs(logits: jax.Array, arrays: SamplingArrays, tokens: jax.Array) -> jax.Array:
    """log p(token) per row under the tempered distribution, before the filters: logits [B, V]
    float32 (already penalised), tokens [B] int32 -> [B] float32. Greedy rows use temperature 1."""
    scaled = _tempered(logits, arrays.temperature)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def top_logprobs(logits: jax.Array, arrays: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS most likely tokens of each row and their log-probabilities under the
    distribution `token_logprobs` uses (penalised, tempered, before the filters): logits [B, V]
    float32 (already penalised) -> (ids [B, N] int32, logprobs [B, N] float32), most likely
    first (ties: lowest id first). Computed only when some row asks (`arrays.logprobs`); else
    zeros, so a batch without log-prob rows pays one predicate."""
    num_rows, n = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])

    def compute() -> tuple[jax.Array, jax.Array]:
        scaled = _tempered(logits, arrays.temperature)
        values, ids = jax.lax.top_k(scaled, n)
        return ids.astype(jnp.int32), values - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)

    return jax.lax.cond(jnp.any(arrays.logprobs), compute,
                        lambda: (jnp.zeros((num_rows, n), jnp.int32),
                                 jnp.zeros((num_rows, n), jnp.float32)))


def _gumbel(keys: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise [B, N] float32 of each (row key [B], token id [B, N]): the threefry block of
    (id, 0) under the row's key, so a token's noise is the same whichever ids are drawn with it
    (the candidates alone, or the whole vocabulary)."""

    def row(key: jax.Array, row_ids: jax.Array) -> jax.Array:
        n = row_ids.shape[0]
        counts = jnp.concatenate([row_ids.astype(jnp.uint32), jnp.zeros(n, jnp.uint32)])
        bits = jax.extend.random.threefry_2x32(key, counts)[:n]
        u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
        return -jnp.log(-jnp.log(u))

    return jax.vmap(row)(jax.random.key_data(keys), ids)


def _gumbel_max(values: jax.Array, ids: jax.Array, kept: jax.Array, keys: jax.Array) -> jax.Array:
    """The kept token with the largest value + Gumbel noise (ties: the lowest id), [B] int32:
    a draw from softmax(values) over the kept tokens."""
    score = jnp.where(kept, values + _gumbel(keys, ids), -jnp.inf)
    best = jnp.max(score, axis=-1, keepdims=True)
    return jnp.min(jnp.where(score == best, ids, jnp.iinfo(jnp.int32).max), axis=-1)


def sample(logits: jax.Array, arrays: SamplingArrays, step_index: jax.Array,
           candidates: int = CANDIDATES) -> SampleOutput:
    """Picks one token per row. logits [B, V] float32 (already penalised); step_index [B] int32,
    the absolute position of the token being sampled (see the module docstring). Greedy rows
    (temperature == 0) take the argmax, ties to the lowest id; the others draw from the
    truncated tempered distribution by the Gumbel-max rule, each token's noise keyed by
    (seed, step_index, token id). When every sampled row keeps only tokens among its
    `candidates` most likely (top-k, top-p or min-p drop the last candidate), the noise and
    the maximum are taken over the candidates alone; else over the vocabulary. A token's noise
    and the kept set are the same either way, so a row draws the same token in any batch.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = arrays.temperature > 0

    def draw() -> jax.Array:
        scaled = _tempered(logits, arrays.temperature)
        values, ids = _candidates(scaled, candidates)
        threshold = _thresholds(scaled, arrays, values)
        min_p = arrays.min_p[:, None]
        keys = row_keys(arrays.seed, step_index)
        last = values[:, -1]
        inside = (last < threshold[:, 0]) | (jnp.exp(last) < min_p[:, 0]) \
            | (values.shape[-1] == scaled.shape[-1])

        def among_candidates() -> jax.Array:
            kept = (values >= threshold) & (jnp.exp(values) >= min_p)
            return _gumbel_max(values, ids, kept, keys)

        def over_vocabulary() -> jax.Array:
            every = jnp.broadcast_to(jnp.arange(scaled.shape[-1], dtype=jnp.int32), scaled.shape)
            kept = (scaled >= threshold) & (jnp.exp(scaled) >= min_p)
            return _gumbel_max(scaled, every, kept, keys)

        return jax.lax.cond(jnp.all(inside | ~sampled), among_candidates, over_vocabulary)

    # An all-greedy batch skips the filters and the draw at run time (same executable).
    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)
    tokens = jnp.where(sampled, drawn, greedy)
    return SampleOutput(tokens=tokens, logprobs=token_logprobs(logits, arrays, tokens))
