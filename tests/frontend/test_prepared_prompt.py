"""PreparedPrompt and prepare: immutability, digest, and errors that name the field."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from ninfer_jax.frontend import Frontend, PreparedPrompt, PromptError, prepare


@pytest.fixture(scope="module")
def frontend(qwen, qwen_dir) -> Frontend:
    return Frontend(qwen, Frontend.load(qwen_dir).chat_template)


def test_digest_is_sha256_over_uint32_ids():
    prompt = PreparedPrompt((1, 2, 248_000))
    expected = hashlib.sha256(np.array([1, 2, 248_000], dtype="<u4").tobytes()).hexdigest()
    assert prompt.digest == expected
    assert PreparedPrompt((1, 2, 248_001)).digest != expected
    assert prompt.num_tokens == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.token_ids = (3,)


def test_same_ids_from_text_and_ids_have_the_same_identity(frontend):
    from_text = frontend.prepare(prompt="Hello world! 1234")
    from_ids = frontend.prepare(prompt_token_ids=np.array(from_text.token_ids))
    assert from_ids.token_ids == from_text.token_ids
    assert from_ids.digest == from_text.digest
    assert isinstance(from_ids.token_ids, tuple) and from_ids.text is None
    assert all(type(i) is int for i in from_ids.token_ids)


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({}, "prompt", "exactly one of"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt", "exactly one of"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": b"abc"}, "prompt", "expected a string"),
        ({"prompt_token_ids": []}, "prompt_token_ids", "must not be empty"),
        ({"prompt_token_ids": "12"}, "prompt_token_ids", "sequence of ints"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids[1]", "expected an int, got float"),
        ({"prompt_token_ids": [True]}, "prompt_token_ids[0]", "got bool"),
        ({"prompt_token_ids": [5, -1]}, "prompt_token_ids[1]", r"-1 is outside .*\[0, 248077\)"),
        ({"prompt_token_ids": [248_077]}, "prompt_token_ids[0]", "outside the vocabulary"),
        ({"messages": []}, "messages", "must not be empty"),
        ({"messages": {"role": "user"}}, "messages", "expected a list"),
        ({"messages": ["hi"]}, "messages[0]", "expected a mapping"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "must be a string"),
        # #41: accepted by Engine.submit and `ninfer generate` / a bare RuntimeError
        ({"messages": [{"role": "narrator", "content": "hi"}]}, "messages[0].role",
         r"must be one of \['system', 'user', 'assistant', 'tool'\], got 'narrator'"),
        ({"prompt": "ab\ud800c"}, "prompt", "lone surrogate at index 2"),
        # #41: silently ignored (the demo model then returned an empty text)
        ({"prompt": "Tell me a story.", "enable_thinking": True}, "enable_thinking",
         "applies to messages"),
        ({"messages": [{"role": "user", "content": "x\udfffy"}]}, "messages[0].content",
         "lone surrogate at index 1"),
    ],
)
def test_bad_input_names_the_field(frontend, kwargs, field, message):
    with pytest.raises(PromptError, match=message) as info:
        frontend.prepare(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_messages_need_a_template(qwen):
    with pytest.raises(PromptError, match="no chat template") as info:
        prepare(qwen, messages=[{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"
