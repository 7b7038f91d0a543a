"""The published Qwen3.6 sizes as frozen configs (DESIGN §14): what users bring; their
config.json gives the same values. `ninfer plan --model_preset=NAME` plans their memory."""

from __future__ import annotations

from ninfer_jax.models.qwen3_6.config import ModelConfig

_ROPE = {"rope_theta": 1e7, "rotary_dim": 64, "head_dim": 256}
_GDN = {"conv_kernel": 4, "linear_num_k_heads": 16, "linear_k_dim": 128, "linear_v_dim": 128}


def pattern(n: int, every: int = 4) -> tuple[str, ...]:
    """n layers, every `every`-th full attention, the rest GatedDeltaNet."""
    return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n))


QWEN3_6_27B = ModelConfig(
    variant="dense", vocab_size=248320, hidden_size=5120, layer_types=pattern(64),
    num_q_heads=24, num_kv_heads=4, intermediate_size=17408, linear_num_v_heads=48,
    mtp_num_layers=1, **_ROPE, **_GDN,
)

QWEN3_6_35B_A3B = ModelConfig(
    variant="moe", vocab_size=248320, hidden_size=2048, layer_types=pattern(40),
    num_q_heads=16, num_kv_heads=2, linear_num_v_heads=32, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    mtp_num_layers=1, **_ROPE, **_GDN,
)

PRESETS = {"qwen3_6_27b": QWEN3_6_27B, "qwen3_6_35b_a3b": QWEN3_6_35B_A3B}
