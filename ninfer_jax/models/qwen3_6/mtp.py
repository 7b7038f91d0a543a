"""The multi-token-prediction (MTP) head of DESIGN §14: draft logits one token further ahead.

Owns the head's forward pass over the params' `"mtp"` subtree (`fc [H, 2H]`, `embed_norm`,
`hidden_norm`, `final_norm`, and a stack of full-attention decoder layers). For input position t
it combines the main model's final-normed hidden state `h_t` with the embedding of the next token
`tok_{t+1}` and predicts `tok_{t+2}`:

    logits_t = lm_head(final_norm(layers(fc(concat[embed_norm(embed(tok_{t+1})),
                                                    hidden_norm(h_t)]))))

The concat order (embedding first) is transformers' generic `MtpModel` default. Row t is rotated
with position t, the position of `h_t`; transformers rotates it with t + 1, the position of
`tok_{t+1}`. Attention depends only on position differences, so the draft logits are the same
(`tests/models/test_mtp_reference.py` compares them with transformers'). The head's attention
layers keep their own K/V through a `KVAccess` whose `layers` has a leading [num MTP layers]
axis; the embedding and `lm_head` are the main model's. It reuses the family's attention, MLP
and norm code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6.attention import KVAccess, attention_kv, attention_mixer
from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.layers import (
    dense,
    embed_rows,
    layer_params,
    mlp,
    rms_norm,
    rope_cos_sin,
)
from ninfer_jax.models.qwen3_6.model import lm_head


def mtp_step(params: dict, cfg: ModelConfig, hidden: jax.Array, next_token_ids: jax.Array,
             start_pos: jax.Array, kv: KVAccess) -> tuple[jax.Array, KVAccess]:
    """Draft logits for T positions.

    hidden [B, T, H]: the main model's final-normed hidden states at positions
    start_pos[b] + 0..T-1; next_token_ids [B, T] int32: the token after each of those positions;
    start_pos [B] int32. Returns (logits [B, T, vocab] fp32 predicting the token two ahead of
    each position, kv after this call's writes).
    """
    out, kv = mtp_hidden(params, cfg, hidden, next_token_ids, start_pos, kv)
    return lm_head(params, cfg, out), kv


def mtp_hidden(params: dict, cfg: ModelConfig, hidden: jax.Array, next_token_ids: jax.Array,
               start_pos: jax.Array, kv: KVAccess, moe_sharding: str = "intermediate"
               ) -> tuple[jax.Array, KVAccess]:
    """`mtp_step` without the lm head: the head's final-normed output [B, T, H], from which
    `lm_head` gives the draft logits. A speculative step chains drafts by feeding this output
    back as the next position's `hidden` (a draft position has no main-model hidden state).
    `moe_sharding`: as `model.step`'s."""
    p = params["mtp"]
    eps = cfg.rms_norm_eps
    h, cos, sin = _head_input(params, cfg, hidden, next_token_ids, start_pos)

    def layer_fn(carry, layer):
        h, kv_layers = carry
        lp = layer_params(p["layers"], layer)
        y, kv_layers = attention_mixer(lp["mixer"], rms_norm(h, lp["input_norm"], eps), cos,
                                       sin, kv, kv_layers, layer, cfg)
        h = h + y
        h = h + mlp(lp["mlp"], rms_norm(h, lp["post_norm"], eps), cfg, moe_sharding)
        return (h, kv_layers), None

    num_layers = p["layers"]["input_norm"].shape[0]
    (h, kv_layers), _ = jax.lax.scan(layer_fn, (h, kv.layers),
                                     jnp.arange(num_layers, dtype=jnp.int32))
    return rms_norm(h, p["final_norm"], eps), kv.with_layers(kv_layers)


def _head_input(params: dict, cfg: ModelConfig, hidden: jax.Array, next_token_ids: jax.Array,
                start_pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first head layer's input [B, T, H] and the positions' rotary cos, sin."""
    p, eps = params["mtp"], cfg.rms_norm_eps
    positions = start_pos[:, None] + jnp.arange(hidden.shape[1], dtype=jnp.int32)[None, :]
    cos, sin = rope_cos_sin(positions, cfg)
    emb = rms_norm(embed_rows(params["embed"], next_token_ids), p["embed_norm"], eps)
    h = dense(jnp.concatenate([emb, rms_norm(hidden, p["hidden_norm"], eps)], axis=-1), p["fc"])
    return h, cos, sin


def store_params(head: dict) -> dict:
    """The head's params (`params["mtp"]`) `mtp_store` reads: with one layer only its input
    norm and K/V projections besides the input's; a deeper head runs in full, so all of them.
    A round that only keeps the head's context current passes these, not every head leaf
    (each leaf passed costs the call host time, though the executable never reads it)."""
    if head["layers"]["input_norm"].shape[0] != 1:
        return head
    layers = head["layers"]
    return {"embed_norm": head["embed_norm"], "hidden_norm": head["hidden_norm"],
            "fc": head["fc"], "layers": {
                "input_norm": layers["input_norm"],
                "mixer": {k: layers["mixer"][k] for k in ("k", "k_norm", "v")}}}


def mtp_store(params: dict, cfg: ModelConfig, hidden: jax.Array, next_token_ids: jax.Array,
              start_pos: jax.Array, kv: KVAccess, moe_sharding: str = "intermediate"
              ) -> KVAccess:
    """Writes the head's K/V of T positions (as `mtp_hidden` does) without its output: a round
    that drafts nothing keeps the head's context current this way. With one head layer (the
    Qwen3.5/3.6 head) only that layer's K/V projections run; a deeper head runs in full."""
    p = params["mtp"]
    if p["layers"]["input_norm"].shape[0] != 1:
        return mtp_hidden(params, cfg, hidden, next_token_ids, start_pos, kv, moe_sharding)[1]
    h, cos, sin = _head_input(params, cfg, hidden, next_token_ids, start_pos)
    lp = layer_params(p["layers"], jnp.int32(0))
    k, v = attention_kv(lp["mixer"], rms_norm(h, lp["input_norm"], cfg.rms_norm_eps), cos, sin,
                        cfg)
    return kv.with_layers(kv.store(kv.layers, jnp.int32(0), k, v))
