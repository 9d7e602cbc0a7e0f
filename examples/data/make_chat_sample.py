"""Write the bundled chat sample: ``chat.jsonl`` and the byte-level tokenizer with a chat template it is read
with, ``chat-tokenizer/``. Deterministic; run from anywhere to write them again:

    python examples/data/make_chat_sample.py

``chat.jsonl``: 400 short conversations (arithmetic with a follow-up question, spelling backwards, copying
one of the demo's sentences), some with a system message, each at most 128 tokens with that tokenizer, so
``examples/train.py``'s default ``--seq 128`` takes each whole.

``chat-tokenizer/``: 256 token ids, so it fits the ``llama-tiny`` preset's vocabulary: ids 0-2 are the special
tokens ``<|endoftext|>`` (EOS and padding), ``<|im_start|>`` and ``<|im_end|>``, ids 3-255 the bytes 3-255 (the
control bytes 0-2 never appear in text). The chat template is ChatML's, with ``{% generation %}`` around
the assistant's turns (TRL's ``assistant_only_loss`` reads those; fsdp2lite.finetune.data needs none).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: fsdp2lite's demo sentences

from fsdp2lite.cli.demo import make_text  # noqa: E402

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = "You are a helpful assistant."
WORDS = ("cat", "dog", "bird", "fox", "horse", "apple", "river", "house", "garden", "boat", "letter", "tree")
# the demo's sentences short enough for a turn each of user and assistant: 2 x 40 bytes + 31 of roles and markers
SENTENCES = sorted({s.strip() for s in re.findall(r"[^.]+\.", make_text(300)) if len(s.strip()) <= 40})
NUM_CHATS = 400
MAX_TOKENS = 128  # examples/train.py's default --seq takes a conversation of up to --seq + 1 tokens
SEED = 20261128


def make_tokenizer() -> object:
    """The byte-level tokenizer (a transformers PreTrainedTokenizerFast) with the special tokens above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = bytes_to_unicode()  # byte -> the printable character byte-level BPE writes it as
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_symbols[b]: b for b in range(len(SPECIAL_TOKENS), 256)})
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_chat(rng: random.Random) -> list[dict[str, str]]:
    """One conversation: a question and its answer, sometimes a follow-up, and a system message first where the
    whole still fits in MAX_TOKENS."""
    messages = make_turns(rng)
    with_system = [{"role": "system", "content": SYSTEM}, *messages]
    return with_system if rng.random() < 0.25 and chat_tokens(with_system) <= MAX_TOKENS else messages


def chat_tokens(messages: list[dict[str, str]]) -> int:
    """Its length with chat-tokenizer: a byte a token, and per message <|im_start|>, a newline after the role,
    <|im_end|> and a newline."""
    return sum(len(m["role"].encode()) + len(m["content"].encode()) + 4 for m in messages)


def make_turns(rng: random.Random) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        messages += [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
        if rng.random() < 0.5:
            messages += [
                {"role": "user", "content": "And times?"},
                {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
            ]
    elif kind == 1:
        word = rng.choice(WORDS)
        messages += [
            {"role": "user", "content": f"Spell {word} backwards."},
            {"role": "assistant", "content": f"{word} backwards is {word[::-1]}."},
        ]
    else:
        sentence = rng.choice(SENTENCES)
        messages += [
            {"role": "user", "content": f"Copy: {sentence}"},
            {"role": "assistant", "content": sentence},
        ]
    return messages


def make_chats(count: int = NUM_CHATS, seed: int = SEED) -> list[dict[str, list[dict[str, str]]]]:
    rng = random.Random(seed)
    return [{"messages": make_chat(rng)} for _ in range(count)]


def write(directory: Path = HERE) -> None:
    lines = [json.dumps(chat) for chat in make_chats()]
    (directory / "chat.jsonl").write_text("\n".join(lines) + "\n")
    make_tokenizer().save_pretrained(directory / "chat-tokenizer")  # type: ignore[attr-defined]


if __name__ == "__main__":
    write()
