"""Model presets as frozen configs (DESIGN §12): the benchmark sizes, and the published Qwen3.6
sizes (`ninfer_jax.presets`, re-exported here). `medium` is the ~500M-parameter random-weight
benchmark model.
"""

from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.presets import QWEN3_6_27B, QWEN3_6_35B_A3B  # noqa: F401 (the real sizes)
from ninfer_jax.presets import pattern as _pattern

MEDIUM = ModelConfig(
    variant="dense", vocab_size=32000, hidden_size=1024, layer_types=_pattern(24),
    num_q_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=32, rope_theta=1e7,
    intermediate_size=4608, conv_kernel=4, linear_num_k_heads=8, linear_num_v_heads=16,
    linear_k_dim=64, linear_v_dim=64, tie_word_embeddings=True, max_position_embeddings=32768,
)
