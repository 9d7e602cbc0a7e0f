"""A causal LM's cross-entropy without its full-vocabulary logits: the head and the loss in runs of tokens.

[Note: chunked head loss]
A Hugging Face causal LM computes ``lm_head(hidden)`` for every token, ``(batch, seq, vocab)`` in bf16, then
upcasts it for the loss: at Llama-3's vocabulary of 128256 and 2048 tokens that is 0.49 GiB of logits, 0.98 GiB
in fp32, 0.98 GiB of saved log-softmax, and backward starts with two more fp32 temporaries of that size.
Where the head is frozen (LoRA, QLoRA: only the input's gradient flows through it), ``causal_lm_loss`` runs the
decoder, then the head and the loss a run of ``chunk_tokens`` tokens at a time:

    forward   per run: logits = head(hidden[run]) in fp32, the targets' logits picked, logsumexp in place,
              loss += logsumexp - picked; nothing is saved but the decoder's output (``(tokens, hidden)``,
              32 MiB at 2048 x 8192 in bf16) and the labels
    backward  per run: the run's logits again, softmax in place, minus onehot(target), times g,
              grad_hidden[run] = grad (in the hidden states' dtype) @ W

so one run's fp32 logits (``CHUNK_LOGIT_BYTES``) and a bf16 copy are all that is live of the loss at any
moment (``run_bytes``: 6 bytes a logit of one run), where the full computation holds its whole logits several
times over. The values are the full computation's up to rounding (the same row-wise math, the loss summed in
another order). A trainable head (full fine-tuning) keeps the full computation: its weight gradient would
need an fp32 accumulator of the head's size.

[Note: the loss as the root's pass]
The decoder and the head are called directly, not through the model's ``forward`` (which would make the full
logits), so the whole loss runs as the root's forward pass (``fsdp2lite.module.run_forward_pass``): the root's
lazy init, unshard and post-forward happen around it as around ``forward``. The head, in a group of its own,
runs as that group's pass around the chunked loss: gathered once before it, its pre-backward hooked on the
loss, its post-backward when the hidden states' gradient is complete.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..forward_pass import run_forward_pass

IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index, and Hugging Face's label for "no loss"
CHUNK_LOGIT_BYTES = 64 * 2**20  # one run's fp32 logits ([Note: chunked head loss])
RUN_BYTES_PER_LOGIT = 6  # a run's peak: its fp32 logits beside their bf16 original (or the gradient's bf16 copy)


def chunk_tokens(vocab: int) -> int:
    """Tokens a run holds: its fp32 logits within ``CHUNK_LOGIT_BYTES``, a multiple of 8 (at least 8)."""
    return max(8, CHUNK_LOGIT_BYTES // (4 * vocab) // 8 * 8)


def run_bytes(vocab: int, tokens: int) -> int:
    """The most a run's temporaries take (forward or backward): ``RUN_BYTES_PER_LOGIT`` a logit of the run."""
    return RUN_BYTES_PER_LOGIT * vocab * min(tokens, chunk_tokens(vocab))


def plain_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, head) of a Hugging Face causal LM (also inside peft) whose logits are ``head(decoder(...))``
    with a frozen ``nn.Linear`` head; None for any other model (a trainable head, a soft-capped or scaled logit)."""
    unwrap: Any = getattr(model, "get_base_model", None)  # peft's PeftModel holds the causal LM
    base: Any = unwrap() if callable(unwrap) else model
    config = getattr(base, "config", None)
    if not isinstance(getattr(config, "model_type", None), str):
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1.0):
        return None
    head = base.get_output_embeddings() if callable(getattr(base, "get_output_embeddings", None)) else None
    decoder = getattr(base, "base_model", None)
    if not isinstance(head, nn.Linear) or decoder is None or decoder is base:
        return None
    if any(p.requires_grad for p in head.parameters()):
        return None
    return decoder, head


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    reduction: str = "sum",
) -> torch.Tensor | None:
    """The cross-entropy of ``model``'s next-token predictions for ``input_ids`` ``(batch, seq)`` against
    ``labels`` (the same shape, already shifted; ``IGNORE_INDEX`` skipped), summed (``reduction="sum"``) or
    averaged over the counted tokens (``"mean"``), computed run by run ([Note: chunked head loss]); None when
    ``plain_head`` finds no frozen plain head (the caller computes the full logits)."""
    parts = plain_head(model)
    if parts is None:
        return None
    decoder, head = parts

    def loss_pass(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        hidden = decoder(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state  # (batch, seq, hidden)
        return run_forward_pass(head, head_loss, head, hidden, labels)

    loss_sum = run_forward_pass(model, loss_pass, input_ids, labels, position_ids)
    if reduction == "sum":
        return loss_sum
    return loss_sum / (labels != IGNORE_INDEX).sum().clamp(min=1)


def head_loss(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of ``head(hidden)`` (``(batch, seq, hidden)``) against ``labels`` ``(batch,
    seq)``, run by run ([Note: chunked head loss])."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # (tokens, hidden)
    return ChunkedHeadLoss.apply(flat, head.weight, head.bias, labels.reshape(-1))  # type: ignore[no-any-return]


class ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, labels), run by run, weight and bias frozen."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, labels)
        ctx.bias = bias
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in _runs(hidden.shape[0], weight.shape[0]):
            target, counted = _targets(labels[rows])
            logits = _run_logits(hidden[rows], weight, bias)  # (run, vocab) fp32
            picked = logits.gather(1, target).squeeze(1)  # the targets' logits, before the in-place ops
            top = logits.amax(dim=1, keepdim=True)
            log_sum = logits.sub_(top).exp_().sum(dim=1).log_() + top.squeeze(1)  # logsumexp, in place
            total += ((log_sum - picked) * counted).sum()
            del logits  # before the next run's are made
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        hidden, weight, labels = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad_hidden = torch.empty_like(hidden)
        for rows in _runs(hidden.shape[0], weight.shape[0]):
            target, counted = _targets(labels[rows])
            probs = _run_logits(hidden[rows], weight, ctx.bias)
            probs.sub_(probs.amax(dim=1, keepdim=True)).exp_()
            probs.div_(probs.sum(dim=1, keepdim=True))  # softmax, in place
            probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype))  # - onehot(target)
            probs.mul_((grad * counted).unsqueeze(1))  # ignored tokens contribute nothing
            grad_hidden[rows] = probs.to(hidden.dtype) @ weight
            del probs  # before the next run's are made
        return grad_hidden, None, None, None


def _run_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One run's logits in fp32 (the head's output in its dtype lives only until the upcast)."""
    return F.linear(hidden, weight, bias).float()


def _targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's target as a ``(run, 1)`` index, ignored ones pointed at 0; 1.0 where counted, 0.0 not)."""
    counted = labels != IGNORE_INDEX
    return torch.where(counted, labels, 0).unsqueeze(1), counted.float()


def _runs(tokens: int, vocab: int) -> list[slice]:
    step = chunk_tokens(vocab)
    return [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]
