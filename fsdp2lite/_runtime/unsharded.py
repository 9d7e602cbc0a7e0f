"""A parameter's unsharded storage (the parameter holds it as ``unsharded``): the padded storage, made once and
refilled at every unshard, and the Parameter the modules hold in each state ([Note: unsharded storage]).

[Note: unsharded storage]
Resharding frees the unsharded parameter's storage (resize to 0 bytes) and unsharding re-allocates
and refills it, so the Parameter object and every tensor autograd saved from it stay valid: they see
the data again once the group is unsharded for backward. The refill writes through views made once
(not through the Parameter), so the parameter's version counter does not move (the values are the
same ones autograd saved). The storage is padded: shard_size * padded_numel elements, laid out like
the all-gather's rank-major output (rank r's padded shard at [r * padded_numel, (r + 1) * padded_numel)),
and the Parameter is its first numel elements viewed as the original shape (where the gathered rows are the
parameter followed by padding, ``layout.gathered_is_contiguous``; else storage of its own, filled from it by
``finish_copy_out``: [Note: padded shard] in layout.py). The all-gather copy-out is then one
``split_with_sizes_copy`` for the whole group, whatever the padding.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..mesh import MeshInfo
from .extension import contiguous_stride, ensure_allocated
from .gather_units import GatherUnit
from .layout import ShardLayout


def make_dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor around ``local`` with a spec built once: no checks, no communication, and ``local``
    stays where it is (``DTensor.from_local`` would move a host shard to a CUDA mesh's device)."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)  # DTensor.__init__ does nothing: skipped


class UnshardedOwner(Protocol):
    """What an unsharded storage reads of its ``param.FSDPParam`` (which imports this module: no import back)."""

    fqn: str
    mesh_info: MeshInfo
    orig_shape: torch.Size
    tp_spec: DTensorSpec | None
    gather_shape: torch.Size
    layout: ShardLayout
    sharded_param: DTensor
    param_dtype: torch.dtype
    unit: GatherUnit

    @property
    def device(self) -> torch.device: ...

    def set_on_modules(self, tensor: torch.Tensor) -> None: ...


class UnshardedStorage:
    """One parameter's unsharded storage (the parameter holds it as ``unsharded``): its allocation and copy-out,
    and the two registrations (``to_unsharded``, ``to_sharded``) the group's state machine calls."""

    unsharded_flat: torch.Tensor | None  # (shard_size * padded_numel,) padded storage: [Note: unsharded storage]
    unsharded_local: torch.Tensor | None  # the unsharded values in gather_shape (a DTensor's local under TP)
    unsharded_param: nn.Parameter | None  # holds unsharded_local (or a tp DTensor of it), kept across steps
    all_gather_view: torch.Tensor | None  # unsharded_flat as (shard_size, padded_numel): copy-out target

    def __init__(self, param: UnshardedOwner) -> None:
        self.param = param
        self.discard()

    def discard(self) -> None:
        """Forget the storage and the Parameter viewing it: the next unshard makes them anew (a shard renewed on
        another device or in another dtype, a parameter's all-gather hooks changed)."""
        self.unsharded_flat = self.unsharded_local = self.unsharded_param = self.all_gather_view = None

    # ---- state transitions ----------------------------------------------------------------
    def alloc(self) -> torch.Tensor:
        """Allocate the padded unsharded storage; returns it flat, ``(shard_size * padded_numel,)``.

        The first call creates the storage, the Parameter viewing it and the copy-out view; later calls
        only give the storage its bytes back ([Note: unsharded storage]). Where the gathered rows are not the
        parameter followed by padding (sharded on a dim other than 0, or aligned: ``layout.gathered_is_contiguous``),
        the flat storage is a rank-major scratch the all-gather is copied out to, and the parameter has
        storage of its own in ``gather_shape`` (``finish_copy_out`` moves the values over)."""
        p = self.param
        if self.unsharded_flat is None:
            shard_size, padded_numel = p.mesh_info.shard_size, p.layout.padded_numel
            storage = torch.empty(shard_size * padded_numel, dtype=p.param_dtype, device=p.device)
            if p.layout.gathered_is_contiguous:
                local = storage[: p.gather_shape.numel()].view(p.gather_shape)
            else:
                local = torch.empty(p.gather_shape, dtype=p.param_dtype, device=p.device)
            self.unsharded_local = local
            # requires_grad: the sharded parameter's, the one users see ([Note: frozen])
            self.unsharded_param = nn.Parameter(self._tensor(local), requires_grad=p.sharded_param.requires_grad)
            # ``.data``: the same storage with a version counter of its own, so refills written through
            # it (and its views) are not in-place modifications in autograd's eyes
            self.unsharded_flat = storage.data
            self.all_gather_view = self.unsharded_flat.view(shard_size, padded_numel)
            return self.unsharded_flat
        ensure_allocated(self.unsharded_flat)
        if self.unsharded_local is not None and not p.layout.gathered_is_contiguous:
            ensure_allocated(self.unsharded_local)
        return self.unsharded_flat

    def _tensor(self, local: torch.Tensor) -> torch.Tensor:
        """What the modules see unsharded: ``local``, or under TP a DTensor of it on the tp mesh."""
        p = self.param
        spec = p.tp_spec
        if spec is None:
            return local
        meta = TensorMeta(p.orig_shape, contiguous_stride(p.orig_shape), p.param_dtype)
        return make_dtensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta))

    def copy_out_view(self, group_size: int, padded_numel: int) -> torch.Tensor:
        """Where a ``group_size``-rank all-gather with ``padded_numel`` elements per rank is copied out:
        the cached ``(shard_size, padded_numel)`` view for the shard group, else (a post-forward group
        of k ranks, [Note: post-forward reshard]) the first ``group_size * padded_numel`` elements."""
        flat = self.alloc()
        if group_size == self.param.mesh_info.shard_size and self.all_gather_view is not None:
            return self.all_gather_view
        return flat[: group_size * padded_numel].view(group_size, padded_numel)

    def finish_copy_out(self) -> None:
        """Gathered rows that are not the parameter followed by padding (sharded on a dim d != 0, or aligned):
        move the rank-major copy-out (rank r's padded chunk at row r) into the parameter, chunks side by side
        along d (``layout.from_rank_major``), and free the scratch. Nothing to do otherwise: the copy-out
        wrote the parameter itself."""
        layout = self.param.layout
        if layout.gathered_is_contiguous or self.unsharded_flat is None or self.unsharded_local is None:
            return
        layout.from_rank_major(self.unsharded_flat, self.unsharded_local.data)
        self.unsharded_flat.untyped_storage().resize_(0)

    def to_unsharded(self) -> None:
        """Register the (already filled) unsharded parameter on the modules (only the group's
        ``ShardedStates.to_unsharded`` calls it: the group's state is the parameters')."""
        unsharded, sharded = self.unsharded_param, self.param.sharded_param
        if unsharded is None:
            raise RuntimeError(f"{self.param.fqn}: to_unsharded() before its storage was allocated")
        if unsharded.requires_grad != sharded.requires_grad:  # [Note: frozen]
            unsharded.requires_grad_(sharded.requires_grad)
        self.param.set_on_modules(unsharded)

    def to_sharded(self, keep: bool = False) -> None:
        """Register the sharded DTensor on the modules and free the unsharded storage (``keep``: not)."""
        self.param.set_on_modules(self.param.sharded_param)
        if keep:  # a resident group's storage stays for its next forward: [Note: resident groups]
            return
        self.param.unit.free()  # a hooked parameter's output buffers: [Note: gather units]
        if self.unsharded_flat is not None:
            self.unsharded_flat.untyped_storage().resize_(0)  # [Note: unsharded storage]
        if self.unsharded_local is not None and not self.param.layout.gathered_is_contiguous:
            self.unsharded_local.untyped_storage().resize_(0)

    def zeros(self) -> torch.Tensor:
        """Zeros in the unsharded gradient's shape and dtype: what an unused parameter contributes
        (``set_reduce_scatter_unused_params``)."""
        p = self.param
        return torch.zeros(p.gather_shape, dtype=p.param_dtype, device=p.device)
