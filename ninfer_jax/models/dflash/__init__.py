"""The DFlash / DFlash2 block drafter (the second speculative backend's draft model)."""

from ninfer_jax.models.dflash.config import DFlashConfig

__all__ = ["DFlashConfig"]
