"""What ``fsdp_pre_all_gather`` returns and how each input comes back from the all-gather: the records
torch's all-gather extension may return, read and checked ([Note: all-gather extension] in extension.py).

[Note: all-gather input records]
An input may be ``AllGatherInput(tensor, dim=0, output_size=None)`` (torch's record after 2.13, here as
``fsdp2lite.AllGatherInput``; any object with a ``tensor`` attribute and optional ``dim`` and
``output_size`` reads the same): each rank's ``tensor`` is concatenated along ``dim`` in its own shape (a
scalar as shape (1,)), and ``post`` sees the result viewed as ``output_size`` (default: the concatenated
shape). The collective is rank-major, so an input gathered along dim d with leading dims of product
``outer`` > 1 is copied out to a staging buffer and reassembled into its output buffer, one strided copy:

    tensor (2, 3) per rank, dim=1, 2 ranks: rank0 [[a b c], [d e f]], rank1 [[g h i], [j k l]]
    all-gather -> [a b c d e f | g h i j k l]  viewed (ranks 2, outer 2, inner 3)
    transpose(0, 1) -> output [[a b c g h i], [d e f j k l]]  = torch.cat(tensors, dim=1)

A plain tensor is gathered along dim 0 (``(shard_size * rows, *rest)``, no reassembly). Each rank's
inputs must have the same shapes and dtypes; unlike plain tensors, records carry no padding rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor


@dataclass(frozen=True)
class AllGatherInput:
    """One input of ``fsdp_pre_all_gather``: ``tensor`` concatenated across ranks along ``dim``, handed
    to ``fsdp_post_all_gather`` viewed as ``output_size`` (default: the concatenated shape). torch's
    record of the same name (newer than torch 2.13); any object with these attributes is read alike:
    [Note: all-gather input records] in ``fsdp2lite/_runtime/extension_inputs.py``."""

    tensor: torch.Tensor
    dim: int = 0
    output_size: tuple[int, ...] | None = None


class PayloadLayout(NamedTuple):
    """How one all-gather input comes back ([Note: all-gather input records])."""

    outer: int  # product of the input's dims before its gather dim: > 1 means reassembly after the copy-out
    output_size: torch.Size  # what fsdp_post_all_gather sees


def check_pre_result(result: Any, fqn: str) -> tuple[list[Any], Any]:
    paired = isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple | list)
    if not paired or not result[0]:
        got = "no inputs" if paired else type(result).__name__
        raise ValueError(
            f"parameter '{fqn}': fsdp_pre_all_gather must return (inputs, metadata), inputs a non-empty tuple of "
            f"plain tensors or AllGatherInput records, got {got}"
        )
    return list(result[0]), result[1]


PLAIN = (torch.Tensor, FakeTensor)  # a plain tensor, or its fake twin when the planner simulates a step


def payload_layout(payload: Any, index: int, group_size: int, fqn: str) -> tuple[torch.Tensor, PayloadLayout]:
    """One pre-all-gather input's tensor and how it comes back: a plain tensor along dim 0, a record
    (``tensor``, ``dim``, ``output_size``) as it says ([Note: all-gather input records])."""
    record = not isinstance(payload, torch.Tensor)
    tensor = getattr(payload, "tensor", None) if record else payload
    what = f"parameter '{fqn}': fsdp_pre_all_gather's input {index}"
    if not isinstance(tensor, torch.Tensor) or type(tensor) not in PLAIN:
        got = type(payload).__name__ if not record else f"{type(payload).__name__} with tensor {type(tensor).__name__}"
        raise ValueError(
            f"{what} must be a plain tensor or an AllGatherInput(tensor, dim, output_size) of one, got {got}"
        )
    size = tensor.shape or torch.Size((1,))  # a scalar gathers as shape (1,)
    dim = getattr(payload, "dim", 0) if record else 0
    if isinstance(dim, bool) or not isinstance(dim, int) or not -len(size) <= dim < len(size):
        raise ValueError(
            f"{what} has dim {dim!r} for a tensor of shape {tuple(size)}; valid: -{len(size)} to {len(size) - 1}"
        )
    dim %= len(size)
    gathered = torch.Size((*size[:dim], group_size * size[dim], *size[dim + 1 :]))
    requested = getattr(payload, "output_size", None) if record else None
    if requested is not None and not (
        isinstance(requested, tuple | list) and all(isinstance(s, int) and s >= 0 for s in requested)
    ):
        raise ValueError(f"{what} has output_size {requested!r}; expected None or a tuple of sizes >= 0")
    output_size = gathered if requested is None else torch.Size(requested)
    if output_size.numel() != gathered.numel():
        raise ValueError(
            f"{what} has output_size {tuple(output_size)} ({output_size.numel()} elements), but {group_size} ranks' "
            f"{tuple(size)} gathered along dim {dim} are {tuple(gathered)} ({gathered.numel()} elements)"
        )
    return tensor, PayloadLayout(math.prod(size[:dim]) if tensor.numel() else 1, output_size)
