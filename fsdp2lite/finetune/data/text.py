"""Plain text as training windows: the files as one token stream cut into windows of ``seq + 1`` tokens, every
token trained; and the loss for either kind of window (``step_loss``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..head_loss import causal_lm_loss
from .loss import TokenMeanLoss, forward_logits
from .packing import PackedWindows
from .tokenize import Tokenizer


class TokenWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of ``seq + 1`` tokens (inputs and their next-token targets)."""

    def __init__(self, tokens: torch.Tensor, seq: int) -> None:
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index * self.seq : index * self.seq + self.seq + 1]

    @property
    def max_token_id(self) -> int:
        return int(self.tokens.max()) if len(self.tokens) else -1

    def record(self) -> dict[str, Any]:
        """What a run's report says of its data."""
        return {"corpus_tokens": len(self.tokens), "samples": len(self)}


Windows = TokenWindows | PackedWindows  # what a training loop draws its batches from


def tokenize_text(files: list[Path], tokenizer: Tokenizer | None) -> torch.Tensor:
    """All files as one stream of token ids ``(num_tokens,)``: bytes without a tokenizer; with one, each line
    tokenized without special tokens and each file ending with EOS."""
    pieces = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if tokenizer is None:
            pieces.append(torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long())
            continue
        lines = tokenizer(text.splitlines(keepends=True), add_special_tokens=False)["input_ids"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        pieces.append(torch.tensor([i for line in lines for i in line] + eos, dtype=torch.long))
    return torch.cat(pieces)


def window_loss(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    """window (batch, seq + 1) token ids -> mean next-token cross-entropy."""
    inputs, targets = window[:, :-1], window[:, 1:]
    chunked = causal_lm_loss(model, inputs, targets, reduction="mean")  # a frozen head: [Note: chunked head loss]
    if chunked is not None:
        return chunked
    logits = forward_logits(model, inputs)  # (batch, seq, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class WindowLoss:
    """Text windows' loss, with TokenMeanLoss's two calls: each microbatch's mean divided by the step's number of
    microbatches (every window holds ``seq`` targets, so this too is the global batch's token mean)."""

    def count(self, micro_batches: list[torch.Tensor]) -> int:
        return len(micro_batches)

    def __call__(self, model: nn.Module, window: torch.Tensor, num_items: int | torch.Tensor) -> torch.Tensor:
        return window_loss(model, window) / num_items


def step_loss(windows: Windows, data_parallel_size: int) -> WindowLoss | TokenMeanLoss:
    """The loss of ``windows``' batches: packed instruction data's is the mean over the global batch's trained
    tokens ([Note: the global token mean])."""
    return TokenMeanLoss(data_parallel_size) if isinstance(windows, PackedWindows) else WindowLoss()
