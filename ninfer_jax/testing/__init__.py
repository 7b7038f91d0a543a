"""Test doubles and tiny configs that ship with the package (STYLE §11)."""

from ninfer_jax.testing.configs import tiny_dense, tiny_moe

__all__ = ["tiny_dense", "tiny_moe"]
