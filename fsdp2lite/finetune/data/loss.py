"""The loss on packed windows: the mean over every trained token of the global batch.

[Note: the global token mean]
A step's global batch is W data-parallel ranks x A microbatches of windows. Its loss is the sum of the
cross-entropy over every trained token in it, divided by N, the number of those tokens over all ranks and
microbatches (Hugging Face's ``num_items_in_batch``, counted across devices as its Trainer's
``average_tokens_across_devices`` does). Each rank's microbatch loss is therefore its own sum / N * W: the
reduce-scatter averages the gradients over the W ranks (divides by W) and A backward passes add theirs up, so
the gradient is that of sum / N, what one process holding the whole global batch computes. Averaging each
microbatch's own mean instead would weigh a token of a microbatch with few trained tokens more than one of a
microbatch with many, and give another gradient for every other split of the same batch.

Example: rank 0 has 3 trained tokens with losses summing to 6.0, rank 1 has 1 token with loss 2.0: N = 4,
rank 0's loss 6.0 / 4 * 2 = 3.0, rank 1's 2.0 / 4 * 2 = 1.0; averaged over ranks 2.0 = (6.0 + 2.0) / 4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...models import GPT
from ..head_loss import causal_lm_loss
from .packing import IGNORE_INDEX


def num_items_in_batch(micro_batches: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Trained tokens in the global batch: this rank's ``micro_batches`` (each ``(batch, 3, seq)``) summed over
    ``group``'s ranks (one all-reduce; none without a process group)."""
    count = torch.zeros((), dtype=torch.long, device=micro_batches[0].device)
    for batch in micro_batches:
        count += (batch[:, 1] != IGNORE_INDEX).sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)  # every rank divides by the same N
    return count.clamp(min=1)


def packed_loss(
    model: nn.Module, batch: torch.Tensor, num_items_in_batch: int | torch.Tensor, data_parallel_size: int = 1
) -> torch.Tensor:
    """``batch`` ``(batch, 3, seq)`` -> this rank's share of the global token mean ([Note: the global token
    mean]): its cross-entropy sum over trained tokens / ``num_items_in_batch`` * ``data_parallel_size``."""
    input_ids, labels, position_ids = batch.unbind(1)  # each (batch, seq)
    loss_sum = causal_lm_loss(model, input_ids, labels, position_ids)  # a frozen head: [Note: chunked head loss]
    if loss_sum is None:
        logits = forward_logits(model, input_ids, position_ids)  # (batch, seq, vocab)
        loss_sum = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    return loss_sum * data_parallel_size / num_items_in_batch


class TokenMeanLoss:
    """A training loop's loss on packed windows, in two calls per step: ``num_items = loss.count(micro_batches)``
    once (the global batch's trained tokens: one all-reduce), then ``loss(model, batch, num_items)`` for each
    microbatch before its backward. ``data_parallel_size``: the ranks the gradient reduction averages over."""

    def __init__(self, data_parallel_size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.data_parallel_size = data_parallel_size
        self.group = group

    def count(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        return num_items_in_batch(micro_batches, self.group)

    def __call__(self, model: nn.Module, batch: torch.Tensor, num_items: int | torch.Tensor) -> torch.Tensor:
        return packed_loss(model, batch, num_items, self.data_parallel_size)


def forward_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits ``(batch, seq, vocab)``: fsdp2lite's GPT, or a Hugging Face causal LM (also inside peft).
    With the windows' ``position_ids`` both build the block-diagonal mask from them; None: one sequence per row."""
    if isinstance(model, GPT):
        return model(input_ids) if position_ids is None else model(input_ids, position_ids=position_ids)
    if position_ids is None:
        return model(input_ids=input_ids, use_cache=False).logits
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
