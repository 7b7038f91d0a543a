"""Tiny configs that vary what commonly goes wrong (q != kv heads, k-heads != v-heads in GDN,
k_dim != v_dim, partial rotary != 0.25, conv kernel != 4, a non-3:1 pattern), sized for
millisecond steps on a CPU."""

from __future__ import annotations

import dataclasses

from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.qwen3_6 import ModelConfig


def tiny_dense(**overrides) -> ModelConfig:
    cfg = ModelConfig(
        variant="dense", vocab_size=384, hidden_size=64,
        layer_types=("linear_attention", "linear_attention", "full_attention",
                     "linear_attention", "full_attention"),
        num_q_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=16, rope_theta=10000.0,
        conv_kernel=3, linear_num_k_heads=2, linear_num_v_heads=4, linear_k_dim=16,
        linear_v_dim=24, intermediate_size=96, tie_word_embeddings=True,
        max_position_embeddings=4096, mrope_section=(2, 1, 1),
    )
    return dataclasses.replace(cfg, **overrides)


def tiny_moe(**overrides) -> ModelConfig:
    cfg = ModelConfig(
        variant="moe", vocab_size=320, hidden_size=64, layer_types=("linear_attention",) * 3
        + ("full_attention",), num_q_heads=4, num_kv_heads=1, head_dim=32, rotary_dim=8,
        rope_theta=1e6, conv_kernel=4, linear_num_k_heads=2, linear_num_v_heads=2,
        linear_k_dim=16, linear_v_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48,
        max_position_embeddings=4096, mrope_section=(1, 1, 0),
    )
    return dataclasses.replace(cfg, **overrides)


def tiny_drafter(target: ModelConfig, **overrides) -> DFlashConfig:
    """A small DFlash2 drafter for `target` (conv kernels, selector, a sliding window of 16 so
    short test sequences wrap its context ring)."""
    heads = 2
    cfg = DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size, num_layers=1,
        num_q_heads=heads, num_kv_heads=1, head_dim=32, vocab_size=target.vocab_size,
        rms_norm_eps=1e-6, rope_theta=10000.0, layer_types=("sliding_attention",),
        sliding_window=16, causal=(False,), block_size=16, mask_token_id=target.vocab_size - 1,
        target_layer_ids=(1, target.num_layers - 2), conv_kernel_size=2, conv_group_size=16,
        selector_rank=16, selector_top_k=8, final_logit_softcapping=30.0,
        output_multiplier=1.0)
    return dataclasses.replace(cfg, **overrides)
