"""Model-directory loading: picks the tokenizer backend and bundles it with the chat template.

Owns the rule for which backend reads a directory (Qwen BPE ranks, then `tokenizer.json`, then a
sentencepiece `.model`) and the `Frontend` bundle the Engine holds: prompt preparation and a new
`OutputSession` per request, starting in the channel the prompt leaves open.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer_jax.frontend.chat_template import (
    TOKENIZER_CONFIG_FILE,
    ChatTemplate,
    load_chat_template,
)
from ninfer_jax.frontend.grammar import GrammarCompiler
from ninfer_jax.frontend.hf_backend import HfTokenizer
from ninfer_jax.frontend.media import VisionTokens
from ninfer_jax.frontend.output_session import OutputSession, initial_channel
from ninfer_jax.frontend.prompt import PreparedPrompt, prepare
from ninfer_jax.frontend.qwen_bpe import SPECIAL_TOKENS_FILE, QwenBpeTokenizer
from ninfer_jax.frontend.sentencepiece_backend import SentencePieceTokenizer
from ninfer_jax.frontend.tokenizer import DEFAULT_EOS_TOKENS, Tokenizer
from ninfer_jax.frontend.vision import VisionProcessorConfig

HF_TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"


def _config_eos_tokens(directory: pathlib.Path) -> tuple[str, ...]:
    """DEFAULT_EOS_TOKENS plus `tokenizer_config.json`'s `eos_token`, when it names one."""
    path = directory / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return DEFAULT_EOS_TOKENS
    eos = json.loads(path.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return DEFAULT_EOS_TOKENS + ((eos,) if isinstance(eos, str) else ())


def load_tokenizer(directory: str | pathlib.Path) -> Tokenizer:
    """The tokenizer of `directory`: Qwen BPE when `special_tokens.json` is there, else HF
    `tokenizer.json`, else `tokenizer.model` (or the only `*.model`) with sentencepiece."""
    directory = pathlib.Path(directory)
    if (directory / SPECIAL_TOKENS_FILE).is_file():
        return QwenBpeTokenizer(directory)
    if (directory / HF_TOKENIZER_FILE).is_file():
        return HfTokenizer(directory / HF_TOKENIZER_FILE, eos_tokens=_config_eos_tokens(directory))
    models = sorted(directory.glob("*.model"))
    if (directory / SENTENCEPIECE_FILE).is_file():
        return SentencePieceTokenizer(directory / SENTENCEPIECE_FILE)
    if len(models) == 1:
        return SentencePieceTokenizer(models[0])
    raise FileNotFoundError(
        f"{directory}: no tokenizer found (looked for {SPECIAL_TOKENS_FILE}, {HF_TOKENIZER_FILE}, "
        f"{SENTENCEPIECE_FILE} or a single *.model; found {len(models)} *.model files)"
    )


@dataclasses.dataclass(frozen=True)
class Frontend:
    """A model's tokenizer and chat template, as the Engine uses them."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate | None = None
    # A model with a vision tower: its vision tokens and processor settings (messages may then
    # hold images and videos); None: text only.
    vision: VisionTokens | None = None

    @classmethod
    def load(cls, directory: str | pathlib.Path, model_config: Any = None,
             local_media: bool | str | pathlib.Path = True,
             media_fetch_timeout_s: float = 0.0) -> Frontend:
        """The frontend of a model directory. `model_config` (its ModelConfig): with a usable
        vision tower, the processor settings are read too (`preprocessor_config.json`) and
        checked against the tower. `local_media`: which local image paths messages may name
        (True any, False none, a directory: inside it). `media_fetch_timeout_s`: http(s) image
        URLs are fetched within it (0: not at all)."""
        tokenizer = load_tokenizer(directory)
        vision = None
        cfg = model_config
        if cfg is not None and cfg.takes_media and \
                max(cfg.vision_token_ids) < tokenizer.vocab_size:
            processor = VisionProcessorConfig.from_dir(directory)
            processor.check_model(cfg.vision)
            vision = VisionTokens(
                *cfg.vision_token_ids, processor,
                local_media if isinstance(local_media, bool)
                else pathlib.Path(local_media).resolve(), float(media_fetch_timeout_s))
        return cls(tokenizer, load_chat_template(directory), vision)

    def prepare(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        allow_control_tokens: bool | None = None,
    ) -> PreparedPrompt:
        """See `prompt.prepare`; messages are rendered with this model's chat template."""
        return prepare(
            self.tokenizer,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tools=tools,
            allow_control_tokens=allow_control_tokens,
            vision=self.vision,
        )

    def grammar(self, vocab_size: int | None = None) -> GrammarCompiler:
        """The grammar compiler of this tokenizer for masks `vocab_size` wide (the model's
        vocabulary; default the tokenizer's). Built once per width, then shared."""
        compilers = self.__dict__.setdefault("_grammars", {})  # not a field: frozen stays
        width = self.tokenizer.vocab_size if vocab_size is None else vocab_size
        if width not in compilers:
            compilers[width] = GrammarCompiler(self.tokenizer, width)
        return compilers[width]

    def open_session(
        self,
        prompt: PreparedPrompt,
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = False,
        max_thinking_tokens: int | None = None,
    ) -> OutputSession:
        """A new OutputSession for output that continues `prompt` (see OutputSession)."""
        return OutputSession(
            self.tokenizer,
            stop=stop,
            stop_token_ids=stop_token_ids,
            channel=initial_channel(prompt.token_ids, self.tokenizer),
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            skip_special_tokens=skip_special_tokens,
            max_thinking_tokens=max_thinking_tokens,
        )
