"""The Qwen3.6 family (transformers' `qwen3_5` / `qwen3_5_moe`): config, weights, forward passes."""

from ninfer_jax.models.qwen3_6.attention import CausalKV, ContiguousKV, KVAccess, SegmentedCausalKV
from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.gdn import GDNState
from ninfer_jax.models.qwen3_6.model import StepOutput, forward, step

__all__ = ["CausalKV", "ContiguousKV", "GDNState", "KVAccess", "ModelConfig",
           "SegmentedCausalKV", "StepOutput", "forward", "step"]
