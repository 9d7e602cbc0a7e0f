"""A group's gradients on both sides of its reduction: taken from autograd for the copy-in, stored as the
sharded parameters' DTensor gradients after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .comm import Comm
from .param import FSDPParam, make_dtensor
from .seams import GroupStorage, HostSide, ReducedGrads


def take_unsharded_grads(
    group_params: tuple[FSDPParam, ...], zeros_for_unused: bool
) -> tuple[list[FSDPParam], list[torch.Tensor]]:
    """The parameters of a group with a gradient this backward, and their unsharded gradients
    (``zeros_for_unused``: zeros for trainable parameters that got none, ``set_reduce_scatter_unused_params``).
    The reduce form brings them to its reduce dtype ([Note: one reduce dtype]). A gradient whose padded chunks
    are not torch.chunk's along dim 0 (sharded on another dim, or aligned) comes laid out rank-major,
    ``(shard_size, padded_numel)``, so that the copy-in's dim-0 chunking gives each rank its padded chunk."""
    params: list[FSDPParam] = []
    grads: list[torch.Tensor] = []
    for param in group_params:
        grad = param.grads.take() if param.requires_grad else None
        if grad is None and param.requires_grad and zeros_for_unused:
            grad = param.unsharded.zeros()  # the same collective on every rank, whatever it used
        if grad is not None:
            params.append(param)
            grads.append(grad if param.layout.gathered_is_contiguous else param.layout.rank_major(grad))
    return params, grads


def run_all_reduce_hook(
    hook: Callable[[torch.Tensor], None], stream: torch.cuda.Stream | None, output: torch.Tensor
) -> None:
    """The user's hook on the group's reduced flat gradient (averaged over the data-parallel ranks, or
    divided by the set factor), on ``stream`` if one was given (CUDA), ordered both ways with the compute
    stream."""
    if stream is None:
        hook(output)
        return
    current = torch.cuda.current_stream(output.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(output)
    current.wait_stream(stream)


def accumulate_sharded_grads(
    output: torch.Tensor,
    params: tuple[FSDPParam, ...],
    comm: Comm,
    host: HostSide,
    storages: tuple[GroupStorage, ...],
    group: str = "<root>",
) -> None:
    """Add this rank's reduced ``(group_numel,)`` gradients into each parameter's DTensor ``.grad`` (of group
    ``group``: its name in traces), then run their post-accumulate-grad hooks.

    Gradients are stored in the parameters' own dtype (one cast of the whole output), where the group's storages
    put them once the reduction is final (``after_reduce``: on the host under CPU offload, one non-blocking copy
    of the whole output, [Note: host storage] in host_storage.py; next to the device shards otherwise). A new
    gradient is an ``as_strided`` view of the output that skips the slot's padding rows; an existing one (no
    ``zero_grad`` in between) gets the new one added.
    """
    host.wait_for(p.sharded_param for p in params)  # a host step in flight reads these grads: [Note: the host engine]
    first = params[0]
    uniform = all(p.orig_dtype == first.orig_dtype for p in params)
    reduced = ReducedGrads(output.to(first.orig_dtype) if uniform else output, None)  # no-op in the params' dtype
    if storages:  # where the group's storages keep them: [Note: group storage]
        # adding into kept gradients and casting mixed dtypes read the stored gradients on the host right away
        reads_now = not uniform or any(param.sharded_param.grad is not None for param in params)
        for storage in storages:
            reduced = storage.after_reduce(reduced, reads_now)
    existing: list[torch.Tensor] = []
    new: list[torch.Tensor] = []
    flat = reduced.flat
    offset = flat.storage_offset()
    for param in params:
        local = flat.as_strided(param.local_shape, param.grad_stride, offset)  # (local_rows, *rest)
        offset += param.reduced_numel
        if not uniform:
            local = local.to(param.orig_dtype)
        current = param.sharded_param.grad
        if current is None:
            param.sharded_param.grad = make_dtensor(local, param.sharded_spec)
        else:
            existing.append(current._local_tensor)  # type: ignore[attr-defined]
            new.append(local)
    if existing:
        torch._foreach_add_(existing, new)
    host.run_grad_hooks([param.sharded_param for param in params], reduced.copy_event, group, comm.device)
