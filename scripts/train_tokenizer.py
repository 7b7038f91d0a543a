"""The demo model's corpus and tokenizer: TinyStories text, recased, and a sentencepiece model.

Owns reading `../shared/data/tinystories/` into stories, recasing the lowercased file's stories
that have no cased copy (word casing learned from the cased file, then sentence starts), and
training the sentencepiece tokenizer (unigram, single-threaded so reruns match, byte fallback, the chat control tokens as
user-defined symbols so text containing them encodes to one id each). It writes the tokenizer
files and the ChatML chat template into a frontend directory; it knows nothing about the model.

    python scripts/train_tokenizer.py --out=/tmp/demo_frontend
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import time

import numpy as np

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories"
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
VOCAB_SIZE = 4096

# ChatML; `enable_thinking=false` adds an empty think block as Qwen's templates do.
CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

# What the user says in the chat-formatted share of the stories; {name} is the story's hero.
USER_REQUESTS = ("Tell me a story.", "Can you tell me a story?", "Please tell me a short story.",
                 "Write a story for a little kid.", "I want a bedtime story.")
NAMED_REQUESTS = ("Tell me a story about {name}.", "Can you tell me a story about {name}?",
                  "Write a short story about {name}.")
THINK_OFF = "<think>\n\n</think>\n\n"

# UTF-8 quotes read as cp1252 in the source files, and typographic quotes, as ASCII.
_MOJIBAKE = (("â€œ", '"'), ("â€™", "'"), ("â€˜", "'"), ("â€“", "-"), ("â€”", "-"), ("â€¦", "..."),
             ("â€Š", " "), ("â€", '"'), ("“", '"'), ("”", '"'), ("‘", "'"), ("’", "'"))
_WORD = re.compile(r"[A-Za-z']+")
# A sentence starts at the text start, after .!? and spaces, or after an opening quote.
_SENTENCE_START = re.compile(r'(^|[.!?]\s+|[.!?]"\s+|(?:^|\s)")([a-z])')


def clean(text: str) -> str:
    """Repairs the source files' mis-decoded quotes and dashes (applied to train and valid)."""
    for bad, good in _MOJIBAKE:
        text = text.replace(bad, good)
    return text


def split_stories(text: str) -> list[str]:
    """Stories are separated by a single newline; paragraphs inside one by a blank line."""
    return [clean(s.strip()) for s in re.split(r"(?<!\n)\n(?!\n)", text) if s.strip()]


def casing_table(cased_text: str) -> dict[str, str]:
    """lowercase word -> its usual casing mid-sentence, for words that are not all lowercase."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for sentence in re.split(r'[.!?]"?\s+|\n+|"', cased_text):
        for word in _WORD.findall(sentence)[1:]:
            counts[word.lower()][word] += 1
    table = {}
    for lower, forms in counts.items():
        form, n = forms.most_common(1)[0]
        if form != lower and n > forms[lower]:
            table[lower] = form
    table["i"] = "I"
    return table


def recase(text: str, table: dict[str, str]) -> str:
    """Lowercased story text -> cased: known words by `table`, then every sentence start."""
    text = _WORD.sub(lambda m: table.get(m.group(0), m.group(0)), text)
    text = re.sub(r"\bi'(m|ll|ve|d)\b", lambda m: "I'" + m.group(1), text)
    return _SENTENCE_START.sub(lambda m: m.group(1) + m.group(2).upper(), text)


def train_stories() -> list[str]:
    """The ~5,500 train stories: the cased file's, then the recased rest of the lowercased file."""
    cased = (DATA / "train_head_cased.txt").read_text()
    lowered = (DATA / "train_head_lowercased.txt").read_text()
    if lowered[: len(cased)] != cased.lower():
        raise ValueError("the lowercased train file does not start with the cased file's text")
    table = casing_table(cased)
    return split_stories(cased) + [recase(s, table) for s in split_stories(lowered[len(cased):])]


def valid_text() -> str:
    """Held-out text (story boundaries are not recoverable from this file)."""
    return clean((DATA / "valid_head_cased.txt").read_text().strip())


def as_chat(story: str, choice: int) -> str:
    """The story as a ChatML exchange (rendered as CHAT_TEMPLATE would, plus the answer).

    `choice` (any int) picks the request and whether the empty think block is present.
    """
    name = re.search(r"\bnamed ([A-Z][a-z]+)", story)
    requests = USER_REQUESTS + (tuple(r.format(name=name.group(1)) for r in NAMED_REQUESTS)
                                if name else ())
    think = THINK_OFF if choice % 3 == 0 else ""
    return (f"<|im_start|>user\n{requests[choice % len(requests)]}<|im_end|>\n"
            f"<|im_start|>assistant\n{think}{story}<|im_end|>\n")


def train_tokenizer(stories: list[str], out: pathlib.Path) -> pathlib.Path:
    """Trains the sentencepiece model on the stories' paragraphs; writes `out/tokenizer.model`,
    the chat template and a `tokenizer_config.json` naming the special tokens."""
    import io

    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    paragraphs = [p for s in stories for p in s.split("\n\n") if p.strip()]
    paragraphs += [f"user\n{r}" for r in USER_REQUESTS] + ["assistant\n"] * len(USER_REQUESTS)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs), model_writer=model, model_type="unigram",
        vocab_size=VOCAB_SIZE, character_coverage=1.0, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=list(CONTROL_TOKENS), unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
        split_digits=True, add_dummy_prefix=False, num_threads=1, minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(CONTROL_TOKENS),
        "model_max_length": 2048,
    }, indent=2))
    return out / "tokenizer.model"



def documents(stories: list[str], chat_share: float, seed: int) -> list[str]:
    """Each story as plain text or (a `chat_share` of them) as a chat exchange, then EOS."""
    rng = np.random.default_rng(seed)
    chat = rng.random(len(stories)) < chat_share
    choice = rng.integers(0, 1 << 30, len(stories))
    return [(as_chat(s, int(c)) if is_chat else s) + "<|endoftext|>"
            for s, is_chat, c in zip(stories, chat, choice)]


def windows(token_ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping [N, seq_len + 1] windows (inputs and shifted targets) of a token stream."""
    n = (len(token_ids) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return token_ids[idx].astype(np.int32)


class Log:
    def __init__(self, path: str | None):
        self.file = open(path, "a") if path else None
        self.start = time.perf_counter()

    def __call__(self, **record):
        record["t"] = round(time.perf_counter() - self.start, 1)
        line = json.dumps(record)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    stories = train_stories()
    path = train_tokenizer(stories, args.out)
    print(f"{len(stories)} stories -> {path}")


if __name__ == "__main__":
    main()

