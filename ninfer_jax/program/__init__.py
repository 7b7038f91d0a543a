"""The Program: pools, exact-B step functions, sampling and PendingBatch (DESIGN §2, §6, §10).

The names a user reaches for are exported here, resolved lazily (importing the package, or a
jax-free module of it such as `host`, does not import jax or build anything).
"""

import importlib

_EXPORTS = {
    "Program": "ninfer_jax.program.program",
    "ProgramConfig": "ninfer_jax.program.config",
    "platform_defaults": "ninfer_jax.program.config",
    "StepKey": "ninfer_jax.program.executables",
    "StepKind": "ninfer_jax.program.executables",
    "lower_all": "ninfer_jax.program.aot",
    "compile_all": "ninfer_jax.program.aot",
    "memory_plan": "ninfer_jax.program.plan",
}

__all__ = ["Program", "ProgramConfig", "StepKey", "StepKind", "compile_all", "lower_all",
           "memory_plan", "platform_defaults"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ninfer_jax.program' has no attribute {name!r}")
