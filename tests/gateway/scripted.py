"""A FakeProgram that answers from a script, for tool-call and conversation tests: the reply is a
function of the prompt's text (the real Qwen3.5/3.6 chat template rendered over the
ByteTokenizer), produced token by token (bytes) and ended with EOS. Replies open with a thought
when the prompt leaves `<think>` open, so thinking on and off both round-trip."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from ninfer_jax.api import Engine
from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import ChatTemplate, Frontend
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.testing.fake_program import FakeProgram
from tests.gateway.conftest import EOS, PAGE_SIZE, TOKENIZER

QWEN_TEMPLATE = ChatTemplate((pathlib.Path(__file__).parents[3] / "shared" / "data"
                              / "qwen-tokenizer" / "qwen3.5" / "chat_template.jinja").read_text())
QWEN_FRONTEND = Frontend(TOKENIZER, QWEN_TEMPLATE)
THINK_START, THINK_END = TOKENIZER.think_ids


class ScriptedProgram(FakeProgram):
    def __init__(self, limits: ProgramLimits, reply: Callable[[str], str]):
        super().__init__(limits, eos_id=EOS)
        self.reply = reply
        self.prompts: list[str] = []  # every prompt it was asked to continue, decoded
        self._scripts: dict[int, list[int]] = {}

    def _script(self, seq) -> list[int]:
        key = seq.handle.seq_id
        if key not in self._scripts:
            prompt = seq.tokens[: seq.prompt_len]
            text = TOKENIZER.decode(prompt)
            self.prompts.append(text)
            thinking = THINK_START in prompt[-3:] and THINK_END not in prompt[-3:]
            reply = ("I should think." + "</think>\n\n" if thinking else "") + self.reply(text)
            self._scripts[key] = TOKENIZER.encode(reply) + [EOS]
        return self._scripts[key]

    def _token(self, seq, state: int, position: int) -> int:
        i = position - seq.prompt_len
        if i < 0:  # after a middle prefill chunk: never used
            return EOS
        script = self._script(seq)
        return script[i] if i < len(script) else EOS


def scripted_engine(reply: Callable[[str], str], max_seq_len: int = 2048) -> Engine:
    limits = ProgramLimits(
        max_seq_len=max_seq_len, page_size=PAGE_SIZE, total_pages=4 * (max_seq_len // PAGE_SIZE),
        total_slots=4, max_concurrency=4, prefill_chunk=256, vocab_size=TOKENIZER.vocab_size,
        total_checkpoint_slots=8)
    program = ScriptedProgram(limits, reply)
    core = EngineCore(program, QWEN_FRONTEND, EngineCoreConfig(idle_wait_s=0.01))
    return Engine(core, QWEN_FRONTEND, None)
