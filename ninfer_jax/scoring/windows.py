"""Rolling scoring windows: which tokens each window reads and which it scores (host only).

Owns the window plan of one token sequence `s` (length M) whose targets are `s[first_target:]`.
Window w reads `s[w.start:w.end]` from empty state and scores the last `w.num_targets` of its
positions: input position i predicts `s[w.start + i + 1]`, so the targets are
`s[w.end - w.num_targets + 1 : w.end + 1]`. Target spans of consecutive windows are disjoint and
cover every target exactly once.

This is lm-evaluation-harness's `loglikelihood_rolling` (`get_rolling_token_windows` followed by
`make_disjoint_window`) with `s = [prefix_token] + token_list`, `first_target = 1`,
`max_seq_len = window` and `context_len = window - stride + 1`: the first window scores as many
tokens as fit, every later one scores at most `stride` new tokens and reads up to `window` tokens
of carried context. With `first_target > 1` (a context before the scored continuation) and few
enough targets for one window, it is lm-eval's `loglikelihood` truncation: the window is the last
`window` tokens before the final target.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Window:
    """A window of sequence s: reads s[start:end], scores its last num_targets positions."""

    start: int
    end: int
    num_targets: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def first_target(self) -> int:
        """Index in s of the first token this window scores."""
        return self.end - self.num_targets + 1


def check_window_stride(window: int, stride: int) -> None:
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in 1..window={window}, got {stride}")


def rolling_windows(num_tokens: int, first_target: int, window: int,
                    stride: int | None = None) -> list[Window]:
    """The windows that score s[first_target:num_tokens]; [] when there is nothing to score.

    num_tokens: M = len(s); first_target: index of the first scored token (>= 1: the first
    token of a sequence has nothing to condition on); window: most tokens one window reads;
    stride: most new tokens a window after the first scores (default: window).
    """
    stride = window if stride is None else stride
    check_window_stride(window, stride)
    if first_target < 1:
        raise ValueError(f"first_target must be >= 1, got {first_target}")
    num_targets = num_tokens - first_target
    if num_targets <= 0:
        return []
    first = min(num_targets, window)
    end = first_target - 1 + first
    windows = [Window(max(0, end - window), end, first)]
    done = first
    while done < num_targets:
        count = min(num_targets - done, stride)
        end += count
        windows.append(Window(max(0, end - window), end, count))
        done += count
    return windows
