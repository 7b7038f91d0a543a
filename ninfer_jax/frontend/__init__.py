"""Frontend (DESIGN §2): tokenizers, chat templates, prompt preparation and output sessions.

Owns the model family's input and output text semantics; it imports no jax and knows nothing of
pages, lanes or scheduling. The Engine prepares prompts here and previews / commits each batch of
produced tokens through a request's OutputSession.
"""

from ninfer_jax.frontend.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ninfer_jax.frontend.hf_backend import HfTokenizer
from ninfer_jax.frontend.loading import Frontend, load_tokenizer
from ninfer_jax.frontend.output_session import (
    Channel,
    FinishReason,
    OutputSession,
    Preview,
    TextDelta,
    initial_channel,
)
from ninfer_jax.frontend.prompt import PreparedPrompt, PromptError, prepare, token_digest
from ninfer_jax.frontend.qwen_bpe import QwenBpeTokenizer
from ninfer_jax.frontend.sentencepiece_backend import SentencePieceTokenizer
from ninfer_jax.frontend.tokenizer import Tokenizer

__all__ = [
    "Channel",
    "ChatTemplate",
    "ChatTemplateError",
    "FinishReason",
    "Frontend",
    "HfTokenizer",
    "OutputSession",
    "PreparedPrompt",
    "Preview",
    "PromptError",
    "QwenBpeTokenizer",
    "SentencePieceTokenizer",
    "TextDelta",
    "Tokenizer",
    "initial_channel",
    "load_chat_template",
    "load_tokenizer",
    "prepare",
    "token_digest",
]
