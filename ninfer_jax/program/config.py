"""The Program's static configuration (frozen, validated; a jit static argument)."""

from __future__ import annotations

import dataclasses

from ninfer_jax.errors import ConfigError

ATTENTION_IMPLS = ("reference", "pallas")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
    """Pool sizes and step shapes. Every field is static: changing one means new executables."""

    max_concurrency: int = 8  # decode executables for every B in 1..max_concurrency
    page_size: int = 16  # KV positions per page
    num_pages: int = 256  # KV pages in the pool (shared by all attention layers' stacks)
    max_seq_len: int = 2048  # prompt + generated tokens of one sequence
    prefill_chunk: int = 64  # tokens per staged-prefill step (the last chunk padded, masked)
    attention_impl: str = "reference"  # "reference" (jnp) or "pallas"
    dtype: str = "float32"  # weights, activations and KV pages
    num_checkpoint_slots: int = 0  # GDN state images of prefix checkpoints (0 = no reuse)

    def __post_init__(self):
        checks = {
            "max_concurrency": 1 <= self.max_concurrency <= 64,
            "page_size": self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            "num_pages": self.num_pages >= 1,
            "max_seq_len": self.max_seq_len >= 2,
            "prefill_chunk": self.prefill_chunk >= 1,
            "attention_impl": self.attention_impl in ATTENTION_IMPLS,
            "dtype": self.dtype in DTYPES,
            "num_checkpoint_slots": self.num_checkpoint_slots >= 0,
        }
        limits = {
            "max_concurrency": "in 1..64", "page_size": "a power of two",
            "num_pages": ">= 1", "max_seq_len": ">= 2", "prefill_chunk": ">= 1",
            "attention_impl": f"one of {ATTENTION_IMPLS}", "dtype": f"one of {DTYPES}",
            "num_checkpoint_slots": ">= 0",
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"{name} must be {limits[name]}, got {getattr(self, name)!r}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def num_slots(self) -> int:
        """Committed GDN state slots: one per concurrently active sequence."""
        return self.max_concurrency
