"""The bytes one decode step must move, and the tokens per second that bounds on a GPU's HBM.

Owns the arithmetic of a decode round of B rows at a context of L positions: the weights it
reads (every decoder weight, the lm head, B rows of an untied embedding; an MoE layer's shared
expert and router and, of its routed experts, the ones the round's rows select: at most
min(E, B x T x top-k), the count used here; the MTP head, a drafter and the vision tower are
not part of a plain decode step), the K/V pages of every attention layer up to L (INT8 pages
with their fp32 scales), and the GDN state of every linear layer, read once and written once
(the recurrent state in fp32 and the conv state). Weights as `quant.planned_structs` holds
them (bf16, int8/int4 group-wise, FP8 blocks; values and scales). Memory traffic only: a step
reads at least this, so B / (bytes / bandwidth) bounds its tokens per second.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from ninfer_jax import quant
from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.weights import param_shapes

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e
_NOT_IN_DECODE = ("mtp", "vision", "dflash")


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    weights: float
    kv: float
    gdn: float
    batch: int

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.gdn

    def tokens_per_second(self, bandwidth: float = H200_BANDWIDTH) -> float:
        return self.batch / (self.total / bandwidth)


def active_experts(cfg: ModelConfig, tokens: int) -> int:
    """The most routed experts `tokens` tokens select (each picks top-k distinct ones)."""
    return min(cfg.num_experts, tokens * cfg.num_experts_per_tok)


def _nbytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def weight_bytes(cfg: ModelConfig, dtype: str, quantize: str | None, batch: int,
                 tokens_per_row: int = 1) -> float:
    """The weight bytes a decode step of `batch` rows of `tokens_per_row` tokens reads."""
    params = quant.planned_structs(param_shapes(cfg), quantize, dtype)
    share = 1.0
    if cfg.variant == "moe":
        share = active_experts(cfg, batch * tokens_per_row) / cfg.num_experts
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = quant.key_path(path)
        if names[0] in _NOT_IN_DECODE:
            continue
        size = _nbytes(leaf)
        if names[0] == "embed" and not cfg.tie_word_embeddings:
            size = size / cfg.vocab_size * batch * tokens_per_row  # the rows looked up
        elif "experts" in names:
            size *= share
        total += size
    return total


def kv_bytes(cfg: ModelConfig, dtype: str, kv_dtype: str, batch: int, context: int) -> float:
    """K and V of every attention layer for `batch` rows of `context` positions (INT8 pages:
    one byte a value and an fp32 scale per position and KV head)."""
    per_value = 1 if kv_dtype == "int8" else np.dtype(dtype).itemsize
    per_token = 2 * cfg.num_kv_heads * (cfg.head_dim * per_value + (4 if kv_dtype == "int8"
                                                                    else 0))
    return batch * context * cfg.num_attention_layers * per_token


def gdn_bytes(cfg: ModelConfig, dtype: str, batch: int) -> float:
    """The GDN state of every linear layer for `batch` rows, read once and written once."""
    rec = cfg.linear_num_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4
    conv = cfg.conv_dim * (cfg.conv_kernel - 1) * np.dtype(dtype).itemsize
    return 2 * batch * cfg.num_linear_layers * (rec + conv)


def decode_bytes(cfg: ModelConfig, batch: int, context: int, dtype: str = "bfloat16",
                 quantize: str | None = None, kv_dtype: str = "auto") -> DecodeBytes:
    return DecodeBytes(weights=weight_bytes(cfg, dtype, quantize, batch),
                       kv=kv_bytes(cfg, dtype, kv_dtype, batch, context),
                       gdn=gdn_bytes(cfg, dtype, batch), batch=batch)


def roofline_table(presets: dict[str, ModelConfig], formats=(None, "int8", "int4", "fp8"),
                   batches=(1, 8, 32), contexts=(4096, 32768),
                   bandwidth: float = H200_BANDWIDTH) -> str:
    """A markdown table: preset x weight format x B x context -> GiB a decode step reads
    (weights, K/V, GDN state) and the HBM bound in tokens per second."""
    gib = 1 << 30
    lines = [(f"| preset | weights | B | context | weights GiB | K/V GiB | GDN GiB | total GiB "
              f"| bound tok/s at {bandwidth / 1e12:.1f} TB/s |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, cfg in presets.items():
        for fmt in formats:
            for b in batches:
                for ctx in contexts:
                    d = decode_bytes(cfg, b, ctx, quantize=fmt)
                    lines.append(
                        f"| {name} | {fmt or 'bf16'} | {b} | {ctx:,} | {d.weights / gib:.2f} "
                        f"| {d.kv / gib:.2f} | {d.gdn / gib:.2f} | {d.total / gib:.2f} "
                        f"| {d.tokens_per_second(bandwidth):,.0f} |")
    return "\n".join(lines)
