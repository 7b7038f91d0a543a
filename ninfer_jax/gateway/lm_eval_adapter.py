"""lm-evaluation-harness model `ninfer`: loglikelihood, loglikelihood_rolling, generate_until.

    python -m ninfer_jax.gateway.lm_eval_adapter run --model ninfer \\
        --model_args model=DIR,max_len=2048 --tasks ...      # lm_eval's own CLI, `ninfer` added

or, in Python, `import ninfer_jax.gateway.lm_eval_adapter` before `lm_eval.simple_evaluate(
model="ninfer", model_args=...)` (lm-eval finds models only in its registry, which this import
fills). Needs the `eval` extra; lm-eval is imported only here.

Owns translating lm-eval requests into the CausalScoring purpose (`Scorer`) and, for
`generate_until`, the Generation purpose (`Engine`, opened on first use): the two purposes are
separate start-ups of the same model package. `local_choice_task` writes a local
multiple-choice task (the tests' and the scoring benchmark's). Tokenization and the context/continuation split are
lm-eval's own (`TemplateLM`); windows follow `scoring/windows.py` (lm-eval's rolling windows with
`context_len = window - stride + 1`); the choices of one question share their context's
scoring (`ScoringConfig.share_contexts`). Model arguments: model, window, stride, max_len,
max_batch_tokens, dtype, pack, share_contexts, prefix_token_id, max_gen_toks, max_concurrency,
max_seq_len.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ninfer_jax.scoring import Scorer, ScoreRequest

# lm-eval's CLI passes these to every model; scoring batches by tokens instead.
_IGNORED = ("batch_size", "max_batch_size", "device")


@register_model("ninfer")
class NinferLM(TemplateLM):
    def __init__(self, model: str | None = None, window: int | None = None,
                 stride: int | None = None, max_len: int | None = None,
                 max_batch_tokens: int = 4096, dtype: str = "float32",
                 prefix_token_id: int | None = None, max_gen_toks: int = 256,
                 max_concurrency: int = 4, max_seq_len: int = 2048, pack: bool = True,
                 share_contexts: bool = True, **ignored: Any):
        super().__init__()
        unknown = sorted(set(ignored) - set(_IGNORED))
        if unknown:
            raise TypeError(f"unknown ninfer model argument(s) {unknown}")
        self.scorer = Scorer.open(model, window=window, stride=stride, max_len=max_len,
                                  max_batch_tokens=max_batch_tokens, dtype=dtype, pack=pack,
                                  share_contexts=share_contexts)
        if self.scorer.tokenizer is None:
            raise ValueError(f"{self.scorer.model_path} has no tokenizer; lm-eval needs text")
        self.tokenizer_ = self.scorer.tokenizer
        self._prefix = prefix_token_id
        self._engine_args = dict(model=self.scorer.model_path, max_concurrency=max_concurrency,
                                 max_seq_len=max_seq_len, dtype=dtype)
        self.max_gen_toks = max_gen_toks
        self._engine = None

    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer_
        named = tok.special_id("<|endoftext|>")
        return named if named is not None else min(tok.eos_ids, default=0)

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id if self._prefix is None else self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return self.tokenizer_.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tokenizer_.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """requests: [((context, continuation), context_ids, continuation_ids)]; a continuation
        longer than one window is scored in rolling windows rather than refused."""
        scored = [ScoreRequest(np.asarray(ctx + cont, np.int64), len(ctx))
                  for _, ctx, cont in requests]
        answers = []
        for (pair, _, _), r in zip(requests, self.scorer.score_requests(scored, roll=True)):
            answer = (r.sum_logprob, r.is_greedy)
            self.cache_hook.add_partial("loglikelihood", pair, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood after the prefix token, in disjoint rolling windows."""
        scored = [ScoreRequest(np.asarray([self.prefix_token_id] + self.tok_encode(s), np.int64), 1)
                  for (s,) in (req.args for req in requests)]
        answers = []
        for req, r in zip(requests, self.scorer.score_requests(scored, roll=True)):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, r.sum_logprob)
            answers.append(r.sum_logprob)
        return answers

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task asks) continuations through the Generation Engine,
        cut at the first `until` string."""
        from ninfer_jax.api import Engine
        from ninfer_jax.sampling_params import SamplingParams

        if self._engine is None:
            self._engine = Engine.open(**self._engine_args)
        handles = []
        for context, gen_kwargs in (req.args for req in requests):
            kw = dict(gen_kwargs)
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sampling = SamplingParams(
                max_new_tokens=int(kw.get("max_gen_toks", self.max_gen_toks)),
                temperature=float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0,
                stop=tuple(s for s in until if s), skip_special_tokens=False)
            handles.append(self._engine.submit(context, sampling=sampling))
        answers = []
        for req, handle in zip(requests, handles):
            text = handle.result().text
            self.cache_hook.add_partial("generate_until", req.args, text)
            answers.append(text)
        return answers


def local_choice_task(directory: str | os.PathLike, name: str, docs: list[dict]):
    """Writes a local multiple-choice task `name` over `docs` ({"q": question, "choices": [...],
    "gold": index}, accuracy as its metric) into `directory`; returns the lm-eval TaskManager
    that finds it (pass it to `simple_evaluate(task_manager=...)`)."""
    import json

    from lm_eval.tasks import TaskManager

    directory = pathlib.Path(directory)
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / f"{name}.yaml").write_text(f"""
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / f'{name}.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
""")
    return TaskManager(include_path=str(directory))


def main() -> None:
    """lm_eval's command line with the `ninfer` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
