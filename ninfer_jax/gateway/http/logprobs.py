"""Log-probs in the two OpenAI shapes, and the prompt's log-probs for `echo`.

Owns rendering `TokenLogprob`s (computed on the device: the sampled token's log-prob and the
top-N after the request's penalties and temperature) as chat's `logprobs.content` entries
(`token`, `logprob`, `bytes`, `top_logprobs`) and as completions' parallel lists (`tokens`,
`token_logprobs`, `top_logprobs` dicts, `text_offset`), and scoring a prompt for `echo` through
the CausalScoring purpose (its own compiled windows, opened on first use): a prompt token's
log-prob given the tokens before it, with the top-N there; the first token has none (null), as
OpenAI's API returns. No vocabulary row reaches the host, only the top-N.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ninfer_jax.engine import TokenLogprob
from ninfer_jax.sampling_params import MAX_LOGPROBS


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_content(tokenizer: Any, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `choices[].logprobs.content`: one entry per generated token."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    return [{**entry(t.token_id, t.logprob),
             "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in logprobs]


class CompletionLogprobs:
    """Completions' `choices[].logprobs`, built incrementally (streamed chunks carry their own
    part, `text_offset` continuing from the previous one)."""

    def __init__(self, tokenizer: Any, offset: int = 0):
        self.tokenizer, self.offset = tokenizer, offset

    def part(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
             tops: Sequence[Sequence[tuple[int, float]] | None]) -> dict[str, Any]:
        tokens = [token_text(self.tokenizer, t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [None if top is None else
                                 {token_text(self.tokenizer, i): lp for i, lp in top}
                                 for top in tops],
                "text_offset": offsets}

    def generated(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self.part([t.token_id for t in logprobs], [t.logprob for t in logprobs],
                         [t.top for t in logprobs])


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


class PromptScorer:
    """Scores prompts for `echo` with the CausalScoring purpose of the served model (opened on
    first use from `model_path`, or given). Thread-safe; calls run one at a time."""

    def __init__(self, model_path: Any = None, scorer: Any = None, max_len: int = 2048):
        self._path, self._scorer, self._max_len = model_path, scorer, max_len
        self._lock = threading.Lock()

    def _open(self) -> Any:
        if self._scorer is None:
            from ninfer_jax.scoring import Scorer
            # one prompt a call, scored from its first token: no context to share
            self._scorer = Scorer.open(self._path, max_len=self._max_len,
                                       top_logprobs=MAX_LOGPROBS, share_contexts=False)
        return self._scorer

    def score(self, token_ids: Sequence[int], n: int) -> tuple[list[float | None], list]:
        """(log-prob of each prompt token, its top-n alternatives), None for the first."""
        from ninfer_jax.scoring import ScoreRequest
        if len(token_ids) < 2:
            return [None] * len(token_ids), [None] * len(token_ids)
        with self._lock:
            scores = self._open().core.score([ScoreRequest(np.asarray(token_ids, np.int64), 1)],
                                             roll=True)[0]
        tops = [tuple(zip(ids[:n].tolist(), lps[:n].astype(float).tolist()))
                for ids, lps in zip(scores.top_ids, scores.top_logprobs)]
        return [None, *scores.logprobs.astype(float).tolist()], [None, *tops]
