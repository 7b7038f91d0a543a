"""A Program's executables lowered or compiled for a platform, from shapes only.

Owns the abstract Program: its params (cast, quantized, unstacked as a Program holds them) and
pools as `jax.ShapeDtypeStruct`s, and a table that lowers (`lower_all`: the StableHLO text) or
compiles (`compile_all`: XLA's whole pipeline, Triton kernels through ptxas) every executable of
`executable_specs.program_executables` for a target. Nothing is allocated, so the 27B's GPU build
compiles on a CPU host; compiled executables are inspected and dropped, never run. A GPU target
without a GPU: jax's CUDA plugin gives compile-only devices for a target description
(`gpu_devices`); see docs/gpu.md, "Compiling the GPU build without a GPU".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ninfer_jax import quant
from ninfer_jax.errors import ConfigError
from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.model import unstack_layers
from ninfer_jax.program.config import ProgramConfig, platform_defaults
from ninfer_jax.program.executable_specs import program_executables
from ninfer_jax.program.executables import StepKey, abstract_args, jit_step, on_mesh
from ninfer_jax.program.pools import Pools
from ninfer_jax.program.sharding import AXIS, param_shardings, pool_shardings, tp_mesh
from pallas_kernels.target import HOPPER

# Hopper SXM parts (sm_90: 132 SMs, 227 KiB of shared memory a block, 64 K registers), public
# figures; they differ in HBM only.
GPUS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "memory": 84942979072,
             "bandwidth": 3352320000000},
    "h200": {"name": "NVIDIA H200", "memory": 150754820096, "bandwidth": 4800000000000},
}


def target_config(gpu: str) -> str:
    """The text `stream_executor.GpuTargetConfigProto` of a GPU (XLA compiles against it)."""
    g = GPUS[gpu]
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: {HOPPER.shared_memory_per_block}
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {g['bandwidth']}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {g['memory']}
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: {HOPPER.registers_per_block}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{g['name']}"
"""


def gpu_devices(gpu: str = "h200", count: int = 1) -> list:
    """`count` compile-only devices of `gpu` (jax's CUDA plugin; no GPU or driver needed, with
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before jax starts)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", topology_name="",
                                            target_config=target_config(gpu),
                                            topology=f"1x1x{count}")
    return list(topology.devices)


def abstract_params(cfg: ModelConfig, pcfg: ProgramConfig, quantize: str | None = None,
                    drafter: DFlashConfig | None = None, params: dict | None = None) -> dict:
    """The params a Program of `cfg` and `pcfg` holds, as ShapeDtypeStructs: the schema's
    (every MTP layer the config has, as a checkpoint loads them; a DFlash drafter's under
    "dflash"), in `pcfg.dtype`, the decoder's projections quantized with `quantize` as
    `quant` holds them, per layer when the layer loop is unrolled. `params`: real weights to
    take the shapes of instead (cast as the Program casts them)."""
    from ninfer_jax.models.dflash.weights import param_shapes as drafter_shapes
    from ninfer_jax.models.qwen3_6.weights import param_shapes

    if params is None:
        params = quant.planned_structs(param_shapes(cfg, cfg.mtp_num_layers), quantize,
                                       pcfg.dtype)
        if drafter is not None:
            params["dflash"] = jax.tree.map(
                lambda shape: jax.ShapeDtypeStruct(shape, pcfg.dtype), drafter_shapes(drafter),
                is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, int) for n in x))
    params = jax.eval_shape(lambda p: quant.cast_params(p, pcfg.dtype), params)
    if pcfg.resolved_layer_loop() == "unrolled":
        params = jax.eval_shape(lambda p: unstack_layers(p, cfg), params)
    return params


def abstract_pools(cfg: ModelConfig, pcfg: ProgramConfig,
                   drafter: DFlashConfig | None = None) -> Pools:
    """The Program's pools as ShapeDtypeStructs (`Pools.allocate`, traced)."""
    mtp = cfg.mtp_num_layers if pcfg.speculative == "mtp" else 0
    return jax.eval_shape(lambda: Pools.allocate(cfg, pcfg, mtp, drafter))


def _placed(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                        shardings)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One executable compiled for a target: XLA's memory analysis, the optimized HLO's
    findings (`inspect`'s), or the error that stopped it."""

    key: StepKey
    ok: bool
    error: str = ""
    compile_s: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    findings: Any = None


class AotTable:
    """Stands in for an ExecutableTable: each `compile` lowers the step for `platform` on
    `mesh`'s devices and keeps the StableHLO text (`texts`), or with `compile` compiles it and
    keeps a `Compiled` (`results`), its optimized HLO handed to `inspect(key, hlo_text)` first.
    Nothing can run."""

    def __init__(self, platform: str, mesh: Mesh | None = None, compile: bool = False,
                 inspect: Callable[[StepKey, str], Any] | None = None,
                 on_result: Callable[[Compiled], None] | None = None):
        self.platform, self.mesh, self._compile = platform, mesh, compile
        self._inspect, self._on_result = inspect, on_result
        self.texts: dict[StepKey, str] = {}
        self.results: dict[StepKey, Compiled] = {}

    def compile(self, key: StepKey, fn: Callable, *example_args: Any,
                background: bool = False, donate: tuple[str, ...] = ("pools",)) -> None:
        abstract = tuple(abstract_args(a, self.mesh) for a in example_args)
        start = time.perf_counter()
        try:
            with on_mesh(self.mesh):
                lowered = jit_step(fn, abstract, donate, self.mesh).trace(*abstract).lower(
                    lowering_platforms=(self.platform,))
                if not self._compile:
                    self.texts[key] = lowered.as_text()
                    return
                compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 - a failed compile is a result to report
            result = Compiled(key, ok=False, error=f"{type(e).__name__}: {e}",
                              compile_s=time.perf_counter() - start)
        else:
            seconds = time.perf_counter() - start
            m = compiled.memory_analysis()
            findings = None if self._inspect is None else self._inspect(key, compiled.as_text())
            result = Compiled(key, ok=True, compile_s=seconds,
                              argument_bytes=int(m.argument_size_in_bytes),
                              output_bytes=int(m.output_size_in_bytes),
                              temp_bytes=int(m.temp_size_in_bytes), findings=findings)
        self.results[key] = result
        if self._on_result is not None:
            self._on_result(result)


def for_target(pcfg: ProgramConfig, platform: str) -> ProgramConfig:
    """`pcfg` with an "auto" layer loop resolved for the lowering platform ("cuda", "rocm",
    "tpu", "cpu"), not for this host: what a Program on that platform would build."""
    if pcfg.layer_loop != "auto":
        return pcfg
    backend = "gpu" if platform in ("cuda", "rocm") else platform
    return dataclasses.replace(pcfg, layer_loop=platform_defaults(backend)["layer_loop"])


def _fill(table: AotTable, cfg: ModelConfig, pcfg: ProgramConfig, params: dict,
          drafter: DFlashConfig | None) -> None:
    if pcfg.speculative == "mtp" and "mtp" not in params:
        raise ConfigError("speculative='mtp' needs a model with MTP weights (mtp.*); this "
                          "model has none")
    pools = abstract_pools(cfg, pcfg, drafter)
    mesh = table.mesh
    if mesh is not None:
        params = _placed(params, param_shardings(params, cfg, mesh, pcfg.moe_sharding))
        pools = _placed(pools, pool_shardings(pools, cfg, mesh))
    for spec in program_executables(cfg, pcfg, params, pools, drafter):
        table.compile(spec.key, spec.fn, *spec.args, donate=spec.donate)


def lower_all(cfg: ModelConfig, pcfg: ProgramConfig, platform: str = "cuda",
              params: dict | None = None, drafter: DFlashConfig | None = None,
              quantize: str | None = None) -> dict[StepKey, str]:
    """The lowered (StableHLO) text of every executable a Program of `cfg` and `pcfg` compiles,
    lowered for `platform` ("cuda", "rocm", "tpu", "cpu") on any host, from shapes (no weights
    or pools are allocated): a CPU machine checks the GPU build (the Pallas kernels' custom
    calls, MoE's grouped kernels). Kernels choose their form by the lowering platform, so
    nothing is in interpret mode off CPU. `params`: weights to take the shapes of (default the
    config's schema, quantized with `quantize`); `drafter`: a DFlash drafter's config, with
    speculative="dflash"."""
    pcfg = for_target(pcfg, platform)
    table = AotTable(platform, tp_mesh(pcfg.tensor_parallel))
    _fill(table, cfg, pcfg, abstract_params(cfg, pcfg, quantize, drafter, params), drafter)
    return table.texts


def compile_all(cfg: ModelConfig, pcfg: ProgramConfig, devices: Sequence,
                platform: str = "cuda", quantize: str | None = None,
                drafter: DFlashConfig | None = None,
                inspect: Callable[[StepKey, str], Any] | None = None,
                on_result: Callable[[Compiled], None] | None = None) -> list[Compiled]:
    """Every executable a Program of `cfg` and `pcfg` compiles, compiled for `platform` on
    `devices` (pcfg.tensor_parallel of them, a mesh over their tp axis), from shapes. A compile
    error is a result (ok=False), and the rest still compile."""
    if len(devices) != pcfg.tensor_parallel:
        raise ValueError(f"tensor_parallel {pcfg.tensor_parallel} needs that many devices, "
                         f"got {len(devices)}")
    pcfg = for_target(pcfg, platform)
    mesh = Mesh(np.array(devices), (AXIS,), axis_types=(AxisType.Auto,))
    table = AotTable(platform, mesh, compile=True, inspect=inspect, on_result=on_result)
    params = abstract_params(cfg, pcfg, quantize, drafter)
    _fill(table, cfg, pcfg, params, drafter)
    return list(table.results.values())
