"""The GPU a Triton kernel is built for, as far as its block sizes care.

Owns the per-architecture limits a kernel's tiles must fit (public NVIDIA figures: the shared
memory one thread block may opt in to, and the 64 K 32-bit registers of an SM) and which
architecture a trace is for: the GPUs of this process (the smallest, if they differ), or, on a
host with none (a CPU lowering or an ahead-of-time compile for a GPU), Hopper (sm_90), the
H100/H200 class this project's users deploy on. Kernels derive their block sizes from these
limits (`fits`), so fp32 and bf16 pick different tiles and nothing is sized for one card only.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class GpuLimits:
    compute_capability: float
    shared_memory_per_block: int  # bytes one thread block may use (the opt-in maximum)
    registers_per_block: int = 65536  # 32-bit registers

    def fits(self, shared_bytes: int) -> bool:
        return shared_bytes <= self.shared_memory_per_block


# Opt-in shared memory per block by compute capability (CUDA programming guide, "Technical
# Specifications per Compute Capability").
_SHARED = {7.0: 98304, 7.5: 65536, 8.0: 166912, 8.6: 101376, 8.7: 166912, 8.9: 101376,
           9.0: 232448, 10.0: 232448, 12.0: 101376}
HOPPER = GpuLimits(9.0, _SHARED[9.0])


def limits_for(compute_capability: float) -> GpuLimits:
    """The limits of an architecture; an unknown one gets the most conservative listed."""
    shared = _SHARED.get(compute_capability, min(_SHARED.values()))
    return GpuLimits(compute_capability, shared)


def gpu_limits() -> GpuLimits:
    """The limits of the GPUs of this process (the smallest), or Hopper's on a host without a
    GPU (a lowering or an ahead-of-time compile for one)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return HOPPER
    return min((limits_for(float(getattr(d, "compute_capability", "9.0"))) for d in gpus),
               key=lambda g: g.shared_memory_per_block)
