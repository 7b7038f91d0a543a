"""CausalScoreCore: the CausalScoring purpose's executor (DESIGN §9, §10).

Owns the call plan (which windows share a call, a row or a context) and the order in which calls
run; execution belongs to its `ScoringProgram`, which it calls serially. At start-up the program
compiles every shape a plan can use, so nothing compiles after start-up:
- `WindowKey(rows, length)`: a few window lengths (doubling from `min_len` up to the longest
  window), `rows = max_batch_tokens // length` rows per call. A window runs in the shortest
  length that holds it; windows of at most `pack_len` tokens are packed several to a row of
  `pack_len` tokens (best fit, longest first), each from its own empty state.
- `SharedKey(contexts, context_len, rows, length)` (with `share_contexts`): requests that share
  their context tokens exactly (lm-eval's N choices of one question) and fit one window score
  the context once and every continuation from its state, in rows of at most
  `max_continuation` targets; a context of one request, or a continuation too long for the
  shape, is scored as a window instead.
The last call of a shape is filled with empty rows, so every call has an exact compiled shape.
Every score equals the score of the request alone (to floating-point rounding).

There are no requests, checkpoints, Scheduler or ResourceManager, and no generation pools: each
window or context starts from empty GDN state and KV inside its call. It knows token ids only;
text belongs to `Scorer`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from ninfer_jax.errors import ConfigError, NinferError
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.scoring import ScoringProgram, SharedKey, WindowKey
from ninfer_jax.program.scoring_steps import SharedInputs, WindowInputs
from ninfer_jax.progress import bar
from ninfer_jax.scoring.windows import Window, check_window_stride, rolling_windows

__all__ = ["CausalScoreCore", "Occupancy", "ScoreInputError", "ScoreRequest", "ScoringConfig", "SharedKey",
           "TokenScores", "WindowKey"]

DEFAULT_MAX_LEN = 2048
SHARED_ROWS = 4  # continuation rows per context slot in a shared call
TAIL_SHARE = 4  # the tail call of packed rows has 1 / TAIL_SHARE of a full call's rows


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
    pack: put windows of at most `pack_len` tokens several to a row (see the module docstring).
    share_contexts: score a context shared by several requests once (see the module docstring).
    max_continuation: most targets of a continuation scored from a shared context.
    """

    window: int | None = None
    stride: int | None = None
    max_len: int | None = None
    min_len: int = 64
    max_batch_tokens: int = 4096
    dtype: str = "float32"
    top_logprobs: int = 0
    pack: bool = True
    share_contexts: bool = True
    max_continuation: int = 32

    def __post_init__(self):
        """Types and model-independent ranges, checked before any model is loaded."""
        for name in ("pack", "share_contexts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r:.40}")
        for name in ("window", "stride", "max_len", "min_len", "max_batch_tokens",
                     "max_continuation"):
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

    def pack_len(self, cfg: ModelConfig) -> int | None:
        """The row length short windows are packed into (the second window length, or the
        longest), or None without packing. Rows of 128 rather than 256: a row's attention reads
        every pair of its positions (masked per segment); the demo model's 4096-token call took
        151 ms in rows of 128 and 155 in rows of 256."""
        lens = self.window_lens(cfg)
        return lens[min(1, len(lens) - 1)] if self.pack else None

    def window_keys(self, cfg: ModelConfig) -> list[WindowKey]:
        """One key per window length; with packing, also a quarter-size call of packed rows
        (the last call of a batch of short texts, so that it is not mostly filler)."""
        keys = [WindowKey(max(1, self.max_batch_tokens // n), n) for n in self.window_lens(cfg)]
        pack = self.pack_len(cfg)
        if pack is not None and self.max_batch_tokens // pack >= TAIL_SHARE:
            keys.append(WindowKey(self.max_batch_tokens // pack // TAIL_SHARE, pack))
        return keys

    def shared_keys(self, cfg: ModelConfig) -> list[SharedKey]:
        """Per window length Lc: continuations of up to min(max_continuation, Lc // 2) targets,
        four rows per context (a four-way choice), as many contexts as max_batch_tokens holds."""
        if not self.share_contexts:
            return []
        keys = []
        for n in self.window_lens(cfg):
            length = min(self.max_continuation, max(1, n // 2))
            contexts = max(1, self.max_batch_tokens // (n + SHARED_ROWS * length))
            keys.append(SharedKey(contexts, n, SHARED_ROWS * contexts, length))
        return keys


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """Score s[first_target:] of the token sequence s = token_ids ([M] int)."""

    token_ids: np.ndarray
    first_target: int


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """How full the calls were: `slots` input positions dispatched (every row of every call),
    `tokens` of them real (a request's tokens; the rest is padding and filler rows)."""

    calls: int = 0
    slots: int = 0
    tokens: int = 0
    shared_contexts: int = 0  # contexts scored once for several continuations
    shared_rows: int = 0  # continuations scored from a shared context

    @property
    def fill(self) -> float:
        """The share of input positions that were real tokens (1.0 before any call)."""
        return self.tokens / self.slots if self.slots else 1.0

    def __add__(self, other: Occupancy) -> Occupancy:
        return Occupancy(*(getattr(self, f.name) + getattr(other, f.name)
                           for f in dataclasses.fields(self)))

    def __sub__(self, other: Occupancy) -> Occupancy:
        """The calls made between two readings (later - earlier)."""
        return Occupancy(*(getattr(self, f.name) - getattr(other, f.name)
                           for f in dataclasses.fields(self)))

    def summary(self) -> str:
        shared = (f", {self.shared_rows} continuations of {self.shared_contexts} shared "
                  f"contexts" if self.shared_contexts else "")
        return f"window fill {self.fill:.0%}{shared}"


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
        self.pack_len = scfg.pack_len(cfg)
        window_keys = scfg.window_keys(cfg)
        self._rows = {}  # length -> rows of its calls, most first (a full call, a tail call)
        for k in window_keys:
            self._rows.setdefault(k.length, []).append(k.rows)
        self._shared = {k.context_len: k for k in scfg.shared_keys(cfg)}
        self.program = ScoringProgram(cfg, params, [*window_keys, *self._shared.values()],
                                      dtype=scfg.dtype, top_n=scfg.top_logprobs,
                                      progress=progress)
        self.occupancy = Occupancy()  # summed over every call so far

    def keys(self) -> list[WindowKey | SharedKey]:
        return self.program.keys()

    @property
    def compile_seconds(self) -> dict[WindowKey | SharedKey, float]:
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
        plans = [self.plan(r, roll=roll) for r in requests]
        ids = [np.asarray(r.token_ids, np.int64) for r in requests]
        groups = self._shared_groups(requests, ids, plans)
        in_group = {i for members in groups.values() for i in members}
        windows = [(i, j, w) for i, plan in enumerate(plans) if i not in in_group
                   for j, w in enumerate(plan)]
        dispatched = []  # every call is issued before any result is read (async dispatch)
        for length, rows in sorted(self._rows_by_length(windows).items()):
            for per_call, batch in _calls(rows, self._rows[length]):
                inputs, places = _window_inputs(ids, batch, per_call, length)
                self.occupancy += Occupancy(1, per_call * length, int(inputs.num_valid.sum()))
                dispatched.append(
                    (places, self.program.score_windows(WindowKey(per_call, length), inputs)))
        for key, contexts in self._shared_calls(groups):
            inputs, places = _shared_inputs(ids, requests, key, contexts)
            self.occupancy += Occupancy(
                1, key.contexts * key.context_len + key.rows * key.length,
                int(inputs.context_len[: len(contexts)].sum() + inputs.num_valid.sum()),
                len(contexts), len(places))
            dispatched.append((places, self.program.score_shared(key, inputs)))
        pieces: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        with bar(progress, sum(len(p) for p in plans), "scoring", "window") as b:
            for places, out in dispatched:
                arrays = [np.asarray(a) for a in (out.logprobs, out.is_greedy, out.top_ids,
                                                  out.top_logprobs)]
                for row, lo, hi, i, j in places:
                    pieces[i, j] = tuple(a[row, lo:hi] for a in arrays)
                b.update(len(places))
        return [TokenScores(*(np.concatenate([pieces[i, j][f] for j in range(len(plan))])
                              for f in range(4)))
                for i, plan in enumerate(plans)]

    def _shared_groups(self, requests: Sequence[ScoreRequest], ids: list[np.ndarray],
                       plans: list[list[Window]]) -> dict[tuple[int, bytes], list[int]]:
        """Requests that share a context, by (context length, its tokens): only groups of two
        or more requests whose pair fits one window from its start, whose continuation fits
        the shared shape of the context's length, and whose context is at least as long as that
        shape's rows (a shorter one costs less to read again than a row costs)."""
        groups: dict[tuple[int, bytes], list[int]] = collections.defaultdict(list)
        if not self._shared:
            return groups
        for i, (r, plan) in enumerate(zip(requests, plans)):
            first = r.first_target
            key = self._shared_key(first)
            if len(plan) == 1 and plan[0].start == 0 and key is not None \
                    and len(ids[i]) - first <= key.length <= first:
                groups[first, ids[i][:first].tobytes()].append(i)
        return {k: v for k, v in groups.items() if len(v) > 1}

    def _shared_key(self, context_len: int) -> SharedKey | None:
        length = next((n for n in self.lengths if n >= context_len), None)
        return self._shared.get(length)

    def _shared_calls(self, groups: dict[tuple[int, bytes], list[int]]
                      ) -> list[tuple[SharedKey, list[list[int]]]]:
        """The shared calls: per key, its contexts (each a list of the requests it serves),
        `contexts` slots and `rows` continuation rows a call; a group larger than the rows left
        continues in another slot."""
        by_key: dict[SharedKey, list[list[int]]] = collections.defaultdict(list)
        for (context_len, _), members in groups.items():
            by_key[self._shared_key(context_len)].append(members)
        calls = []
        for key, contexts in by_key.items():
            slots: list[list[int]] = []
            used = 0
            for members in contexts:
                while members:
                    if len(slots) == key.contexts or used == key.rows:
                        calls.append((key, slots))
                        slots, used = [], 0
                    take = members[: key.rows - used]
                    slots.append(take)
                    used += len(take)
                    members = members[len(take):]
            if slots:
                calls.append((key, slots))
        return calls

    def _rows_by_length(self, windows: list[tuple[int, int, Window]]
                        ) -> dict[int, list[list[tuple[int, int, Window]]]]:
        """Rows per compiled length: a window alone in the shortest length that holds it, or
        packed with others in a `pack_len` row when it fits one."""
        rows: dict[int, list[list[tuple[int, int, Window]]]] = collections.defaultdict(list)
        packable = []
        for item in windows:
            if self.pack_len is not None and item[2].length <= self.pack_len:
                packable.append(item)
            else:
                rows[next(n for n in self.lengths if n >= item[2].length)].append([item])
        if packable:
            rows[self.pack_len].extend(_best_fit(packable, self.pack_len))
        return rows


def _calls(rows: list, sizes: list[int]) -> list[tuple[int, list]]:
    """`rows` split into calls: full calls of sizes[0] rows, then the rest in tail calls of
    sizes[1] rows where that takes fewer rows than one more full call."""
    full, calls = sizes[0], []
    end = len(rows) - len(rows) % full
    calls = [(full, rows[k : k + full]) for k in range(0, end, full)]
    rest = rows[end:]
    if rest:
        tail = sizes[-1]
        if -(-len(rest) // tail) * tail < full:
            calls += [(tail, rest[k : k + tail]) for k in range(0, len(rest), tail)]
        else:
            calls.append((full, rest))
    return calls


def _best_fit(items: list[tuple[int, int, Window]], capacity: int
               ) -> list[list[tuple[int, int, Window]]]:
    """Items packed into rows of `capacity` tokens, longest first, each into the fullest row
    that still holds it (best fit decreasing)."""
    rows: list[list[tuple[int, int, Window]]] = []
    free: dict[int, list[int]] = collections.defaultdict(list)  # room left -> rows with it
    for item in sorted(items, key=lambda x: -x[2].length):
        n = item[2].length
        room = next((r for r in range(n, capacity + 1) if free.get(r)), None)
        if room is None:
            rows.append([])
            row, room = len(rows) - 1, capacity
        else:
            row = free[room].pop()
        rows[row].append(item)
        free[room - n].append(row)
    return rows


def _window_inputs(ids: list[np.ndarray], rows: list[list[tuple[int, int, Window]]],
                   num_rows: int, length: int) -> tuple[WindowInputs, list[tuple]]:
    """Host arrays for one window call: each row's windows end to end from its start, empty
    rows after them; and where each window's scores are, (row, lo, hi, request, window)."""
    token_ids = np.zeros((num_rows, length), np.int32)
    target_ids = np.zeros((num_rows, length), np.int32)
    mask = np.zeros((num_rows, length), bool)
    num_valid = np.zeros(num_rows, np.int32)
    positions = np.zeros((num_rows, length), np.int32)
    segments = np.zeros((num_rows, length), np.int32)
    places = []
    for row, windows in enumerate(rows):
        at = 0
        for segment, (i, j, w) in enumerate(windows):
            n, end = w.length, at + w.length
            token_ids[row, at:end] = ids[i][w.start : w.end]
            target_ids[row, at:end] = ids[i][w.start + 1 : w.end + 1]
            mask[row, end - w.num_targets : end] = True
            positions[row, at:end] = np.arange(n)
            segments[row, at:] = segment
            places.append((row, end - w.num_targets, end, i, j))
            at = end
        num_valid[row] = at
    return WindowInputs(token_ids=token_ids, target_ids=target_ids, target_mask=mask,
                        num_valid=num_valid, positions=positions,
                        segment_ids=segments), places


def _shared_inputs(ids: list[np.ndarray], requests: Sequence[ScoreRequest], key: SharedKey,
                   contexts: list[list[int]]) -> tuple[SharedInputs, list[tuple]]:
    """Host arrays for one shared call (filler contexts of one token, filler rows scoring
    nothing) and where each request's scores are, (row, 0, targets, request, 0)."""
    context_ids = np.zeros((key.contexts, key.context_len), np.int32)
    context_len = np.ones(key.contexts, np.int32)
    token_ids = np.zeros((key.rows, key.length), np.int32)
    target_ids = np.zeros((key.rows, key.length), np.int32)
    mask = np.zeros((key.rows, key.length), bool)
    num_valid = np.zeros(key.rows, np.int32)
    context_of = np.zeros(key.rows, np.int32)
    places, row = [], 0
    for c, members in enumerate(contexts):
        first = requests[members[0]].first_target
        context_ids[c, :first] = ids[members[0]][:first]
        context_len[c] = first
        for i in members:
            cont = ids[i][first:]
            n = len(cont)
            token_ids[row, : n - 1] = cont[:-1]
            target_ids[row, :n] = cont
            mask[row, :n] = True
            num_valid[row] = n - 1
            context_of[row] = c
            places.append((row, 0, n, i, 0))
            row += 1
    return SharedInputs(context_ids=context_ids, context_len=context_len, token_ids=token_ids,
                        target_ids=target_ids, target_mask=mask, num_valid=num_valid,
                        context_of=context_of), places
