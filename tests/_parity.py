"""Parity against DDP: the same model, data and optimizer, compared at every step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from _dist import cpu_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

RTOL, ATOL = 1e-4, 1e-6

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def torch_shard(model: nn.Module, mesh: DeviceMesh | None = None, **kwargs: Any) -> nn.Module:
    """The oracle: torch's own ``fully_shard`` on each of ``model.blocks``, then the root, on ``mesh``
    (default: a CPU mesh over the default group; ``kwargs`` as torch takes them, e.g. ``mp_policy``).
    Never torch's own default: without a mesh it picks CUDA whenever CUDA is present, even on a gloo
    group, and gloo's all-gather into CUDA tensors reads device memory from the host (SIGSEGV in
    ``gloo::allgather``, pytorch/pytorch#152645): the likeliest cause of the checkpoint test's crash on a
    machine with a GPU (issue 10)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = mesh or cpu_mesh()
    for block in model.blocks:  # type: ignore[union-attr]
        torch_fully_shard(block, mesh=mesh, **kwargs)
    torch_fully_shard(model, mesh=mesh, **kwargs)
    return model


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_params_match(model: nn.Module, ref: nn.Module, what: str, grads: bool) -> None:
    named = dict(model.named_parameters())
    ref_named = dict(ref.named_parameters())
    assert list(named) == list(ref_named), f"{what}: parameter names differ"
    for name, param in named.items():
        ref_param = ref_named[name]
        mine = full(param.grad) if grads else full(param)
        theirs = ref_param.grad if grads else ref_param.detach()
        if theirs is None:
            assert mine is None, f"{what}: {name} has a grad, DDP has none"
            continue
        assert mine is not None, f"{what}: {name} has no grad, DDP has one"
        torch.testing.assert_close(
            mine, theirs, rtol=RTOL, atol=ATOL, msg=lambda m, what=what, name=name: f"{what} {name}: {m}"
        )


def train_and_compare(
    model: nn.Module,
    shard: Callable[[nn.Module], None],
    batch_fn: Callable[[int, int], Batch],
    loss_fn: LossFn,
    rank: int,
    *,
    steps: int = 4,
    microbatches: int = 1,
    clip_norm: float | None = None,
    ref: nn.Module | None = None,
    label: str = "",
) -> None:
    """Train ``model`` sharded by ``shard`` and a DDP copy side by side; compare every step.

    ``microbatches`` > 1 accumulates with gradient sync off (fsdp2lite) / ``no_sync`` (DDP) for all
    but the last microbatch. ``ref`` is the unsharded starting point (default: a copy of ``model``).
    """
    ddp = DDP(copy.deepcopy(model) if ref is None else ref)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        what = f"{label} step {step}"
        for micro in range(microbatches):
            batch = batch_fn(step * microbatches + micro, rank)
            last = micro == microbatches - 1
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
            loss = loss_fn(model, batch)
            loss.backward()
            if last:
                ref_loss = loss_fn(ddp, batch)
                ref_loss.backward()
            else:
                with ddp.no_sync():
                    ref_loss = loss_fn(ddp, batch)
                    ref_loss.backward()
            torch.testing.assert_close(
                loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m, what=what: f"{what} loss: {m}"
            )
        if clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip_norm)
            assert ref_norm > clip_norm, f"{what}: clip threshold too high to test clipping"
            torch.testing.assert_close(full(norm), ref_norm, rtol=RTOL, atol=ATOL)
        assert_params_match(model, ddp.module, f"{what} grads", grads=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_params_match(model, ddp.module, f"{what} params", grads=False)
