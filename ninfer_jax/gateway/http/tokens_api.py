"""Token endpoints: vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info` (the shapes
lm-evaluation-harness's remote tokenizer probes for), and Anthropic's
`/v1/messages/count_tokens`.

Owns their request and response shapes; tokenizing and rendering stay with the Frontend (the
same `prepare` a generation request uses, so a count is the prompt the model would see).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from ninfer_jax.frontend import ChatTemplateError, PromptError
from ninfer_jax.gateway.http.anthropic_requests import parse_messages
from ninfer_jax.gateway.http.errors import ApiError
from ninfer_jax.gateway.http.fields import Fields
from ninfer_jax.gateway.http.requests import reject_unknown
from ninfer_jax.gateway.http.state import ServerState

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "add_generation_prompt", "return_token_strs", "tools",
                             "chat_template_kwargs", "allow_control_tokens"})


def _prepare(state: ServerState, **kwargs: Any) -> Any:
    try:
        return state.engine.frontend.prepare(**kwargs)
    except PromptError as e:
        raise ApiError.invalid(e.field, str(e).split(": ", 1)[-1]) from None
    except ChatTemplateError as e:
        raise ApiError.invalid("messages", str(e)) from None


def tokenize(state: ServerState, obj: Any) -> Response:
    """`POST /tokenize`: {prompt} or {messages} -> {count, max_model_len, tokens[, token_strs]}.
    `add_special_tokens` is accepted for vLLM's shape: this model adds no BOS either way."""
    body = Fields(obj)
    reject_unknown(body, TOKENIZE_FIELDS)
    body.boolean("add_special_tokens")
    kwargs: dict[str, Any] = {"allow_control_tokens": body.boolean("allow_control_tokens")}
    if body.has("messages") == body.has("prompt"):
        raise ApiError.invalid("prompt", "give exactly one of prompt or messages")
    if body.has("prompt"):
        kwargs["prompt"] = body.string("prompt", required=True)
    else:
        kwargs["messages"] = body.array("messages", required=True)
        generation_prompt = body.boolean("add_generation_prompt")
        kwargs["add_generation_prompt"] = True if generation_prompt is None else generation_prompt
        options = body.obj("chat_template_kwargs")
        if options is not None:
            kwargs["enable_thinking"] = options.boolean("enable_thinking")
        tools = body.array("tools")
        if tools:
            kwargs["tools"] = tools
    if body.has("prompt") and not kwargs["prompt"]:  # vLLM answers an empty text with no ids
        ids: tuple[int, ...] = ()
    else:
        ids = _prepare(state, **kwargs).token_ids
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_seq_len,
                           "tokens": list(ids), "token_strs": None}
    if body.boolean("return_token_strs"):
        tokenizer = state.engine.frontend.tokenizer
        out["token_strs"] = [tokenizer.token_bytes(t).decode("utf-8", errors="replace")
                             for t in ids]
    return JSONResponse(out)


def detokenize(state: ServerState, obj: Any) -> Response:
    """`POST /detokenize`: {tokens} -> {prompt}."""
    body = Fields(obj)
    reject_unknown(body, frozenset({"model", "tokens"}))
    tokens = body.array("tokens", required=True)
    tokenizer = state.engine.frontend.tokenizer
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < tokenizer.vocab_size:
            raise ApiError.invalid(f"tokens[{i}]", f"expected a token id in "
                                   f"[0, {tokenizer.vocab_size}), got {t!r:.40}")
    return JSONResponse({"prompt": tokenizer.decode(tokens)})


def tokenizer_info(state: ServerState) -> Response:
    """`GET /tokenizer_info`: the special tokens and chat template a remote client needs."""
    tokenizer = state.engine.frontend.tokenizer
    specials = tokenizer.special_tokens
    eos = next((t for t in ("<|endoftext|>", "<|im_end|>") if t in specials), None)
    if eos is None and tokenizer.eos_ids:
        eos = tokenizer.token_bytes(min(tokenizer.eos_ids)).decode("utf-8", errors="replace")
    template = state.engine.frontend.chat_template
    return JSONResponse({
        "tokenizer_class": type(tokenizer).__name__, "eos_token": eos, "bos_token": None,
        "pad_token": None, "model_max_length": state.engine.max_seq_len,
        "vocab_size": tokenizer.vocab_size,
        "chat_template": None if template is None else template.source})


def count_tokens(state: ServerState, obj: Any, session: str | None) -> Response:
    """`POST /v1/messages/count_tokens` (Anthropic): the prompt a Messages request would be."""
    req = parse_messages(obj, session, count_only=True)
    prepared = _prepare(state, messages=req.messages, enable_thinking=req.enable_thinking,
                        tools=req.tools, allow_control_tokens=req.allow_control_tokens)
    return JSONResponse({"input_tokens": prepared.num_tokens})
