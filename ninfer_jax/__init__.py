"""ninfer-jax: a JAX/XLA inference engine for the Qwen3.6 model family.

The public API a notebook needs lives here; everything else is importable from its module.
"""

from ninfer_jax.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
__version__ = "0.1.0"
