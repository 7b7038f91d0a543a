"""The family's forward passes: full-sequence logits, multi-token prefill, one-token decode.

Params are a pytree of dicts (see `weights.py` for the schema): `embed`, `final_norm`, optional
`lm_head` (absent when tied), and the decoder layers stacked per kind under `linear` and
`attention` so the stack is `lax.scan`ned. The scan runs over repeats of the layer pattern's
period (e.g. groups of 3 GDN + 1 attention); a pattern with no shorter period is one group.
`unstack_layers` gives the other layout, one dict per layer under `layers`, which runs as an
unrolled loop: faster steps on XLA:CPU, slower compiles (DESIGN §15).

Everything here is a pure function of (params, static config, arrays); state goes in and comes
out explicitly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6.attention import CausalKV, KVAccess, attention_mixer
from ninfer_jax.models.qwen3_6.config import FULL, LINEAR, ModelConfig
from ninfer_jax.models.qwen3_6.gdn import GDNState, gdn_mixer
from ninfer_jax.models.qwen3_6.layers import (
    embed_rows,
    layer_params,
    linear32,
    mlp,
    rms_norm,
    rope_cos_sin,
)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logits", "hidden", "gdn", "kv", "features"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StepOutput:
    logits: jax.Array  # [B, T, vocab] float32 ([B, 1, vocab] with `logits_at`)
    hidden: jax.Array  # [B, T, H] after the final norm (the MTP head's input)
    gdn: GDNState
    kv: Any  # the KVAccess after this call's writes
    # [B, T, F * H]: the outputs of the `feature_layers` asked for, concatenated in that order
    # (HF's hidden_states[i + 1]; a DFlash drafter's context); None when none were asked for
    features: jax.Array | None = None


def _grouped(tree: Any, groups: int) -> Any:
    return jax.tree.map(lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:]), tree)


def _ungrouped(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def _features(outputs: list[jax.Array] | jax.Array, feature_layers: tuple[int, ...]):
    """The feature layers' outputs [F, B, T, H] (or a list of them) -> [B, T, F * H]."""
    if not feature_layers:
        return None
    return jnp.concatenate([outputs[i] for i in range(len(feature_layers))], axis=-1)


def run_layers(params: dict, cfg: ModelConfig, h: jax.Array, positions: jax.Array,
               gdn: GDNState, kv: KVAccess, num_valid: jax.Array | None,
               keep_states: bool = False, feature_layers: tuple[int, ...] = (),
               moe_sharding: str = "intermediate", segments: jax.Array | None = None):
    """Applies the decoder stack. h [B, T, H]; positions [B, T] int32 absolute positions;
    segments [B, T] int32 or None: packed rows of several texts for the GDN layers (see
    `gdn_mixer`; the attention layers' `kv` masks them, e.g. `SegmentedCausalKV`).

    The loop runs over repeats of the layer pattern. Weights stay in their stacked buffers (each
    layer indexes them, `layers.layer_params`; passing them as scan inputs made XLA copy them
    every step; the routed experts are indexed inside their kernel) and the K/V
    of all attention layers ride in the loop carry, written in place. The outputs of
    `feature_layers` ride in the carry too ([F + 1, B, T, H]; every other layer writes the last
    row). Returns (h, gdn, kv, features [B, T, F * H] or None).
    """
    period = cfg.layer_period
    groups = cfg.num_layers // period
    pattern = cfg.layer_types[:period]
    lin_per, att_per = pattern.count(LINEAR), pattern.count(FULL)
    cos, sin = rope_cos_sin(positions, cfg)
    eps = cfg.rms_norm_eps

    num_features = len(feature_layers)
    feature_row = [num_features] * cfg.num_layers  # layer -> its row in the feature buffer
    for row, layer in enumerate(feature_layers):
        feature_row[layer] = row
    feature_row = jnp.asarray(feature_row, jnp.int32)

    def group_fn(carry, xs):
        h, kv_layers, feats = carry
        g, conv, rec = xs
        convs, recs = [], []
        i_lin = i_att = 0
        for i, kind in enumerate(pattern):
            if kind == FULL:
                layer = g * att_per + i_att
                p = layer_params(params["attention"], layer)
            else:
                p = layer_params(params["linear"], g * lin_per + i_lin)
            x = rms_norm(h, p["input_norm"], eps)
            if kind == FULL:
                y, kv_layers = attention_mixer(p["mixer"], x, cos, sin, kv, kv_layers, layer, cfg)
                i_att += 1
            else:
                y, c, r = gdn_mixer(p["mixer"], x, conv[i_lin], rec[i_lin], num_valid, cfg,
                                    keep_states, gdn.impl, segments)
                convs.append(c)
                recs.append(r)
                i_lin += 1
            h = h + y
            h = h + mlp(p["mlp"], rms_norm(h, p["post_norm"], eps), cfg, moe_sharding)
            if num_features:
                feats = feats.at[feature_row[g * period + i]].set(h)
        return (h, kv_layers, feats), (jnp.stack(convs) if convs else conv,
                                       jnp.stack(recs) if recs else rec)

    xs = (jnp.arange(groups, dtype=jnp.int32), _grouped(gdn.conv, groups),
          _grouped(gdn.recurrent, groups))
    feats = jnp.zeros((num_features + 1, *h.shape), h.dtype) if num_features else None
    (h, kv_layers, feats), (conv, rec) = jax.lax.scan(group_fn, (h, kv.layers, feats), xs)
    new_gdn = dataclasses.replace(gdn, conv=_ungrouped(conv), recurrent=_ungrouped(rec))
    return h, new_gdn, kv.with_layers(kv_layers), _features(feats, feature_layers)


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
    """The params with the decoder layers as one array dict per layer, in model order
    (`params["layers"]`), instead of stacked per kind. `step` and `forward` accept either
    layout. XLA:CPU copies a weight sliced out of a stacked buffer inside a loop before the dot
    reads it; with per-layer arrays an unrolled stack reads each weight once (DESIGN §15).
    Params already in that layout come back as they are."""
    if "layers" in params:
        return params
    out = {k: v for k, v in params.items() if k not in ("linear", "attention")}
    index = {LINEAR: 0, FULL: 0}
    layers = []
    for kind in cfg.layer_types:
        stacked = params["linear" if kind == LINEAR else "attention"]
        layers.append(jax.tree.map(lambda a, i=index[kind]: a[i], stacked))
        index[kind] += 1
    out["layers"] = tuple(layers)
    return out


def run_layers_unrolled(params: dict, cfg: ModelConfig, h: jax.Array, positions: jax.Array,
                        gdn: GDNState, kv: KVAccess, num_valid: jax.Array | None,
                        keep_states: bool = False, feature_layers: tuple[int, ...] = (),
                        moe_sharding: str = "intermediate", segments: jax.Array | None = None):
    """`run_layers` over per-layer params (`unstack_layers`): a Python loop, so every layer's
    weights are separate operands and every layer index is static."""
    cos, sin = rope_cos_sin(positions, cfg)
    eps = cfg.rms_norm_eps
    kv_layers = kv.layers
    convs, recs, outputs = [], [], {}
    i_lin = i_att = 0
    for n, (kind, p) in enumerate(zip(cfg.layer_types, params["layers"])):
        x = rms_norm(h, p["input_norm"], eps)
        if kind == FULL:
            y, kv_layers = attention_mixer(p["mixer"], x, cos, sin, kv, kv_layers, i_att, cfg)
            i_att += 1
        else:
            y, c, r = gdn_mixer(p["mixer"], x, gdn.conv[i_lin], gdn.recurrent[i_lin], num_valid,
                                cfg, keep_states, gdn.impl, segments)
            convs.append(c)
            recs.append(r)
            i_lin += 1
        h = h + y
        h = h + mlp(p["mlp"], rms_norm(h, p["post_norm"], eps), cfg, moe_sharding)
        outputs[n] = h
    new_gdn = dataclasses.replace(gdn, conv=jnp.stack(convs) if convs else gdn.conv,
                                  recurrent=jnp.stack(recs) if recs else gdn.recurrent)
    return h, new_gdn, kv.with_layers(kv_layers), _features(
        [outputs[layer] for layer in feature_layers], feature_layers)


def layer_loop(params: dict):
    """The decoder stack's loop for params in either layout: `run_layers_unrolled` for
    per-layer params (`unstack_layers`), `run_layers` (a scan) for stacked ones."""
    return run_layers_unrolled if "layers" in params else run_layers


def lm_head(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits [..., vocab] in fp32 from final-normed hidden states."""
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]  # [V, H] both
    return linear32(hidden, head)


def step(params: dict, cfg: ModelConfig, token_ids: jax.Array, start_pos: jax.Array,
         gdn: GDNState, kv: KVAccess, num_valid: jax.Array | None = None,
         keep_states: bool = False, logits_at: jax.Array | None = None,
         feature_layers: tuple[int, ...] = (), rope_positions: jax.Array | None = None,
         vision_embeds: jax.Array | None = None,
         vision_mask: jax.Array | None = None, moe_sharding: str = "intermediate") -> StepOutput:
    """Runs T new tokens per row from the carried state.

    token_ids [B, T] int32; start_pos [B] int32 absolute position of token_ids[:, 0];
    num_valid [B] int32 (optional): only the first num_valid[b] tokens of row b are real, the
    rest is padding that leaves the GDN state untouched (its K/V writes are beyond the row's
    frontier and are overwritten later). T == 1 is a decode step (recurrent GDN form); T > 1 a
    prefill chunk (chunked form). With `keep_states` (speculative verify) the GDN state comes
    back after every token (`gdn_mixer`): conv [L, B, T, ...], recurrent [L, B, T, ...].
    logits_at [B] int32 (optional): the logits only at position logits_at[b] of row b
    ([B, 1, vocab]); a prefill chunk needs one row, and the lm head over every position of a
    chunk costs as much as a layer (vocab x hidden per token).
    feature_layers: decoder layers whose outputs come back as `features` (static).
    rope_positions [3, B, T] int32 (optional): MRoPE positions (temporal, height, width) for a
    prompt with images; the default is start_pos + 0..T-1 in every row. The KV cache and the
    causal order still follow start_pos (the cache index), never the rope positions.
    vision_embeds [B, T, H] with vision_mask [B, T] bool (optional): where the mask is set the
    token's input embedding is replaced by the vision tower's (the image/video placeholders).
    moe_sharding: how a tensor-parallel mesh splits an MoE's experts (`layers.moe`).
    """
    positions = start_pos[:, None] + jnp.arange(token_ids.shape[1], dtype=jnp.int32)[None, :]
    if rope_positions is not None:
        positions = rope_positions
    h = embed_rows(params["embed"], token_ids)
    if vision_embeds is not None:
        h = jnp.where(vision_mask[..., None], vision_embeds.astype(h.dtype), h)
    h, gdn, kv, features = layer_loop(params)(params, cfg, h, positions, gdn, kv, num_valid,
                                              keep_states, tuple(feature_layers), moe_sharding)
    hidden = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    head_in = hidden if logits_at is None else jnp.take_along_axis(
        hidden, logits_at[:, None, None], axis=1)
    return StepOutput(logits=lm_head(params, cfg, head_in), hidden=hidden, gdn=gdn, kv=kv,
                      features=features)


def forward(params: dict, cfg: ModelConfig, token_ids: jax.Array,
            rope_positions: jax.Array | None = None,
            vision_embeds: jax.Array | None = None) -> jax.Array:
    """Full-sequence logits [B, T, vocab] (fp32) from empty state; token_ids [B, T] int32.

    With images/videos: rope_positions [3, B, T] (`mrope.rope_index`) and vision_embeds [M, H],
    the vision tower's merged embeddings in prompt order, one per placeholder token (image or
    video) of the batch read row-major."""
    b = token_ids.shape[0]
    dtype = params["embed"].dtype
    mask = placed = None
    if vision_embeds is not None:
        mask = (token_ids == cfg.image_token_id) | (token_ids == cfg.video_token_id)
        index = jnp.cumsum(mask.reshape(-1)).reshape(mask.shape) - 1
        placed = vision_embeds[jnp.clip(index, 0, vision_embeds.shape[0] - 1)]
    out = step(params, cfg, token_ids, jnp.zeros((b,), jnp.int32),
               GDNState.zeros(cfg, b, dtype), CausalKV(), rope_positions=rope_positions,
               vision_embeds=placed, vision_mask=mask)
    return out.logits
