"""CausalScoreCore: the CausalScoring purpose's executor (DESIGN §9, §10).

Owns the window plan and the order in which windows run; execution belongs to its
`ScoringProgram`, which it calls serially. At start-up the program compiles one executable per
window shape `WindowKey(rows, length)`: a few window lengths (doubling from `min_len` up to the
longest window) with `rows = max_batch_tokens // length` windows per call. A window runs in the
shortest compiled length that holds it; windows of one length are packed `rows` at a time and
the last call of a length is filled with empty rows, so every call has an exact compiled shape
and nothing compiles after start-up.

There are no requests, checkpoints, Scheduler or ResourceManager, and no generation pools: each
window starts from empty GDN state and KV inside its call. It knows token ids only; text belongs
to `Scorer`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from ninfer_jax.errors import ConfigError, NinferError
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.scoring import ScoringProgram, WindowKey
from ninfer_jax.program.scoring_steps import WindowInputs
from ninfer_jax.progress import bar
from ninfer_jax.scoring.windows import Window, check_window_stride, rolling_windows

__all__ = ["CausalScoreCore", "ScoreInputError", "ScoreRequest", "ScoringConfig", "TokenScores",
           "WindowKey"]

DEFAULT_MAX_LEN = 2048


class ScoreInputError(NinferError, ValueError):
    """One item cannot be scored (nothing to score, bad token id, too long); names the reason."""


@dataclasses.dataclass(frozen=True)
class ScoringConfig:
    """Static scoring settings; every field that shapes an executable is fixed at start-up.

    window: rolling window (most tokens one window reads); None = no rolling: an item is scored
      in one window of at most max_len tokens (a longer context is cut from the left, as
      lm-evaluation-harness does) and an item with more than max_len targets is an error.
    stride: most new tokens each window after the first scores (default: window).
    max_len: longest window without rolling (default: the model's limit, at most 2048).
    min_len: shortest compiled window length; lengths double from it up to the longest window.
    max_batch_tokens: tokens per call; a call holds max(1, max_batch_tokens // length) windows.
    dtype: weights and activations ("float32" or "bfloat16"); log-probs are always fp32.
    top_logprobs: also return each scored position's N most likely tokens (0 = none; the
      server's `echo` uses MAX_LOGPROBS).
    """

    window: int | None = None
    stride: int | None = None
    max_len: int | None = None
    min_len: int = 64
    max_batch_tokens: int = 4096
    dtype: str = "float32"
    top_logprobs: int = 0

    def __post_init__(self):
        """Types and model-independent ranges, checked before any model is loaded."""
        for name in ("window", "stride", "max_len", "min_len", "max_batch_tokens"):
            value = getattr(self, name)
            optional = name in ("window", "stride", "max_len")
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1"
                                  f"{' or None' if optional else ''}, got {value!r:.40}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= 64:
            raise ConfigError(f"top_logprobs must be an integer in [0, 64], got "
                              f"{self.top_logprobs!r:.40}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r:.40}")

    def longest(self, cfg: ModelConfig) -> int:
        """The longest window this config compiles for `cfg`."""
        if self.window is not None:
            return self.window
        return self.max_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)

    def validate(self, cfg: ModelConfig) -> None:
        if self.stride is not None and self.window is None:
            raise ConfigError("stride needs a window")
        longest = self.longest(cfg)
        try:
            check_window_stride(longest, self.stride or longest)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if longest > cfg.max_position_embeddings:
            raise ConfigError(f"window {longest} exceeds the model's max_position_embeddings "
                              f"{cfg.max_position_embeddings}")

    def window_lens(self, cfg: ModelConfig) -> tuple[int, ...]:
        longest, lens, n = self.longest(cfg), [], self.min_len
        while n < longest:
            lens.append(n)
            n *= 2
        return (*lens, longest)


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """Score s[first_target:] of the token sequence s = token_ids ([M] int)."""

    token_ids: np.ndarray
    first_target: int


@dataclasses.dataclass(frozen=True)
class TokenScores:
    logprobs: np.ndarray  # [K] float32, one per scored token
    is_greedy: np.ndarray  # [K] bool
    top_ids: np.ndarray  # [K, N] int32, the N most likely tokens at each scored position
    top_logprobs: np.ndarray  # [K, N] float32, their log-probs (N = top_logprobs)


class CausalScoreCore:
    """Scoring requests for one model package, run on its ScoringProgram; `score` runs a list
    of requests."""

    def __init__(self, cfg: ModelConfig, params: dict, scfg: ScoringConfig = ScoringConfig(),
                 *, progress: bool | None = False):
        scfg.validate(cfg)
        self.cfg, self.scfg = cfg, scfg
        self.window = scfg.longest(cfg)
        self.stride = scfg.stride if scfg.window is not None else None
        self.lengths = scfg.window_lens(cfg)
        self._rows = {n: max(1, scfg.max_batch_tokens // n) for n in self.lengths}
        self.program = ScoringProgram(cfg, params,
                                      [WindowKey(rows, n) for n, rows in self._rows.items()],
                                      dtype=scfg.dtype, top_n=scfg.top_logprobs,
                                      progress=progress)

    def keys(self) -> list[WindowKey]:
        return self.program.keys()

    @property
    def compile_seconds(self) -> dict[WindowKey, float]:
        return self.program.compile_seconds

    def plan(self, request: ScoreRequest, *, roll: bool = False) -> list[Window]:
        """The request's windows; raises ScoreInputError when it cannot be scored. With no
        configured window, roll=True rolls a long request in windows of the longest length."""
        ids, first = request.token_ids, request.first_target
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ScoreInputError(f"token ids must be a 1-D int array, got {ids.dtype} {ids.shape}")
        if first < 1:
            raise ScoreInputError("the first scored token needs a token before it")
        if len(ids) <= first:
            raise ScoreInputError(f"nothing to score: {len(ids)} token(s), the first scored one "
                                  f"would be at index {first}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ScoreInputError(f"token ids must be in [0, {self.cfg.vocab_size}), got "
                                  f"[{ids.min()}, {ids.max()}]")
        windows = rolling_windows(len(ids), first, self.window, self.stride)
        if self.scfg.window is None and not roll and len(windows) > 1:
            raise ScoreInputError(f"too long: {len(ids) - first} tokens to score, more than the "
                                  f"{self.window} one window holds (set a window to roll)")
        return windows

    def score(self, requests: Sequence[ScoreRequest], *, roll: bool = False,
              progress: bool | None = False) -> list[TokenScores]:
        """Per-token scores of every request, in order. Every request must pass `plan`.
        progress: a bar over the windows (None: in a notebook only; see `ninfer_jax.progress`)."""
        by_len: dict[int, list[tuple[int, int, Window]]] = collections.defaultdict(list)
        num_windows = []
        for i, request in enumerate(requests):
            windows = self.plan(request, roll=roll)
            num_windows.append(len(windows))
            for j, w in enumerate(windows):
                length = next(n for n in self.lengths if n >= w.length)
                by_len[length].append((i, j, w))
        dispatched = []  # every call is issued before any result is read (async dispatch)
        for length, jobs in sorted(by_len.items()):
            rows = self._rows[length]
            for k in range(0, len(jobs), rows):
                batch = jobs[k : k + rows]
                inputs = _inputs([(requests[i].token_ids, w) for i, _, w in batch], rows, length)
                dispatched.append(
                    (batch, self.program.score_windows(WindowKey(rows, length), inputs)))
        pieces: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        with bar(progress, sum(num_windows), "scoring", "window") as b:
            for batch, out in dispatched:
                arrays = [np.asarray(a) for a in (out.logprobs, out.is_greedy, out.top_ids,
                                                  out.top_logprobs)]
                for row, (i, j, w) in enumerate(batch):
                    lo = w.length - w.num_targets
                    pieces[i, j] = tuple(a[row, lo : w.length] for a in arrays)
                b.update(len(batch))
        return [TokenScores(*(np.concatenate([pieces[i, j][f] for j in range(n)])
                              for f in range(4)))
                for i, n in enumerate(num_windows)]


def _inputs(windows: list[tuple[np.ndarray, Window]], rows: int, length: int) -> WindowInputs:
    """Host arrays for one call: each window at the start of its row, empty rows after them."""
    token_ids = np.zeros((rows, length), np.int32)
    target_ids = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), bool)
    num_valid = np.zeros(rows, np.int32)
    for row, (ids, w) in enumerate(windows):
        n = w.length
        token_ids[row, :n] = ids[w.start : w.end]
        target_ids[row, :n] = ids[w.start + 1 : w.end + 1]
        mask[row, n - w.num_targets : n] = True
        num_valid[row] = n
    return WindowInputs(token_ids=token_ids, target_ids=target_ids, target_mask=mask,
                        num_valid=num_valid)

