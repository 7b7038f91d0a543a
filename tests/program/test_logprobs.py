"""Log-probs from the device sampler against an independent reference: each step's sampled
log-prob and top-N alternatives equal log_softmax of the transformed logits (presence and
frequency penalties, temperature) computed here from a full forward pass in numpy; greedy and
sampled rows share a batch with a row that asked for none, which gets none."""

from __future__ import annotations

import numpy as np

from ninfer_jax.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.program.conftest import _padded_forward, program

PROMPTS = [[5, 9, 14, 3, 8], [7, 7, 2, 11], [1, 4, 4, 4, 6, 2]]
SETTINGS = [SamplingParams(temperature=0.0, logprobs=5),
            SamplingParams(temperature=0.7, seed=3, presence_penalty=0.8,
                           frequency_penalty=0.3, logprobs=MAX_LOGPROBS),
            SamplingParams(temperature=0.0)]
STEPS = 4


def _reference(prompt: list[int], out: list[int], p: SamplingParams) -> np.ndarray:
    """log_softmax over the vocabulary of the transformed next-token logits after prompt+out."""
    ids = np.zeros((1, 64), np.int32)
    seq = prompt + out
    ids[0, : len(seq)] = seq
    logits = np.asarray(_padded_forward("dense")(ids))[0, len(seq) - 1].astype(np.float64)
    counts = np.bincount(np.asarray(out, np.int64), minlength=logits.size)
    logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    scaled = logits / (p.temperature if p.temperature > 0 else 1.0)
    return scaled - np.logaddexp.reduce(scaled)


def test_top_logprobs_equal_log_softmax_of_transformed_logits():
    prog = program()
    handles = []
    for prompt, p in zip(PROMPTS, SETTINGS):
        plan = prog.plan_admission(len(prompt), STEPS + 1)
        handles.append(prog.materialize(plan, prompt, p))
    outs: list[list[int]] = [[] for _ in PROMPTS]
    seen: list[list] = [[] for _ in PROMPTS]
    for row, h in enumerate(handles):
        while (batch := prog.prefill(h)) is None:
            pass
        seen[row] += batch.row_logprobs(0)
        outs[row].append(batch.row_tokens(0)[0])
        prog.commit(batch, [1])
    for _ in range(STEPS):
        batch = prog.decode(handles)
        for row in range(len(handles)):
            outs[row] += batch.row_tokens(row)
            seen[row] += batch.row_logprobs(row)
        prog.commit(batch, [1] * len(handles))
    for h in handles:
        prog.release(h)
    assert len(seen[0]) == len(seen[1]) == STEPS + 1
    assert len(seen[2]) == STEPS  # its own prefill asked for none; shared rounds carry them
    for row in (0, 1):
        p = SETTINGS[row]
        for step, (lp, top) in enumerate(seen[row]):
            ref = _reference(PROMPTS[row], outs[row][:step], p)
            token = outs[row][step]
            np.testing.assert_allclose(lp, ref[token], atol=2e-4)
            ids, lps = zip(*top)
            assert len(ids) == MAX_LOGPROBS
            np.testing.assert_allclose(lps, np.sort(ref)[::-1][:MAX_LOGPROBS], atol=2e-4)
            np.testing.assert_allclose(ref[list(ids)], lps, atol=2e-4)  # the ids carry them
            if p.temperature == 0:
                assert ids[0] == token  # greedy: the sampled token is the most likely


def test_a_batch_without_logprob_rows_returns_none():
    prog = program()
    h = prog.materialize(prog.plan_admission(3, 3), [4, 5, 6], SamplingParams(temperature=0.0))
    while (batch := prog.prefill(h)) is None:
        pass
    assert batch.row_logprobs(0) == []
    prog.commit(batch, [1])
    batch = prog.decode([h])
    assert batch.row_logprobs(0) == []
    prog.commit(batch, [1])
    prog.release(h)
