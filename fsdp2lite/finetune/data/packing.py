"""Packing tokenized examples into fixed windows, each example its own sequence inside its window.

An example of ``n`` tokens becomes ``n - 1`` positions: inputs ``ids[:-1]``, labels ``ids[1:]`` (the next-token
targets, ``IGNORE_INDEX`` where not trained), position ids ``0 .. n - 2``. Windows of ``max_length`` positions
take whole examples by best-fit decreasing (TRL's ``packing_strategy="bfd"``: the longest first, each into the
window it fills best); the rest of a window is padding (labels ignored) with position ids of its own, from 0.

Example, ``max_length`` 8: a prompt/completion a0..a5 (prompt a0-a2) and a text b0..b3:
    input_ids    [a0   a1   a2 a3 a4 b0 b1 b2]
    labels       [-100 -100 a3 a4 a5 b1 b2 b3]
    position_ids [0    1    2  3  4  0  1  2 ]
A position id that does not follow the one before starts a sequence: transformers' masks (``create_causal_mask``
with ``position_ids`` and no ``attention_mask``: ``find_packed_sequence_indices``) and fsdp2lite's GPT build the
block-diagonal causal mask from them, so no token attends across examples and each sees the positions it would
alone.

An example longer than a window: text is split into pieces of ``max_length`` positions, each its own sequence
(TRL's ``"bfd_split"``); a prompt/completion or conversation must fit whole (its completion would lose its
prompt), else a DataError names it and the ``max_length`` it needs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from ..head_loss import IGNORE_INDEX
from .formats import DataError
from .tokenize import TokenizedExample


@dataclass(frozen=True)
class Piece:
    """One sequence of a window: ``(n,)`` inputs and their next-token labels."""

    input_ids: list[int]
    labels: list[int]


class PackedWindows(Dataset[torch.Tensor]):
    """Packed windows: item ``i`` is ``(3, seq)`` int64, its rows input_ids, labels and position_ids."""

    def __init__(self, windows: torch.Tensor, examples: list[TokenizedExample]) -> None:
        self.windows = windows  # (num_windows, 3, seq)
        self.seq = windows.shape[-1]
        self.examples = len(examples)
        self.num_tokens = sum(len(e.input_ids) for e in examples)
        self.targets = int((windows[:, 1] != IGNORE_INDEX).sum())  # tokens the loss is taken on
        self.kinds = dict(Counter(e.kind for e in examples))

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]

    @property
    def max_token_id(self) -> int:
        return int(self.windows[:, 0].max())

    def record(self) -> dict[str, Any]:
        """What a run's report says of its data."""
        return {
            "examples": self.examples,
            "formats": self.kinds,
            "corpus_tokens": self.num_tokens,
            "trained_tokens": self.targets,
            "samples": len(self),
        }


def pack(
    examples: list[TokenizedExample], max_length: int, pad_id: int, length_name: str = "max_length"
) -> PackedWindows:
    """``examples`` packed into windows of ``max_length`` positions (``length_name``: how the caller calls it,
    for the messages); a DataError naming every masked example that does not fit in one window."""
    if max_length < 1:
        raise ValueError(f"{length_name} {max_length}: expected a positive number of tokens per window")
    pieces: list[Piece] = []
    problems: list[str] = []
    for example in examples:
        inputs, labels = example.input_ids[:-1], _labels(example)
        if len(inputs) > max_length and example.masked:
            problems.append(_too_long(example, max_length, length_name))
            continue
        pieces += [
            Piece(inputs[i : i + max_length], labels[i : i + max_length]) for i in range(0, len(inputs), max_length)
        ]
    if problems:
        raise DataError(problems)
    bins = best_fit_decreasing([len(p.input_ids) for p in pieces], max_length)
    windows = torch.stack([_window([pieces[i] for i in bin_], max_length, pad_id) for bin_ in bins])
    return PackedWindows(windows, examples)


def _labels(example: TokenizedExample) -> list[int]:
    ids, trained = example.input_ids, example.trained
    return [ids[i] if trained[i] else IGNORE_INDEX for i in range(1, len(ids))]


def _too_long(example: TokenizedExample, max_length: int, length_name: str) -> str:
    part = "completion" if example.kind == "prompt/completion" else "assistant turns"
    tokens = len(example.input_ids)
    return (
        f"{example.where}: {tokens} tokens ({example.targets} of them in its {part}); a window of {length_name} "
        f"{max_length} holds {max_length + 1} ({max_length} inputs, each with the next token as its target) and a "
        f"{example.kind} example must fit whole in one: pass {length_name} {tokens - 1} or more, or shorten it"
    )


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of ``capacity``: the longest first, each into the bin it leaves the least
    space in (a new bin when none has room). Ties keep their order, so the result is deterministic."""
    bins: list[list[int]] = []
    spaces: list[tuple[int, int]] = []  # (space left, bin index), sorted: the best fit is the first with room
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect_left(spaces, (lengths[index], -1))
        if at == len(spaces):
            bins.append([index])
            space, bin_index = capacity - lengths[index], len(bins) - 1
        else:
            space, bin_index = spaces.pop(at)
            bins[bin_index].append(index)
            space -= lengths[index]
        if space > 0:
            insort(spaces, (space, bin_index))
    return bins


def _window(pieces: list[Piece], length: int, pad_id: int) -> torch.Tensor:
    """``(3, length)``: the pieces one after another, then padding; position ids restart at each."""
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for piece in pieces:
        input_ids += piece.input_ids
        labels += piece.labels
        positions += range(len(piece.input_ids))
    padding = length - len(input_ids)
    input_ids += [pad_id] * padding
    labels += [IGNORE_INDEX] * padding
    positions += range(padding)  # a sequence of its own: nothing attends to the padding
    return torch.tensor([input_ids, labels, positions], dtype=torch.long)
