"""The Frontend's reuse boundary (DESIGN §7 turn checkpoints): Qwen's chat template renders a
past answer without its thinking block and without the `<think>` its generation prompt opened,
so a follow-up turn's prompt leaves the previous one right after `<|im_start|>assistant\\n`.
The Frontend reports that position; the Engine checkpoints the prefill there, and the next turn
reuses the whole conversation before the answer. On the demo model the reused turn gives the
tokens a request without reuse gives (MTP off and K = 2)."""

from __future__ import annotations

import pytest

from ninfer_jax.api import Engine
from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import ChatTemplate, Frontend
from ninfer_jax.sampling_params import SamplingParams
from tests.conftest import SHARED_DATA
from tests.engine.conftest import TOKENIZER, fake_engine, settle

QWEN = ChatTemplate((SHARED_DATA / "qwen-tokenizer/qwen3.5/chat_template.jinja").read_text())
HISTORY = [{"role": "system", "content": "You are a storyteller."},
           {"role": "user", "content": "Tell me a story about a cat."}]


@pytest.mark.parametrize("thinking", [None, False])
def test_the_boundary_is_where_the_next_turn_leaves_the_prompt(thinking):
    frontend = Frontend(TOKENIZER, QWEN)
    first = frontend.prepare(messages=HISTORY, enable_thinking=thinking)
    follow = frontend.prepare(messages=HISTORY + [
        {"role": "assistant", "content": "Once there was a cat."},
        {"role": "user", "content": "And then?"}], enable_thinking=thinking)
    b = first.reuse_boundary
    assert b is not None and 0 < b < first.num_tokens
    shared = next(i for i, (x, y) in enumerate(zip(first.token_ids, follow.token_ids)) if x != y)
    assert b == shared
    assert TOKENIZER.decode(first.token_ids[:b]).endswith("<|im_start|>assistant\n")
    # a template that renders past answers as the model wrote them reports none
    plain = Frontend(TOKENIZER, ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    assert plain.prepare(messages=HISTORY).reuse_boundary is None
    assert frontend.prepare(prompt="raw text").reuse_boundary is None


def test_a_follow_up_reuses_the_conversation_up_to_the_boundary():
    frontend = Frontend(TOKENIZER, QWEN)
    sampling = SamplingParams(max_new_tokens=10, temperature=0)
    with fake_engine(2, total_checkpoint_slots=8, max_seq_len=400, total_pages=200) as (core, _):
        first = frontend.prepare(messages=HISTORY)
        answer = core.submit(first, sampling).result(timeout=30)
        assert answer.usage.cached_tokens == 0
        follow = frontend.prepare(messages=HISTORY + [
            {"role": "assistant", "content": answer.text or "ok"},
            {"role": "user", "content": "And then?"}])
        again = core.submit(follow, sampling).result(timeout=30)
        assert again.usage.cached_tokens == first.reuse_boundary > 0
        # a bad boundary on a hand-made prompt is refused naming it
        import dataclasses

        from ninfer_jax.engine import RejectedError
        with pytest.raises(RejectedError, match="reuse_boundary"):
            core.submit(dataclasses.replace(first, reuse_boundary=first.num_tokens), sampling)
        settle(core)


SHORT = [{"role": "user", "content": "A cat?"}]


@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 2])  # 0: ~14 s
def test_a_reused_turn_samples_what_a_fresh_one_does_on_the_demo_model(k):
    from tests.engine.test_speculative_engine import _opened

    # the shared Program's max_seq_len is 72: a short conversation
    program, demo, path = _opened(k)
    frontend = Frontend(demo.tokenizer, QWEN)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    first = frontend.prepare(messages=SHORT)
    turns = {}
    for reuse in (True, False):
        with Engine(EngineCore(program, frontend, EngineCoreConfig(prefix_reuse=reuse)),
                    frontend, path) as e:
            answer = e.core.submit(first, sampling).result(timeout=120)
            follow = frontend.prepare(messages=SHORT + [
                {"role": "assistant", "content": answer.text or "ok"},
                {"role": "user", "content": "And then?"}])
            turns[reuse] = (answer, e.core.submit(follow, sampling).result(timeout=120))
            e.clear_prefix_cache()
    assert turns[True][0].token_ids == turns[False][0].token_ids
    assert turns[True][1].usage.cached_tokens == first.reuse_boundary > 0
    assert turns[False][1].usage.cached_tokens == 0
    assert turns[True][1].token_ids == turns[False][1].token_ids
