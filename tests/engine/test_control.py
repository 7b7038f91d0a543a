"""Forced control (DESIGN §3 ControlReady) through the EngineCore over the FakeProgram: the
thinking budget. The fake model never writes `</think>`, so a thinking block it starts stays
open until the Frontend forces its end."""

from __future__ import annotations

import dataclasses

import pytest

from ninfer_jax.engine import Channel, Delta, FinishReason
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError
from tests.engine.conftest import FRONTEND, GREEDY, TOKENIZER, fake_engine, prompt, settle

THINK, END = TOKENIZER.think_ids
SUFFIX = (*TOKENIZER.encode("\n"), END, *TOKENIZER.encode("\n\n"))


def _thinking_prompt(text: str = "q"):
    """A prompt that leaves a thinking block open (as Qwen's template does with thinking on)."""
    return prompt(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n")


def _split(token_ids):
    """(thinking tokens, the forced suffix, content tokens) of an output."""
    ids = list(token_ids)
    at = next(i for i in range(len(ids)) if tuple(ids[i:i + len(SUFFIX)]) == SUFFIX)
    return ids[:at], ids[at:at + len(SUFFIX)], ids[at + len(SUFFIX):]


@pytest.mark.parametrize("verify_width", [1, 4])
@pytest.mark.parametrize("budget", [1, 3, 7])
def test_the_thinking_channel_holds_at_most_the_budget_and_content_follows(budget,
                                                                            verify_width):
    sampling = dataclasses.replace(GREEDY, max_new_tokens=30, max_thinking_tokens=budget)
    with fake_engine(2, verify_width=verify_width) as (core, _):
        result = core.submit(_thinking_prompt(), sampling).result(timeout=30)
        thinking, forced, content = _split(result.token_ids)
        assert len(thinking) == budget and forced == list(SUFFIX)
        # the suffix's first newline closes the block's text, as the model writes it
        assert result.reasoning_text == TOKENIZER.decode(thinking + forced[:forced.index(END)])
        # the newlines after </think> separate the block, as the model's own (not content)
        assert result.text == TOKENIZER.decode(forced[forced.index(END) + 1:]
                                               + content).lstrip("\n")
        assert result.usage.completion_tokens == len(result.token_ids)
        assert content  # the answer went on in the content channel
        s = settle(core)
        assert s.free_pages == s.total_pages and s.free_slots == s.total_slots


def test_after_the_forced_suffix_the_output_is_what_a_prompt_holding_it_gives():
    """The fake model's next token is a function of every token before it and its position,
    so the forced tokens are in the state exactly as prompt tokens would be."""
    sampling = dataclasses.replace(GREEDY, max_new_tokens=24, max_thinking_tokens=4)
    with fake_engine(2) as (core, _):
        base = _thinking_prompt("same")
        result = core.submit(base, sampling).result(timeout=30)
        thinking, forced, content = _split(result.token_ids)
        held = FRONTEND.prepare(prompt_token_ids=[*base.token_ids, *thinking, *forced])
        rest = dataclasses.replace(GREEDY, max_new_tokens=24 - len(thinking) - len(forced))
        assert list(core.submit(held, rest).result(timeout=30).token_ids) == content


def test_thinking_closed_by_the_model_needs_no_control_and_no_budget_changes_nothing():
    with fake_engine(2) as (core, _):
        plain = core.submit(prompt("no thinking here"), dataclasses.replace(
            GREEDY, max_thinking_tokens=2)).result(timeout=30)
        assert list(plain.token_ids) == list(core.submit(prompt("no thinking here"),
                                                         GREEDY).result(timeout=30).token_ids)
        assert plain.reasoning_text == ""


def test_a_budget_too_small_for_the_suffix_ends_with_length_inside_the_budget():
    sampling = dataclasses.replace(GREEDY, max_new_tokens=5, max_thinking_tokens=3)
    with fake_engine(1) as (core, _):
        result = core.submit(_thinking_prompt(), sampling).result(timeout=30)
        assert result.finish_reason is FinishReason.LENGTH
        assert len(result.token_ids) == 3
        assert END not in result.token_ids and result.text == ""
        settle(core)


def test_cancel_while_the_control_step_is_pending_commits_nothing_and_frees_everything():
    sampling = dataclasses.replace(GREEDY, max_new_tokens=30, max_thinking_tokens=2)
    with fake_engine(2) as (core, program):
        gate = program.pause("after_control")
        handle = core.submit(_thinking_prompt(), sampling)
        gate.wait()
        handle.cancel()
        gate.release()
        result = handle.result(timeout=30)
        assert result.finish_reason is FinishReason.CANCELLED
        assert END not in result.token_ids and len(result.token_ids) == 2
        s = settle(core)
        assert s.free_pages == s.total_pages and s.free_slots == s.total_slots
        assert program.pending is None and not program.handles()


def test_cancel_while_control_ready_never_runs_the_control_step():
    sampling = dataclasses.replace(GREEDY, max_new_tokens=30, max_thinking_tokens=2)
    with fake_engine(2) as (core, program):
        controls = []
        program.on("after_control", lambda seqs: controls.append(seqs))
        gate = program.pause("after_commit", lambda seqs: len(seqs[0].tokens) - seqs[0].prompt_len
                             == 2)
        handle = core.submit(_thinking_prompt(), sampling)
        gate.wait()  # the round that spent the budget is committed: ControlReady is next
        handle.cancel()
        gate.release()
        assert handle.result(timeout=30).finish_reason is FinishReason.CANCELLED
        settle(core)
        assert controls == []


def test_streamed_deltas_switch_channel_at_the_forced_end():
    sampling = dataclasses.replace(GREEDY, max_new_tokens=20, max_thinking_tokens=3)
    with fake_engine(1) as (core, _):
        events = list(core.submit(_thinking_prompt(), sampling))
        channels = [e.channel for e in events if isinstance(e, Delta) and e.text]
        assert channels[0] is Channel.THINKING and channels[-1] is Channel.CONTENT
        assert channels == sorted(channels, key=lambda c: c is Channel.CONTENT)


def test_max_thinking_tokens_is_validated():
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(SamplingParamsError, match="max_thinking_tokens"):
            SamplingParams(max_thinking_tokens=bad)
    assert SamplingParams(max_thinking_tokens=None).max_thinking_tokens is None
