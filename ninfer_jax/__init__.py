"""ninfer-jax: a JAX/XLA inference engine for the Qwen3.6 model family.

The public API a notebook needs lives here; everything else is importable from its module.
Names are resolved lazily so that importing a jax-free subpackage (`ninfer_jax.store`,
`ninfer_jax.engine`, `ninfer_jax.frontend`) does not import jax.
"""

import importlib

_EXPORTS = {
    "Engine": "ninfer_jax.api",
    "EngineStats": "ninfer_jax.engine",
    "FinishReason": "ninfer_jax.engine",
    "GenerationResult": "ninfer_jax.engine",
    "LoadedModel": "ninfer_jax.loader",
    "RejectedError": "ninfer_jax.engine",
    "SamplingParams": "ninfer_jax.sampling_params",
    "StructuredOutput": "ninfer_jax.sampling_params",
    "TokenLogprob": "ninfer_jax.engine",
    "Scorer": "ninfer_jax.scoring",
    "load_model": "ninfer_jax.loader",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ninfer_jax' has no attribute {name!r}")
