"""`Scorer`: the notebook API of the CausalScoring purpose.

    scorer = ninfer_jax.Scorer.open(model=None, window=512)   # None = the embedded demo model
    [r] = scorer.score(texts=["Once upon a time"])
    r.token_logprobs, r.sum_logprob, r.num_tokens, r.is_greedy
    scorer.perplexity(open("wiki.test.raw").read())

Owns turning texts (or token ids) and optional contexts into scoring requests, and per-token
scores into results. Without a context every token after the first is scored; with one, every
continuation token. Text pairs are split into tokens as lm-evaluation-harness does (trailing
whitespace of the context moves to the continuation; the continuation's tokens are those of
`context + continuation` after the context's tokens). Execution belongs to `CausalScoreCore`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ninfer_jax import display
from ninfer_jax.errors import ConfigError
from ninfer_jax.frontend.tokenizer import Tokenizer
from ninfer_jax.scoring.core import (
    CausalScoreCore,
    ScoreInputError,
    ScoreRequest,
    ScoringConfig,
    TokenScores,
)

Context = str | Sequence[int] | None


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """The scores of one item's scored tokens."""

    token_ids: np.ndarray  # [K] int32, the scored tokens
    token_logprobs: np.ndarray  # [K] float32, log p(token | everything before it in its window)
    greedy_flags: np.ndarray  # [K] bool, the token is the argmax of its prediction
    # The tokenizer's decode, for showing each token's text (notebook display only).
    decode: Callable[[Sequence[int]], str] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def _repr_html_(self) -> str:
        return display.score_html(self)

    _repr_pretty_ = display.pretty(display.score_line)

    @property
    def token_texts(self) -> list[str]:
        """Each scored token's own text (its ids in brackets without a tokenizer)."""
        return display.token_pieces(self.decode, self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sum_logprob(self) -> float:
        return float(np.sum(self.token_logprobs, dtype=np.float64))

    @property
    def is_greedy(self) -> bool:
        """Every scored token is the argmax (lm-evaluation-harness's `is_greedy`)."""
        return bool(self.greedy_flags.all())

    @property
    def perplexity(self) -> float:
        return math.exp(-self.sum_logprob / self.num_tokens)


def split_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """(token ids of the pair, index of the first continuation token), lm-eval's `_encode_pair`."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    return whole, len(tokenizer.encode(context))


class Scorer:
    """Scores texts or token ids with one model package (see the module docstring)."""

    def __init__(self, core: CausalScoreCore, tokenizer: Tokenizer | None,
                 model_path: pathlib.Path | None = None):
        self.core, self.tokenizer, self.model_path = core, tokenizer, model_path

    @classmethod
    def open(cls, model: str | pathlib.Path | None = None, *, verify_weights: bool = True,
             progress: bool | None = None, quantize: str | None = None,
             **config: Any) -> Scorer:
        """Loads `model` (artifact or HF checkpoint directory; None = the embedded demo model)
        and compiles its scoring windows. Settings: window, stride, max_len, min_len,
        max_batch_tokens, dtype, top_logprobs, pack, share_contexts, max_continuation (see
        `ScoringConfig`); verify_weights (see `load_model`'s
        `verify`); progress (a bar over the compiles; None: in a notebook only); quantize
        (see `Engine.open`). Texts need
        the model's tokenizer; a directory without one scores token ids only."""
        from ninfer_jax.compile_cache import ensure_persistent_cache
        from ninfer_jax.frontend import load_tokenizer
        from ninfer_jax.loader import host_placement, load_model
        from ninfer_jax.program.config import resolve_layer_loop

        known = {f.name for f in dataclasses.fields(ScoringConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ConfigError(f"unknown Scorer setting(s) {unknown}; known: {sorted(known)}")
        scfg = ScoringConfig(**config)
        ensure_persistent_cache()  # see Engine.open
        # Kept on the host for an unrolled layer loop (see Engine.open): the ScoringProgram
        # sends each layer's weights to the device as their own arrays.
        unrolled = resolve_layer_loop("auto") == "unrolled"
        loaded = load_model(model, dtype=scfg.dtype, verify=verify_weights, quantize=quantize,
                            placement=host_placement if unrolled else None)
        try:
            tokenizer = load_tokenizer(loaded.path)
        except FileNotFoundError:
            tokenizer = None
        return cls(CausalScoreCore(loaded.config, loaded.params, scfg, progress=progress),
                   tokenizer, loaded.path)

    def request(self, text: str | None = None, token_ids: Sequence[int] | None = None,
                context: Context = None) -> ScoreRequest:
        """One item as a checked ScoreRequest; raises ScoreInputError naming what is wrong."""
        if (text is None) == (token_ids is None):
            raise ScoreInputError("give exactly one of text or token_ids")
        if text is not None:
            if not isinstance(text, str):
                raise ScoreInputError(f"text must be a string, got {type(text).__name__}")
            if context is not None and not isinstance(context, str):
                raise ScoreInputError(f"a text's context must be a string, got "
                                      f"{type(context).__name__}")
            try:
                if context:
                    ids, first = split_pair(self._tokenizer(), context, text)
                else:
                    ids, first = self._tokenizer().encode(text), 1
            except (UnicodeError, ValueError) as e:  # e.g. a lone surrogate
                raise ScoreInputError(f"text cannot be tokenized: {e}") from None
        else:
            ids = _id_list(token_ids, "token_ids")
            ctx = [] if context is None else _id_list(context, "context")
            ids, first = ctx + ids, max(1, len(ctx))
        request = ScoreRequest(np.asarray(ids, np.int64).reshape(-1), first)
        self.core.plan(request)
        return request

    def score_requests(self, requests: Sequence[ScoreRequest], *, roll: bool = False,
                       progress: bool | None = None) -> list[ScoreResult]:
        """Scores checked requests; roll=True rolls long items even without a configured window.
        progress: a bar over the windows (None: in a notebook only)."""
        decode = None if self.tokenizer is None else self.tokenizer.decode
        scores = self.core.score(requests, roll=roll, progress=progress)
        return [_result(r, s, decode) for r, s in zip(requests, scores)]

    def score(self, texts: Sequence[str] | None = None,
              token_ids: Sequence[Sequence[int]] | None = None,
              contexts: Sequence[Context] | None = None, *,
              progress: bool | None = None) -> list[ScoreResult]:
        """One ScoreResult per item, in order. Give texts or token_ids; contexts (optional) are
        strings for texts and token id lists for token_ids, one per item (empty = none).
        progress: a bar over the scoring windows (None: in a notebook only)."""
        if (texts is None) == (token_ids is None):
            raise ValueError("give exactly one of texts or token_ids")
        if isinstance(texts, str):
            raise ValueError("texts must be a list of strings (wrap a single text in a list)")
        items = list(texts if texts is not None else token_ids)
        contexts = [None] * len(items) if contexts is None else list(contexts)
        if len(contexts) != len(items):
            raise ValueError(f"{len(contexts)} contexts for {len(items)} items")
        kind = "text" if texts is not None else "token_ids"
        requests = []
        for i, (item, ctx) in enumerate(zip(items, contexts)):
            try:
                requests.append(self.request(**{kind: item}, context=ctx))
            except ScoreInputError as e:
                raise ScoreInputError(f"item {i}: {e}") from None
        return self.score_requests(requests, progress=progress)

    def rolling(self, texts: Sequence[str], *, progress: bool | None = None
                ) -> list[ScoreResult]:
        """Each text's tokens after its first, in rolling windows even with no configured window
        (then windows of the longest compiled length)."""
        requests = [ScoreRequest(np.asarray(self._tokenizer().encode(t), np.int64), 1)
                    for t in texts]
        return self.score_requests(requests, roll=True, progress=progress)

    def perplexity(self, text: str | Sequence[str], *, progress: bool | None = None) -> float:
        """exp(-mean log-prob) over a text's tokens after its first (over all texts' tokens, for
        a list), scored with `rolling`."""
        results = self.rolling([text] if isinstance(text, str) else text, progress=progress)
        total = sum(r.sum_logprob for r in results)
        return math.exp(-total / sum(r.num_tokens for r in results))

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ScoreInputError(f"{self.model_path} has no tokenizer; score token_ids")
        return self.tokenizer


def _id_list(value: Any, name: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ScoreInputError(f"{name} must be a list of token ids, got {type(value).__name__}")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value):
        raise ScoreInputError(f"{name} must hold integers")
    return [int(t) for t in value]


def _result(request: ScoreRequest, scores: TokenScores, decode: Callable | None) -> ScoreResult:
    return ScoreResult(token_ids=request.token_ids[request.first_target:].astype(np.int32),
                       token_logprobs=scores.logprobs, greedy_flags=scores.is_greedy,
                       decode=decode)
