"""Memory planning before a job is launched: the peak of one training step on one rank, at any world size.

    est = fl.estimate_memory(lambda: GPT(cfg), config, world_size=64, rank=0, batch=4, seq=2048)
    est.peak_bytes, est.phase, est.group, est.breakdown

Two methods ([docs/estimate.md](../docs/estimate.md) explains both and where their error comes from):

``simulate`` (default) runs the real fsdp2lite runtime for two steps (a warm-up, so optimizer state
exists, then the measured one) in this process as rank ``rank`` of a ``world_size``-rank job: torch's
fake process group (collectives return at once, with their real shapes) and ``FakeTensorMode`` (every
tensor has its real shape and dtype, no data, no memory), measured with torch's ``MemTracker``. The
runtime is the one that trains, so the groups, buffers, schedule and frees are the real ones.

``analytic`` is a closed form from the plan (``plan_config``: groups, shards, dtypes), the optimizer
and an activation count from one forward of the plain model under ``FakeTensorMode`` (saved tensors,
counted once per storage): instant at any world size, within ~15% of ``simulate``.

``device`` is the target: ``"cuda"`` (NCCL: a native reduce-scatter, CUDA's schedule defaults) or
``"cpu"`` (gloo: the in-place reduction, CPU's defaults). Both run on this machine's CPU; device
memory that the caching allocator reserves beyond the tensors is not counted. With CPU offload in the
config, the peak is the device's: the offloaded groups' shards, gradients and optimizer state are
reported apart, as ``host_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import FSDPConfig
from .analytic import analytic_estimate
from .common import (
    BREAKDOWN_KEYS,
    DEVICES,
    METHODS,
    OPTIMIZERS,
    MemoryEstimate,
    default_config,
    element_size,
    make_optimizer,
    offloaded_share,
    sharded_nbytes,
)
from .finetune import FINETUNES, NF4_BITS, Finetune, as_finetune, planned_factory
from .offload_budget import BudgetPlacement, resolve_offload_budget
from .simulate import simulate_estimate

__all__ = [
    "BREAKDOWN_KEYS",
    "BudgetPlacement",
    "DEVICES",
    "FINETUNES",
    "NF4_BITS",
    "Finetune",
    "METHODS",
    "OPTIMIZERS",
    "MemoryEstimate",
    "default_config",
    "element_size",
    "estimate_memory",
    "make_optimizer",
    "offloaded_share",
    "resolve_offload_budget",
    "sharded_nbytes",
]


def estimate_memory(
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig | None = None,
    *,
    world_size: int,
    rank: int = 0,
    inputs: Callable[[], tuple[Any, ...]] | None = None,
    batch: int = 1,
    seq: int | None = None,
    optimizer: str = "adamw",
    method: str = "simulate",
    device: str = "cuda",
    finetune: Finetune | str | None = None,
) -> MemoryEstimate:
    """The peak bytes of one steady-state training step (forward, loss, backward, optimizer step,
    zero_grad) on rank ``rank`` of ``world_size``, sharded as ``config`` says (default: one group per
    repeated block). Token models get (batch, seq) int64 inputs; others need ``inputs``, a function
    returning one rank's example inputs. No process group may exist: ``simulate`` makes its own.

    ``finetune``: ``"full"`` (default), ``"lora"``, ``"qlora"`` or a ``Finetune`` (rank, targets): the base
    frozen in bf16 with LoRA adapters (qlora: adapted weights in NF4), as ``examples/train.py --finetune``
    trains it. With ``config=None`` a lora/qlora plan is ``finetune_config`` of the default one (bf16
    compute, each block checkpointed); a config given is used as it is."""
    _check_arguments(model_fn, config, world_size, rank, inputs, batch, seq, optimizer, method, device)
    plan = as_finetune(finetune)
    if plan.adapters and config is None:
        from ..finetune.sharding import finetune_config

        with torch.device("meta"):
            config = finetune_config(default_config(model_fn()))
    model_fn = planned_factory(model_fn, plan)
    args = (model_fn, config, world_size, rank, inputs, batch, seq, optimizer, device)
    if method == "analytic":
        return analytic_estimate(*args, finetune=plan)
    return simulate_estimate(*args, finetune=plan)


def _check_arguments(
    model_fn: Any,
    config: Any,
    world_size: Any,
    rank: Any,
    inputs: Any,
    batch: Any,
    seq: Any,
    optimizer: Any,
    method: Any,
    device: Any,
) -> None:
    if not callable(model_fn) or isinstance(model_fn, nn.Module):
        raise TypeError(f"estimate_memory takes a function that builds the model, got {type(model_fn).__name__}")
    if config is not None and not isinstance(config, FSDPConfig):
        raise TypeError(f"config must be an FSDPConfig or None, got {type(config).__name__}")
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank must be in 0 .. {world_size - 1} for world_size {world_size}, got {rank}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ValueError(f"seq must be an int >= 1 or None, got {seq!r}")
    if inputs is not None and not callable(inputs):
        raise TypeError(f"inputs must be a function returning example inputs, got {type(inputs).__name__}")
    for name, value, valid in (
        ("optimizer", optimizer, OPTIMIZERS),
        ("method", method, METHODS),
        ("device", device, DEVICES),
    ):
        if value not in valid:
            raise ValueError(f"{name} must be one of {', '.join(valid)}; got {value!r}")
    if method == "simulate" and dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "estimate_memory(method='simulate') runs its own simulated process group, and one is already "
            "initialized here: call it before init_process_group, in a separate process, or use method='analytic'"
        )
