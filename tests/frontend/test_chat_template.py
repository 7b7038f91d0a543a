"""Chat templates: the official Qwen3.5 template reproduces the golden chat strings and ids."""

from __future__ import annotations

import json

import pytest

from ninfer_jax.frontend import ChatTemplate, ChatTemplateError, Frontend, load_chat_template

MESSAGES = [
    {"role": "system", "content": "Be concise."},
    {"role": "user", "content": "Call a tool if needed."},
]


@pytest.fixture(scope="module")
def golden_chats(qwen_dir) -> dict[bool, dict]:
    cases = json.loads((qwen_dir / "goldens.json").read_text())["cases"]
    return {True: cases[3], False: cases[4]}


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen35_template_reproduces_goldens(qwen_dir, qwen, golden_chats, enable_thinking):
    template = load_chat_template(qwen_dir)
    text = template.render(MESSAGES, enable_thinking=enable_thinking)
    assert text == golden_chats[enable_thinking]["text"]
    assert qwen.encode(text) == golden_chats[enable_thinking]["ids"]


def test_thinking_is_the_template_default(qwen_dir, golden_chats):
    assert load_chat_template(qwen_dir).render(MESSAGES) == golden_chats[True]["text"]


def test_frontend_prepares_golden_chat(qwen_dir, golden_chats):
    frontend = Frontend.load(qwen_dir)
    prompt = frontend.prepare(messages=MESSAGES, enable_thinking=False)
    assert list(prompt.token_ids) == golden_chats[False]["ids"]
    assert prompt.text == golden_chats[False]["text"]


def test_tools_render_with_non_ascii_json(qwen_dir):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "查询天气"}}]
    text = load_chat_template(qwen_dir).render(MESSAGES, tools=tools)
    assert '"description": "查询天气"' in text
    assert text.startswith("<|im_start|>system\n# Tools")
    assert text.endswith(
        "Be concise.<|im_end|>\n<|im_start|>user\nCall a tool if needed."
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_history_drops_old_reasoning(qwen_dir):
    history = MESSAGES + [
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nDone."},
        {"role": "user", "content": "Thanks"},
    ]
    text = load_chat_template(qwen_dir).render(history, add_generation_prompt=False)
    assert "<|im_start|>assistant\nDone.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n" in text
    assert "plan" not in text


def test_template_errors_are_chat_template_errors(qwen_dir):
    template = load_chat_template(qwen_dir)
    with pytest.raises(ChatTemplateError, match="No messages provided"):
        template.render([])
    with pytest.raises(ChatTemplateError, match="Unexpected message role"):
        template.render([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_environment_is_sandboxed_and_immutable():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render([{"role": "user"}])


def test_qwen3_template_from_tokenizer_config(shared_data):
    template = load_chat_template(shared_data / "qwen-tokenizer")
    text = template.render(MESSAGES, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_directory_without_template(tmp_path):
    assert load_chat_template(tmp_path) is None
