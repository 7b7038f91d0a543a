"""How a Pallas kernel is called from a step: interpreted or compiled by the platform the step
is lowered for, and per device over its heads on a tensor-parallel mesh."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

# The mesh axis whose devices split heads (`ninfer_jax.program.sharding`'s tensor-parallel axis):
# kernels traced on a mesh with it run per device over their share of the heads.
TP_AXIS = "tp"


def by_platform(run: Callable, interpret: bool | None, *args):
    """`run(*args, interpret=...)` (args: arrays or pytrees of them): as given, or when None by
    the platform the step is lowered for (`jax.lax.platform_dependent`): the interpreter on
    CPU, where a Triton kernel cannot run compiled, the compiled kernel elsewhere; so a CPU
    host lowering for CUDA gets the kernel."""
    if interpret is not None:
        return run(*args, interpret=interpret)
    return jax.lax.platform_dependent(*args, cpu=functools.partial(run, interpret=True),
                                      default=functools.partial(run, interpret=False))


def per_device(fn: Callable, args: tuple, out_heads: int | tuple[int, ...],
               axis: str = TP_AXIS):
    """`fn(*arrays)` for `args` whose entries are arrays (replicated) or `(array, head_axis)`
    pairs (heads split over the mesh axis `axis`). Traced on a mesh whose `axis` has more than
    one device and divides every such head count, it runs per device under `shard_map` (a
    kernel is opaque to XLA's partitioner, which would otherwise gather its operands whole);
    `out_heads` is the head axis of its output (a tuple: of each of its outputs). Elsewhere it
    is `fn(*arrays)`."""
    arrays = [a[0] if isinstance(a, tuple) else a for a in args]
    mesh = jax.sharding.get_abstract_mesh()
    n = 1 if mesh.empty or axis not in mesh.axis_names else mesh.shape[axis]
    if n == 1 or any(a[0].shape[a[1]] % n for a in args if isinstance(a, tuple)):
        return fn(*arrays)

    def spec(head_axis: int) -> PartitionSpec:  # trailing axes unnamed: whole on every device
        return PartitionSpec(*([None] * head_axis), axis)

    in_specs = tuple(spec(a[1]) if isinstance(a, tuple) else PartitionSpec() for a in args)
    out_specs = spec(out_heads) if isinstance(out_heads, int) else tuple(map(spec, out_heads))
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*arrays)
