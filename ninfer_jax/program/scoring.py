"""ScoringProgram: the Program of the CausalScoring purpose (DESIGN §2, §9, §10).

The only entry to physical execution for an Engine opened for causal scoring. Owns the model's
device weights, the scoring-window executables (one per `WindowKey`, all compiled at start-up in
an `ExecutableTable`, so a shape that was not compiled raises instead of compiling) and, inside
each call, the window's temporary state: zero GDN state, attention only over the window's own
tokens, and the scoring staging (the chunked lm-head logits; see `scoring_steps.py`). It has no
pools, sequences, checkpoints or donation: a call keeps nothing, so calls are independent and the
caller (`CausalScoreCore`) runs them one after another. It knows windows of token ids only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax import quant
from ninfer_jax.errors import ConfigError
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.executables import ExecutableTable, StepKey, StepKind, bind
from ninfer_jax.program.scoring_steps import WindowInputs, WindowScores, score_window_step
from ninfer_jax.progress import bar


@dataclasses.dataclass(frozen=True)
class WindowKey:
    """One scoring-window shape: `rows` windows of `length` tokens per call."""

    rows: int
    length: int

    def step_key(self) -> StepKey:
        return StepKey(StepKind.SCORE_WINDOW, self.rows, self.length)


class ScoringProgram:
    """Compiled scoring windows over one model's device weights (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, params: dict, keys: Sequence[WindowKey], *,
                 dtype: str = "float32", top_n: int = 0, progress: bool | None = False):
        """Compiles every key's executable before returning; `progress`: a bar over them
        (None: in a notebook only, see `ninfer_jax.progress`)."""
        if not keys:
            raise ConfigError("a ScoringProgram needs at least one window shape")
        self.cfg, self.top_n = cfg, top_n
        self.params = quant.cast_params(params, dtype)
        self.executables = ExecutableTable()
        step = bind(score_window_step, cfg=cfg, top_n=top_n)
        self._keys = tuple(dict.fromkeys(keys))
        with bar(progress, len(self._keys), "compiling scoring windows", "exe") as b:
            for key in self._keys:
                self.executables.compile(key.step_key(), step, self.params, _example(key),
                                         donate=())
                b.update(1)

    def keys(self) -> list[WindowKey]:
        return list(self._keys)

    @property
    def compile_seconds(self) -> dict[WindowKey, float]:
        seconds = self.executables.compile_seconds
        return {k: seconds[k.step_key()] for k in self._keys}

    def score_windows(self, key: WindowKey, inputs: WindowInputs) -> WindowScores:
        """Dispatches one call of `key`'s executable (asynchronously: the result is read when
        the caller converts it). Raises MissingExecutableError for a shape never compiled and
        ValueError when an input's shape or dtype is not the key's."""
        expected = _example(key)
        for name in ("token_ids", "target_ids", "target_mask", "num_valid"):
            want, got = getattr(expected, name), np.shape(getattr(inputs, name))
            dtype = getattr(getattr(inputs, name), "dtype", None)
            if got != want.shape or dtype != want.dtype:
                raise ValueError(f"{name} must be {want.dtype}{list(want.shape)} for {key}, "
                                 f"got {dtype}{list(got)}")
        return self.executables(key.step_key(), self.params, inputs)


def _example(key: WindowKey) -> WindowInputs:
    shape = (key.rows, key.length)
    return WindowInputs(
        token_ids=jax.ShapeDtypeStruct(shape, jnp.int32),
        target_ids=jax.ShapeDtypeStruct(shape, jnp.int32),
        target_mask=jax.ShapeDtypeStruct(shape, jnp.bool_),
        num_valid=jax.ShapeDtypeStruct((key.rows,), jnp.int32))
