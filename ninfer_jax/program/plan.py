"""Memory plans: what a Program of (ModelConfig, ProgramConfig) holds on its devices, before
anything is allocated (`ninfer plan`).

Owns the arithmetic only: the weights from the params schema (`weights.param_shapes`, in the
plan's dtype), every pool from `Pools.allocate` traced abstractly (`jax.eval_shape`: the exact
shapes the Program allocates, no memory; K/V pages in the page dtype, `kv_dtype`, and what one
page holds per GB), and an estimate of the vision encoder's working memory at its largest
bucket (its attention scores dominate). With tensor_parallel = N the
per-device figures follow the head-sharded layout DESIGN §13 describes (weights split N ways;
K/V pages by KV head and GDN state by value head, each at most N ways, replicated beyond the
head count; the rest replicated); tensor parallelism itself is the [scale] work, so those
figures are a plan, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from ninfer_jax import quant
from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.weights import param_shapes
from ninfer_jax.program.config import ProgramConfig

GIB = 1 << 30
H200_BYTES = 141 * 10**9  # one H200's HBM3e
# Pool fields by region, and the head count each is sharded by ("kv", "v", or None: replicated).
_REGIONS = {
    "kv_pages": (("k", "v", "k_scale", "v_scale"), "kv"),
    "gdn_state": (("conv", "rec", "ctx"), "v"),
    "provisional": (("prov_conv", "prov_rec", "prov_ctx"), "v"),
    "checkpoint_state": (("ck_conv", "ck_rec", "ck_ctx"), "v"),
    "sampling": (("output_counts", "prompt_mask"), None),
    "drafter_context": (("dk", "dv", "ck_dk", "ck_dv"), None),
}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    regions: dict[str, int]  # bytes in all, per region
    per_device: dict[str, int]  # bytes on each device, per region
    tensor_parallel: int
    device_bytes: int
    page_size: int = 16  # K/V positions per page
    # One K/V page over all attention layers (ProgramLimits.page_bytes: the page dtype's K and
    # V, plus INT8 pages' scales) in all, and on each device
    page_bytes: int = 0
    device_page_bytes: int = 0

    @property
    def pages_per_gb(self) -> float:
        """K/V pages (of every attention layer) that 10^9 bytes of one device hold."""
        return 1e9 / self.device_page_bytes if self.device_page_bytes else 0.0

    @property
    def total(self) -> int:
        return sum(self.regions.values())

    @property
    def device_total(self) -> int:
        return sum(self.per_device.values())

    @property
    def fits(self) -> bool:
        return self.device_total <= self.device_bytes


def _nbytes(tree) -> int:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves)


def vision_estimate(cfg: ModelConfig, pcfg: ProgramConfig) -> int:
    """The vision encoder's working memory at its largest bucket N (0 without a tower): the
    patches and layout, the embeddings, a block's activations (fp32) and its attention
    scores and probabilities, heads x N x N fp32 twice."""
    v, n = cfg.vision, (pcfg.vision_buckets or (0,))[-1]
    if v is None or not n:
        return 0
    inputs = n * (v.patch_dim + 4 + 4 + 2 + 1) * 4
    out = n // v.merge_unit * cfg.hidden_size * 4
    acts = n * (4 * v.hidden_size + v.intermediate_size) * 4
    return inputs + out + acts + 2 * v.num_heads * n * n * 4


def memory_plan(cfg: ModelConfig, pcfg: ProgramConfig, num_mtp_layers: int | None = None,
                tensor_parallel: int = 1, device_bytes: int = H200_BYTES,
                quantize: str | None = None) -> MemoryPlan:
    """The plan of a Program of `cfg` with `pcfg` (its dtype, pools and buckets), the MTP head's
    layers (default the config's) included, on `tensor_parallel` devices of `device_bytes`;
    `quantize` ("int8" | "int4" | "fp8"): the decoder's projections quantized as
    `ninfer_jax.quant` holds them (values and fp32 scales)."""
    from ninfer_jax.program.pools import Pools

    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    mtp = cfg.mtp_num_layers if num_mtp_layers is None else num_mtp_layers
    regions = {"weights": quant.planned_bytes(param_shapes(cfg, mtp), quantize, pcfg.dtype)}
    pools = jax.eval_shape(lambda: Pools.allocate(cfg, pcfg, mtp if pcfg.speculative == "mtp"
                                                  else 0))
    heads = {"kv": cfg.num_kv_heads, "v": cfg.linear_num_v_heads, None: 1}
    per_device = {"weights": -(-regions["weights"] // tensor_parallel)}
    for region, (fields, by) in _REGIONS.items():
        size = sum(_nbytes(getattr(pools, f)) for f in fields if getattr(pools, f, None)
                   is not None)
        if size:
            regions[region] = size
            per_device[region] = -(-size // min(tensor_parallel, heads[by]))
    vision = vision_estimate(cfg, pcfg)
    if vision:
        regions["vision (estimate)"] = per_device["vision (estimate)"] = vision
    page = regions["kv_pages"] // (pcfg.num_pages + 1)
    return MemoryPlan(regions, per_device, tensor_parallel, device_bytes, pcfg.page_size, page,
                      -(-page // min(tensor_parallel, heads["kv"])))


def format_plan(name: str, cfg: ModelConfig, pcfg: ProgramConfig, plan: MemoryPlan,
                quantize: str | None = None) -> str:
    """The plan as a table: GiB per region, in all and per device, and whether it fits."""
    tp = plan.tensor_parallel
    kv = "" if pcfg.kv_dtype == "auto" else f", {pcfg.kv_dtype} K/V pages"
    weights = "" if quantize is None else f", {quantize} weights"
    head = (f"{name}: {pcfg.dtype}{weights}{kv}, max_seq_len {pcfg.max_seq_len}, max_concurrency "
            f"{pcfg.max_concurrency}, {pcfg.num_pages} pages of {pcfg.page_size}, "
            f"{pcfg.num_checkpoint_slots} checkpoint slots, on {tp} device(s) of "
            f"{plan.device_bytes / 1e9:.0f} GB")
    lines = [head, f"  {'region':<20}{'all GiB':>12}{'per device GiB':>18}"]
    for region, size in plan.regions.items():
        lines.append(f"  {region:<20}{size / GIB:>12.2f}{plan.per_device[region] / GIB:>18.2f}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  {'total':<20}{plan.total / GIB:>12.2f}{plan.device_total / GIB:>18.2f}"
                 f"   {verdict} ({(plan.device_bytes - plan.device_total) / GIB:+.1f} GiB left "
                 f"a device)")
    lines.append(f"  K/V page ({pcfg.page_dtype}): {plan.device_page_bytes:,} bytes a device "
                 f"over all attention layers, {plan.pages_per_gb:,.1f} pages "
                 f"({plan.pages_per_gb * plan.page_size:,.0f} tokens) per GB")
    if tp > 1:
        lines.append("  (per device: the head-sharded tensor-parallel layout, planned; "
                     "tensor parallelism is not implemented yet)")
    return "\n".join(lines)
