"""ScoringProgram: the Program of the CausalScoring purpose (DESIGN §2, §9, §10).

The only entry to physical execution for an Engine opened for causal scoring. Owns the model's
device weights, the scoring executables (one per `WindowKey` and per `SharedKey`, all compiled at
start-up in an `ExecutableTable`, so a shape that was not compiled raises instead of compiling)
and, inside each call, the windows' temporary state: zero GDN state, attention only over the
window's own tokens (or a shared context's), and the scoring staging (the chunked lm-head
logits; see `scoring_steps.py`). It has no
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
from ninfer_jax.host_memory import keep_freed_memory
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.model import unstack_layers
from ninfer_jax.program.config import LAYER_LOOPS, resolve_layer_loop
from ninfer_jax.program.executables import ExecutableTable, StepKey, StepKind, bind
from ninfer_jax.program.scoring_steps import (
    SharedInputs,
    WindowInputs,
    WindowScores,
    score_shared_step,
    score_window_step,
)
from ninfer_jax.progress import bar


@dataclasses.dataclass(frozen=True)
class WindowKey:
    """One scoring-window shape: `rows` windows of `length` tokens per call."""

    rows: int
    length: int

    def step_key(self) -> StepKey:
        return StepKey(StepKind.SCORE_WINDOW, self.rows, self.length)


@dataclasses.dataclass(frozen=True)
class SharedKey:
    """One shared-context shape: `contexts` contexts of `context_len` tokens and `rows`
    continuation rows of `length` targets per call."""

    contexts: int
    context_len: int
    rows: int
    length: int

    def step_key(self) -> StepKey:
        return StepKey(StepKind.SCORE_SHARED, self.contexts, self.context_len,
                       (self.rows, self.length))


Key = WindowKey | SharedKey


class ScoringProgram:
    """Compiled scoring windows over one model's device weights (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, params: dict, keys: Sequence[Key], *,
                 dtype: str = "float32", top_n: int = 0, progress: bool | None = False,
                 layer_loop: str = "auto"):
        """Compiles every key's executable before returning; `progress`: a bar over them
        (None: in a notebook only, see `ninfer_jax.progress`). `layer_loop`: as
        `ProgramConfig.layer_loop` ("auto": `platform_defaults`, unrolled on CPU and GPU; a
        scan copied each layer's weights out of the stacked buffer before its matmuls)."""
        if not keys:
            raise ConfigError("a ScoringProgram needs at least one window shape")
        if layer_loop not in LAYER_LOOPS:
            raise ConfigError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
        keep_freed_memory()
        self.cfg, self.top_n = cfg, top_n
        self.layer_loop = resolve_layer_loop(layer_loop)
        self.params = quant.cast_params(
            unstack_layers(params, cfg) if self.layer_loop == "unrolled" else params, dtype)
        self.executables = ExecutableTable()
        steps = {WindowKey: bind(score_window_step, cfg=cfg, top_n=top_n),
                 SharedKey: bind(score_shared_step, cfg=cfg, top_n=top_n)}
        self._keys = tuple(dict.fromkeys(keys))
        with bar(progress, len(self._keys), "compiling scoring windows", "exe") as b:
            for key in self._keys:
                self.executables.compile(key.step_key(), steps[type(key)], self.params,
                                         _example(key), donate=())
                b.update(1)

    def keys(self) -> list[Key]:
        return list(self._keys)

    @property
    def compile_seconds(self) -> dict[Key, float]:
        seconds = self.executables.compile_seconds
        return {k: seconds[k.step_key()] for k in self._keys}

    def score_windows(self, key: WindowKey, inputs: WindowInputs) -> WindowScores:
        """Dispatches one call of `key`'s executable (asynchronously: the result is read when
        the caller converts it). Raises MissingExecutableError for a shape never compiled and
        ValueError when an input's shape or dtype is not the key's."""
        return self._call(key, inputs)

    def score_shared(self, key: SharedKey, inputs: SharedInputs) -> WindowScores:
        """As `score_windows`, for continuations of shared contexts (`score_shared_step`)."""
        return self._call(key, inputs)

    def _call(self, key: Key, inputs: WindowInputs | SharedInputs) -> WindowScores:
        expected = _example(key)
        if type(inputs) is not type(expected):
            raise ValueError(f"{key} takes {type(expected).__name__}, got "
                             f"{type(inputs).__name__}")
        for field in dataclasses.fields(expected):
            name = field.name
            want, got = getattr(expected, name), np.shape(getattr(inputs, name))
            dtype = getattr(getattr(inputs, name), "dtype", None)
            if got != want.shape or dtype != want.dtype:
                raise ValueError(f"{name} must be {want.dtype}{list(want.shape)} for {key}, "
                                 f"got {dtype}{list(got)}")
        return self.executables(key.step_key(), self.params, inputs)


def _example(key: Key) -> WindowInputs | SharedInputs:
    def spec(*shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype)

    if isinstance(key, SharedKey):
        c, b = key.contexts, key.rows
        return SharedInputs(
            context_ids=spec(c, key.context_len), context_len=spec(c),
            token_ids=spec(b, key.length), target_ids=spec(b, key.length),
            target_mask=spec(b, key.length, dtype=jnp.bool_), num_valid=spec(b),
            context_of=spec(b))
    shape = (key.rows, key.length)
    return WindowInputs(token_ids=spec(*shape), target_ids=spec(*shape),
                        target_mask=spec(*shape, dtype=jnp.bool_), num_valid=spec(key.rows),
                        positions=spec(*shape), segment_ids=spec(*shape))
