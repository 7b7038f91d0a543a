"""Model presets as frozen configs (DESIGN §12): the published Qwen3.6 sizes and benchmark sizes.

The real presets describe checkpoints users bring (their config.json gives the same values);
`medium` is the ~500M-parameter random-weight benchmark model.
"""

from ninfer_jax.models.qwen3_6 import ModelConfig

_ROPE = dict(rope_theta=1e7, rotary_dim=64, head_dim=256)
_GDN = dict(conv_kernel=4, linear_num_k_heads=16, linear_k_dim=128, linear_v_dim=128)


def _pattern(n: int, every: int = 4) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n))


QWEN3_6_27B = ModelConfig(
    variant="dense", vocab_size=248320, hidden_size=5120, layer_types=_pattern(64),
    num_q_heads=24, num_kv_heads=4, intermediate_size=17408, linear_num_v_heads=48,
    mtp_num_layers=1, **_ROPE, **_GDN,
)

QWEN3_6_35B_A3B = ModelConfig(
    variant="moe", vocab_size=248320, hidden_size=2048, layer_types=_pattern(40),
    num_q_heads=16, num_kv_heads=2, linear_num_v_heads=32, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    mtp_num_layers=1, **_ROPE, **_GDN,
)

MEDIUM = ModelConfig(
    variant="dense", vocab_size=32000, hidden_size=1024, layer_types=_pattern(24),
    num_q_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=32, rope_theta=1e7,
    intermediate_size=4608, conv_kernel=4, linear_num_k_heads=8, linear_num_v_heads=16,
    linear_k_dim=64, linear_v_dim=64, tie_word_embeddings=True, max_position_embeddings=32768,
)
