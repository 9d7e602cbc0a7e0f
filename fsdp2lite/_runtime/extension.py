"""torch's all-gather extension protocol: a parameter whose local tensor (a tensor subclass such as
torchao's NF4 or float8 weights) chooses what is all-gathered and how the unsharded tensor is rebuilt.

[Note: all-gather extension]
The subclass defines two methods, as with torch's ``fully_shard``:

    fsdp_pre_all_gather(mesh[, outer_size, outer_stride, module, mp_policy]) -> (inputs, metadata)
    fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (unsharded, inner_tensors) | None

Per unshard, ``pre`` is called on this rank's padded shard (torch calls it on the unpadded shard and
requires padded inputs back when the shard is uneven, which a hook with per-row scales cannot give);
its ``inputs`` (plain tensors) join the group's one collective as bytes
([Note: byte all-gather] in collectives.py), so a group of NF4 weights and bf16 norms is still one
all-gather, and 1-byte dtypes (int8, float8) cross gloo as uint8. The gathered bytes land in this
parameter's own output buffers, one per input, ``(shard_size * numel,)`` in the input's dtype, made once
and kept across steps (their storage freed at reshard, given back at unshard). ``post`` then sees each
output viewed ``(shard_size * rows, *rest)``: the first time it builds the unsharded tensor (torchao's
NF4 builds it on those very buffers), later it refills it in place (``out=``), so the Parameter object
autograd and the modules hold stays the same. Which form ``pre`` takes (1 or 5 arguments) is resolved
once, when the parameter is sharded. Dim-0 sharding only, no tensor parallelism or CPU offload (each
refused at ``fully_shard``, naming the parameter).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn


def has_extension(local: torch.Tensor) -> bool:
    """Whether ``local`` defines torch's all-gather extension hooks (``fsdp_pre_all_gather``)."""
    return hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather")


class AllGatherExtension:
    """The hooks of one parameter's local tensor and the buffers its all-gather outputs live in."""

    fqn: str
    takes_mesh_only: bool  # the 1-argument form (torchao's NF4) rather than torch 2.6+'s 5-argument one
    metadata: Any  # what the last pre_all_gather returned beside its inputs, for post_all_gather
    input_sizes: list[torch.Size]  # per input, as pre_all_gather returned it
    outputs: list[torch.Tensor]  # per input, (shard_size * numel,) in its dtype; kept across steps
    inner_tensors: tuple[torch.Tensor, ...]  # what post_all_gather said to free at reshard

    def __init__(self, local: torch.Tensor, fqn: str) -> None:
        pre, post = getattr(local, "fsdp_pre_all_gather", None), getattr(local, "fsdp_post_all_gather", None)
        if pre is None or post is None:
            missing = "fsdp_post_all_gather" if pre is not None else "fsdp_pre_all_gather"
            raise ValueError(
                f"parameter '{fqn}' ({type(local).__name__}) defines only one of fsdp_pre_all_gather and "
                f"fsdp_post_all_gather (no {missing}); torch's all-gather extension needs both"
            )
        names = list(inspect.signature(pre).parameters)
        if len(names) not in (1, 5):
            raise ValueError(
                f"parameter '{fqn}' ({type(local).__name__}): fsdp_pre_all_gather({', '.join(names)}) takes "
                f"{len(names)} arguments; expected (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)"
            )
        self.fqn = fqn
        self.takes_mesh_only = len(names) == 1
        self.metadata = None
        self.input_sizes = []
        self.outputs = []
        self.inner_tensors = ()

    def check_supported(self, shard_dim: int, tensor_parallel: bool, offload: bool) -> None:
        """Such a parameter is sharded on dim 0, on the device, without tensor parallelism."""
        problem = (
            f"shard_placement_fn chose Shard({shard_dim})" if shard_dim != 0
            else "it is also tensor parallel" if tensor_parallel
            else "CPU offload is on" if offload
            else None
        )  # fmt: skip
        if problem is not None:
            raise ValueError(
                f"parameter '{self.fqn}' defines torch's all-gather extension (fsdp_pre_all_gather), but {problem}: "
                "such parameters are sharded on dim 0, without tensor parallelism or CPU offload"
            )

    def shard(self, data: torch.Tensor, mesh_info: Any, padded_shape: tuple[int, ...], rows: int) -> torch.Tensor:
        """This rank's padded shard, made by the subclass's own ops (``torch.chunk``, ``new_zeros``,
        slicing, ``copy_``, as torch's fully_shard makes it), so the shard is a subclass tensor too."""
        chunks = torch.chunk(data.detach(), mesh_info.shard_size, dim=0)
        return self.pad(chunks[mesh_info.shard_rank] if rows else chunks[0], padded_shape, rows)

    @staticmethod
    def pad(local: torch.Tensor, padded_shape: tuple[int, ...], rows: int) -> torch.Tensor:
        """``local``'s first ``rows`` rows in a zeroed tensor of ``padded_shape``, of the subclass."""
        padded = local.new_zeros(padded_shape)
        if rows:
            padded[:rows].copy_(local[:rows])
        return padded

    def inputs(
        self, padded_shard: torch.Tensor, mesh: Any, shape: torch.Size, module: nn.Module, mp_policy: Any
    ) -> list[torch.Tensor]:
        """This rank's all-gather inputs, flat (one view each), from the subclass's pre-all-gather hook,
        called on the padded shard: every rank's inputs then have the same shapes, and under torch.chunk's
        layout the gathered rows are the parameter's followed by the padding, which the rebuild cuts off."""
        if self.takes_mesh_only:
            result = padded_shard.fsdp_pre_all_gather(mesh)  # type: ignore[attr-defined]
        else:
            stride = contiguous_stride(shape)
            result = padded_shard.fsdp_pre_all_gather(mesh, shape, stride, module, mp_policy)  # type: ignore[attr-defined]
        inputs, self.metadata = _check_pre_result(result, self.fqn)
        self.input_sizes = [t.shape for t in inputs]
        flat = [t.contiguous().view(-1) for t in inputs]
        self._prepare_outputs(mesh.size(), flat)
        return flat

    def _prepare_outputs(self, group_size: int, inputs: list[torch.Tensor]) -> None:
        """One output buffer per input, made the first time (or when the hook's inputs change), given its
        storage back on later unshards ([Note: all-gather extension])."""
        if len(self.outputs) != len(inputs) or any(
            o.dtype != i.dtype or o.numel() != group_size * i.numel() for o, i in zip(self.outputs, inputs)
        ):
            self.outputs = [torch.empty(group_size * i.numel(), dtype=i.dtype, device=i.device) for i in inputs]
        for output in self.outputs:
            ensure_allocated(output)

    def output_views(self, group_size: int) -> list[torch.Tensor]:
        """Each output buffer as ``(group_size, bytes per rank)`` uint8: the copy-out's targets."""
        return [output.view(torch.uint8).view(group_size, -1) for output in self.outputs]

    def unsharded(
        self, local: torch.Tensor, param_dtype: torch.dtype, orig_shape: torch.Size, current: nn.Parameter | None
    ) -> torch.Tensor | None:
        """Run post_all_gather on the gathered outputs: the first time, the new unsharded tensor (its
        padding rows cut off); after that, ``current`` refilled in place and None."""
        gathered = tuple(o.view(-1, *size[1:]) for o, size in zip(self.outputs, self.input_sizes))
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        if current is not None:
            for tensor in self.inner_tensors:
                ensure_allocated(tensor)
            post(gathered, self.metadata, param_dtype, out=current)
            return None
        result = post(gathered, self.metadata, param_dtype)
        if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], torch.Tensor):
            raise ValueError(
                f"parameter '{self.fqn}': fsdp_post_all_gather must return (unsharded tensor, tensors to free), "
                f"got {type(result).__name__}"
            )
        unsharded, self.inner_tensors = result[0], tuple(result[1])
        if unsharded.shape[0] < orig_shape[0] or tuple(unsharded.shape[1:]) != tuple(orig_shape[1:]):
            raise ValueError(
                f"parameter '{self.fqn}': fsdp_post_all_gather returned shape {tuple(unsharded.shape)}, which "
                f"does not hold the parameter's {tuple(orig_shape)}"
            )
        return torch.as_strided(unsharded, orig_shape, contiguous_stride(orig_shape), 0)

    def reallocate(self) -> None:
        """Give the output buffers their storage back for a regather of the kept inputs (a post-forward
        group's), which reuses the last pre-all-gather's metadata: [Note: post-forward reshard]."""
        for output in self.outputs:
            ensure_allocated(output)

    def free(self) -> None:
        """Reshard: the output buffers and the tensors post_all_gather named give their memory back."""
        for tensor in (*self.outputs, *self.inner_tensors):
            tensor.untyped_storage().resize_(0)


def _check_pre_result(result: Any, fqn: str) -> tuple[list[torch.Tensor], Any]:
    if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], tuple | list):
        raise ValueError(
            f"parameter '{fqn}': fsdp_pre_all_gather must return (tuple of tensors, metadata), "
            f"got {type(result).__name__}"
        )
    inputs = list(result[0])
    if not inputs or not all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in inputs):
        kinds = [type(t).__name__ for t in inputs]
        raise ValueError(f"parameter '{fqn}': fsdp_pre_all_gather's inputs must be plain tensors, got {kinds}")
    return inputs, result[1]


def ensure_allocated(tensor: torch.Tensor) -> None:
    untyped = tensor.untyped_storage()
    nbytes = int((tensor.storage_offset() + tensor.numel()) * tensor.element_size())
    if untyped.size() < nbytes:
        untyped.resize_(nbytes)


def contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
