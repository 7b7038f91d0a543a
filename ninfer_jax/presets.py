"""The published Qwen3.6 sizes as frozen configs (DESIGN §14): what users bring; their
config.json gives the same values. `ninfer plan --model_preset=NAME` plans their memory;
`scripts/cuda_compile_check.py` compiles their GPU build. `DRAFTERS`: the public DFlash drafters
of the two (z-lab/Qwen3.6-27B-DFlash, z-lab/Qwen3.6-35B-A3B-DFlash), their config.json's sizes."""

from __future__ import annotations

from ninfer_jax.models.dflash import DFlashConfig
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


def _drafter(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
             target_layer_ids: tuple[int, ...]) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_q_heads=heads, num_kv_heads=kv_heads, head_dim=128, vocab_size=248320,
        rms_norm_eps=1e-6, rope_theta=1e7, layer_types=("full_attention",) * layers,
        sliding_window=0, causal=(False,) * layers, block_size=16, mask_token_id=248070,
        target_layer_ids=target_layer_ids)


DRAFTERS = {
    "qwen3_6_27b": _drafter(5120, 17408, 5, 32, 8, (1, 16, 31, 46, 61)),
    "qwen3_6_35b_a3b": _drafter(2048, 6144, 8, 32, 4, (1, 10, 19, 28, 37)),
}
