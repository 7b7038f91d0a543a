"""lm-evaluation-harness's rolling windows as token spans, and the committed fixture made from them.

    python -m tests.scoring.lm_eval_windows   # rewrites fixtures/lm_eval_windows.json (needs lm-eval)

With s = [prefix] + token_list and token_list[i] = i + 1, every token is its own index in s, so
each of lm-eval's (context, prediction) lists is a run of indices, stored as [first, last + 1].
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "lm_eval_windows.json"


def _run(ids: list[int]) -> list[int]:
    if ids and ids != list(range(ids[0], ids[0] + len(ids))):
        raise AssertionError(f"not a run of indices: {ids}")
    return [ids[0], ids[0] + len(ids)] if ids else [0, 0]


def lm_eval_spans(num_tokens: int, window: int, stride: int) -> list[list[list[int]]]:
    """lm-eval's disjoint windows over a sequence of num_tokens tokens after the prefix token:
    [[context run, prediction run], ...], context_len = window - stride + 1."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    pairs = get_rolling_token_windows(token_list=list(range(1, num_tokens + 1)), prefix_token=0,
                                      max_seq_len=window, context_len=window - stride + 1)
    return [[_run(a), _run(b)] for a, b in map(make_disjoint_window, pairs)]


def cases(seed: int = 0, count: int = 200) -> list[tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        window = int(rng.integers(1, 65))
        out.append((int(rng.integers(0, 4 * window + 3)), window, int(rng.integers(1, window + 1))))
    return out


def main() -> None:
    data = [{"num_tokens": n, "window": w, "stride": s, "spans": lm_eval_spans(n, w, s)}
            for n, w, s in cases()]
    FIXTURE.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {len(data)} cases to {FIXTURE}")


if __name__ == "__main__":
    main()
