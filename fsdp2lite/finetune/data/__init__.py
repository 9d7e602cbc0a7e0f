"""Training data: instruction data in TRL's ``SFTTrainer`` formats (loss masks, packing), and plain text.

``load_jsonl(path, tokenizer, max_length)`` reads ``{"text"}``, ``{"prompt", "completion"}`` and
``{"messages"}`` lines (formats.py), tokenizes them with the tokens the loss is taken on (tokenize.py: the
completion, the assistant turns, all of a text) and packs them into windows of ``max_length`` positions with
position ids that restart at every example (packing.py). ``num_items_in_batch`` and ``packed_loss`` give the
mean over the global batch's trained tokens on any number of ranks and microbatches (loss.py,
[Note: the global token mean]). Plain text is ``TokenWindows`` of ``tokenize_text`` (text.py); ``step_loss``
picks either kind's loss. docs/finetune.md shows the formats; bad data is a ``DataError`` naming every bad line
by file and line.
"""

from __future__ import annotations

from pathlib import Path

from .formats import ROLES, Conversation, DataError, Example, PromptCompletion, TextExample, read_jsonl
from .loss import TokenMeanLoss, forward_logits, num_items_in_batch, packed_loss
from .packing import IGNORE_INDEX, PackedWindows, best_fit_decreasing, pack
from .text import TokenWindows, WindowLoss, Windows, step_loss, tokenize_text, window_loss
from .tokenize import TokenizedExample, Tokenizer, tokenize_examples

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "Conversation",
    "DataError",
    "Example",
    "PackedWindows",
    "PromptCompletion",
    "TextExample",
    "TokenMeanLoss",
    "TokenWindows",
    "TokenizedExample",
    "Tokenizer",
    "WindowLoss",
    "Windows",
    "best_fit_decreasing",
    "forward_logits",
    "load_jsonl",
    "num_items_in_batch",
    "pack",
    "packed_loss",
    "read_jsonl",
    "step_loss",
    "tokenize_examples",
    "tokenize_text",
    "window_loss",
]


def load_jsonl(
    path: Path,
    tokenizer: Tokenizer | None,
    max_length: int,
    *,
    tokenizer_name: str = "the tokenizer",
    length_name: str = "max_length",
) -> PackedWindows:
    """The JSON Lines file ``path`` read, tokenized (``tokenizer`` None: UTF-8 bytes, no chat template) and packed
    into windows of ``max_length`` positions. ``tokenizer_name`` and ``length_name`` are how the caller names
    the tokenizer and the window length in messages (examples/train.py: its --tokenizer, "--seq"). Raises one
    DataError naming every bad line, before anything is packed."""
    examples = read_jsonl(path)
    tokenized = tokenize_examples(examples, tokenizer, tokenizer_name)
    return pack(tokenized, max_length, pad_id=_pad_id(tokenizer), length_name=length_name)


def _pad_id(tokenizer: Tokenizer | None) -> int:
    """The id padding gets (never trained, never attended to): the tokenizer's pad token, else EOS, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0
