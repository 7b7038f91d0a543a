"""OutputSession: preview/commit, UTF-8 holding, stop strings across tokens, thinking channel.

The property tests tokenize mixed Chinese / emoji / ASCII text with the Qwen3.5 BPE, whose
tokens often end inside a multibyte character, and feed the ids in random batches.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.frontend import Channel, FinishReason, Frontend, OutputSession, Tokenizer

PIECES = [
    "你好",
    "世界",
    "。",
    "模型",
    "🎉",
    "👩‍💻",
    "🇯🇵",
    " hello",
    " world",
    "\n",
    "ü",
    " ",
    "END",
    "E",
]
text_strategy = st.lists(st.sampled_from(PIECES), min_size=1, max_size=16).map("".join)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _batches(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in itertools.pairwise(bounds)]


def _run(
    session: OutputSession, batches: list[list[int]], check_previews: bool = False
) -> list[str]:
    """Commits every batch (the last with budget_ends) until the output finishes."""
    deltas = []
    for n, batch in enumerate(batches):
        if check_previews:
            session.preview(batch[::-1], budget_ends=True)  # never committed
        preview = session.preview(batch, budget_ends=n == len(batches) - 1)
        session.commit(preview)
        deltas.extend(d.text for d in preview.deltas)
        if preview.finish_reason is not None:
            break
    return deltas


def _expected_stop_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Text before the stop string that ends first (longest among those ending together)."""
    found = [(text.find(s) + len(s), -text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    _, negative_start, stop = min(found)
    return text[:-negative_start], stop


@PROPERTY
@given(text=text_strategy, cuts=st.lists(st.integers(0, 64), max_size=8))
def test_deltas_concatenate_to_decoded_text(qwen: Tokenizer, text, cuts):
    ids = qwen.encode(text)
    session = OutputSession(qwen)
    deltas = _run(session, _batches(ids, cuts), check_previews=True)
    assert "".join(deltas) == qwen.decode(ids) == text
    assert all(d and "\ufffd" not in d for d in deltas)  # never half a character
    assert session.text == text and session.token_ids == tuple(ids)
    assert session.finish_reason is FinishReason.LENGTH


@PROPERTY
@given(
    ids=st.lists(st.integers(0, 248_043), min_size=1, max_size=24),
    cuts=st.lists(st.integers(0, 32)),
)
def test_any_ids_decode_like_one_shot_decode(qwen: Tokenizer, ids, cuts):
    session = OutputSession(qwen)
    assert "".join(_run(session, _batches(ids, cuts))) == qwen.decode(ids)


@PROPERTY
@given(
    text=text_strategy,
    stops=st.lists(
        st.sampled_from(["END", "世界", "🎉", "o w", "\n\n", "EE", "好世"]), min_size=1, max_size=3
    ),
    cuts=st.lists(st.integers(0, 64), max_size=8),
)
def test_stop_strings_cut_the_output_and_never_appear(qwen: Tokenizer, text, stops, cuts):
    ids = qwen.encode(text)
    session = OutputSession(qwen, stop=stops)
    out = "".join(_run(session, _batches(ids, cuts)))
    expected, stop = _expected_stop_cut(text, stops)
    assert out == expected
    assert not any(s in out for s in stops)
    if stop is None:
        assert session.finish_reason is FinishReason.LENGTH
        assert session.token_ids == tuple(ids)
    else:
        assert session.finish_reason is FinishReason.STOP
        # The accepted prefix ends with the token that completed the stop string.
        accepted = session.token_ids
        assert accepted == tuple(ids[: len(accepted)])
        assert stop in qwen.decode(list(accepted))
        assert stop not in qwen.decode(list(accepted[:-1]))


@PROPERTY
@given(
    thinking=text_strategy,
    answer=text_strategy,
    opened_by_prompt=st.booleans(),
    cuts=st.lists(st.integers(0, 64), max_size=8),
)
def test_thinking_channel_split(qwen: Tokenizer, thinking, answer, opened_by_prompt, cuts):
    start, end = qwen.think_ids
    ids = qwen.encode(thinking) + [end] + qwen.encode(answer)
    if not opened_by_prompt:
        ids = [start, *ids]
    channel = Channel.THINKING if opened_by_prompt else Channel.CONTENT
    session = OutputSession(qwen, channel=channel)
    _run(session, _batches(ids, cuts))
    assert session.reasoning_text == thinking
    assert session.text == answer.lstrip("\n")  # the newlines after </think> separate, only
    assert session.channel is Channel.CONTENT


@PROPERTY
@given(
    text=text_strategy, batches=st.lists(st.lists(st.integers(0, 248_076), max_size=6), max_size=6)
)
def test_uncommitted_previews_change_nothing(qwen: Tokenizer, text, batches):
    session = OutputSession(qwen, stop=["END"])
    session.commit(session.preview(qwen.encode(text)[:3]))
    if session.finish_reason is not None:
        return
    before = (session._state, session.text, session.reasoning_text, session.token_ids)
    previews = [session.preview(b, budget_ends=True) for b in batches]
    assert (session._state, session.text, session.reasoning_text, session.token_ids) == before
    committed = session.preview([9419])
    session.commit(committed)
    for preview in previews:
        with pytest.raises(ValueError, match="stale preview"):
            session.commit(preview)


def test_emoji_split_across_tokens_is_held_until_complete(qwen):
    ids = qwen.encode(" 🎉")
    assert len(ids) == 3
    session = OutputSession(qwen)
    texts = []
    for token_id in ids:
        preview = session.preview([token_id])
        session.commit(preview)
        texts.append("".join(d.text for d in preview.deltas))
    assert texts == [" ", "", "🎉"]


def test_stop_string_across_tokens_is_held_then_dropped(qwen):
    session = OutputSession(qwen, stop=["<END>"])
    ids = qwen.encode("answer <EN")
    preview = session.preview(ids)
    assert preview.deltas[0].text == "answer " and preview.finish_reason is None
    session.commit(preview)
    rest = qwen.encode("D> more")
    preview = session.preview(rest)
    assert preview.deltas == () and preview.stop_string == "<END>"
    assert preview.finish_reason is FinishReason.STOP and preview.num_accepted < len(rest)
    session.commit(preview)
    assert session.text == "answer "


def test_held_text_is_released_when_it_stops_matching(qwen):
    session = OutputSession(qwen, stop=["<END>"])
    session.commit(session.preview(qwen.encode("a <EN")))
    preview = session.preview(qwen.encode("Dless"))
    assert "".join(d.text for d in preview.deltas) == "<ENDless"


def test_eos_ends_with_stop_and_is_accepted_but_not_shown(qwen):
    im_end = qwen.special_id("<|im_end|>")
    session = OutputSession(qwen, stop=["zzz"])
    ids = qwen.encode("done zz") + [im_end] + qwen.encode(" after")
    preview = session.preview(ids)
    assert preview.finish_reason is FinishReason.STOP and preview.eos_id == im_end
    assert preview.token_ids == tuple(ids[: ids.index(im_end) + 1])
    assert "".join(d.text for d in preview.deltas) == "done zz"  # held prefix released at EOS
    session.commit(preview)
    with pytest.raises(ValueError, match="already finished"):
        session.preview([1])


def test_stop_token_ids_and_length(qwen):
    session = OutputSession(qwen, stop_token_ids=[13])
    preview = session.preview(qwen.encode("a. b"))
    assert preview.eos_id == 13 and preview.num_accepted == 2
    session = OutputSession(qwen)
    session.commit(session.preview(qwen.encode("🎉")[:1]))
    final = session.preview([], budget_ends=True)
    assert final.finish_reason is FinishReason.LENGTH
    assert final.deltas[0].text == "\ufffd"  # a character cut by the budget is replaced, not split
    with pytest.raises(ValueError, match="stop\\[1\\]"):
        OutputSession(qwen, stop=["a", ""])


def test_frontend_session_starts_in_the_channel_the_prompt_leaves_open(qwen_dir):
    frontend = Frontend.load(qwen_dir)
    messages = [{"role": "user", "content": "hi"}]
    thinking = frontend.prepare(messages=messages, enable_thinking=True)
    plain = frontend.prepare(messages=messages, enable_thinking=False)
    assert frontend.open_session(thinking).channel is Channel.THINKING
    assert frontend.open_session(plain).channel is Channel.CONTENT
    assert frontend.open_session(frontend.prepare(prompt="hi")).channel is Channel.CONTENT


def test_sentencepiece_session_with_byte_fallback_and_think(sp):
    ids = sp.encode("<think>思考</think>Once upon a time 🎉<|im_end|>")
    session = OutputSession(sp)
    _run(session, [[i] for i in ids])
    assert session.reasoning_text == "思考"
    assert session.text == "Once upon a time 🎉"
    assert session.finish_reason is FinishReason.STOP
