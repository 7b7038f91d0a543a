"""Test doubles and tiny configs that ship with the package (STYLE §11).

`FakeProgram` and `ByteTokenizer` import no jax; the tiny model configs do (lazily).
"""

import importlib

_EXPORTS = {
    "ByteTokenizer": "ninfer_jax.testing.tokenizer",
    "FakeProgram": "ninfer_jax.testing.fake_program",
    "tiny_dense": "ninfer_jax.testing.configs",
    "tiny_moe": "ninfer_jax.testing.configs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ninfer_jax.testing' has no attribute {name!r}")
