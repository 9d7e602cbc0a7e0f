"""The all-gather-extension half of ``FSDPParam``: a parameter whose local tensor defines torch's all-gather hooks
(a tensor subclass such as torchao's NF4): its hooks looked up, its inputs made, its unsharded tensor rebuilt
([Note: all-gather extension], [Note: hooks looked up per all-gather] in extension.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..mesh import MeshInfo
from .extension import AllGatherExtension, find_hooks
from .layout import ShardLayout


class HookState:
    """What ``FSDPParam`` does with a parameter's all-gather extension hooks."""

    fqn: str
    extension: AllGatherExtension | None
    sharded_param: Any  # an nn.Parameter holding a DTensor
    padded_shard: torch.Tensor
    flat_shard: torch.Tensor
    offload_to_cpu: bool
    places: tuple[Any, ...]  # ParamPlace
    mesh_info: MeshInfo
    orig_shape: torch.Size
    mp_policy: Any
    param_dtype: torch.dtype
    shard_dim: int
    layout: ShardLayout
    tp_spec: DTensorSpec | None
    unsharded_flat: torch.Tensor | None
    unsharded_local: torch.Tensor | None
    unsharded_param: nn.Parameter | None
    all_gather_view: torch.Tensor | None

    def extension_inputs(self) -> list[torch.Tensor]:
        """This rank's all-gather inputs from the subclass's pre-all-gather hook (flat, plain tensors)."""
        if self.extension is None:
            raise RuntimeError(f"{self.fqn}: extension_inputs() on a parameter without all-gather hooks")
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]  # where the hooks are looked up
        module = self.places[0].module
        shard = self.padded_shard  # offloaded: its copy on the device ([Note: offloaded hooked parameters])
        if self.offload_to_cpu:
            shard = self.extension.to_device(shard, self.mesh_info.device)  # the compute device
        mesh, shape = self.mesh_info.shard_mesh, self.orig_shape
        return self.extension.inputs(shard, local, mesh, shape, module=module, mp_policy=self.mp_policy)

    def sync_extension(self, quantized: bool) -> bool:
        """Look the all-gather hooks up on the local tensor, as torch does at every all-gather, so hooks set
        or removed after ``fully_shard`` take effect; True when they changed, and then the parameter gathers
        the new way, its unsharded tensor made anew ([Note: hooks looked up per all-gather])."""
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        pre, post = find_hooks(local)
        current = self.extension
        if current.same_hooks(pre, post) if current is not None else pre is None and post is None:
            return False
        extension = AllGatherExtension(local, self.fqn) if pre is not None or post is not None else None
        if extension is not None:  # raises before anything changes
            extension.check_supported(self.shard_dim, self.tp_spec is not None, quantized, self.layout.align > 1)
        self.extension = extension
        self.flat_shard = self.padded_shard if extension is not None else self.padded_shard.view(-1)
        self.unsharded_flat = self.unsharded_local = self.unsharded_param = self.all_gather_view = None
        return True

    def finish_extension(self) -> None:
        """After the copy-out into the extension's output buffers: build or refill the unsharded tensor."""
        if self.extension is None:
            raise RuntimeError(f"{self.fqn}: finish_extension() on a parameter without all-gather hooks")
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        made = self.extension.unsharded(local, self.param_dtype, self.orig_shape, self.unsharded_param)
        if made is not None:
            self.unsharded_param = nn.Parameter(made, requires_grad=self.sharded_param.requires_grad)
