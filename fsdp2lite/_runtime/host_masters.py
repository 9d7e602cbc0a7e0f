"""ZeRO-Offload's shape (``CPUOffloadPolicy(optimizer_only=True)``): shards on the device, masters on the host.

[Note: host masters]
``CPUOffloadPolicy()`` moves a group's shards to the host: every all-gather first copies them to the device
(twice a step: forward and backward), and gradients and optimizer state live on the host. With
``optimizer_only=True`` the group keeps its padded shards on the device, where the all-gathers read them as
without offload, and registers on the modules a host copy instead (pinned when asked): the master shard the
optimizer, ``clip_grad_norm_``, ``state_dict`` and checkpoints see. So:
- backward reduce-scatters on the device and copies the reduced gradients to the host in one copy per group
  (as ``CPUOffloadPolicy`` does), into the masters' ``.grad``;
- the user's optimizer steps the masters on the host (its state is created there); the group's masters are
  one host buffer, pinned at its exact size when asked ([Note: one host buffer per group]);
- the first unshard after the masters changed copies them to the device shards, one host-to-device copy
  per parameter per step, where full offload copies every shard twice a step.
Only trainable parameters get a master: a parameter frozen before ``fully_shard`` keeps its shard on the
device with no host copy (LoRA's frozen base costs no host memory).
The masters changed when their version counters (the DTensor's and its local tensor's) moved since the last
copy: ``optimizer.step()``, ``copy_``, ``load_state_dict`` and DCP loads all move them; writes through
``.data`` are not seen: ``model.reshard()`` marks every master stale, so the next forward copies anew.
Device memory then holds the shards (as without offload) and one step's reduced gradients in flight; the
host holds the masters, their gradients and the optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .param import FSDPParam, make_dtensor
from .seams import GroupView
from .zero import ShardWatch


class HostMasterParam(FSDPParam):
    """A parameter whose padded shard stays on the device and whose registered shard is a host copy."""

    host_padded: torch.Tensor  # the master: padded_shard's twin on the host (pinned when asked)

    def __init__(self, param: nn.Parameter, *args: Any, **kwargs: Any) -> None:
        super().__init__(param, *args, **kwargs)
        device = self.mesh_info.device
        if self.padded_shard.device.type not in ("meta", device.type):  # host parameters on a device mesh
            self._adopt_padded_shard(self.padded_shard.to(device))
        self._register_master(self._host_twin(self.padded_shard), param.requires_grad)

    @property
    def grads_on_host(self) -> bool:
        return True

    def _host_twin(self, shard: torch.Tensor) -> torch.Tensor:
        """A pageable host copy of ``shard``: the group packs its masters into one buffer, the one it pins
        ([Note: one host buffer per group])."""
        if shard.device.type == "meta":
            return torch.empty_like(shard)
        return torch.empty(shard.shape, dtype=shard.dtype).copy_(shard)

    def _register_master(self, host: torch.Tensor, requires_grad: bool) -> None:
        self.host_padded = host
        local = host.narrow(self.shard_dim, 0, self.local_rows)
        sharded = nn.Parameter(make_dtensor(local, self.sharded_spec), requires_grad=requires_grad)
        self.local_view = sharded._local_tensor  # type: ignore[attr-defined]  # nn.Parameter detached it
        self.sharded_param = sharded  # type: ignore[assignment]
        self._set_on_modules(sharded)

    def shard_full_tensor(self, full: torch.Tensor) -> DTensor:
        """This rank's rows of a full value, on the host like the master (no communication)."""
        start = min(self.mesh_info.shard_rank * self.padded_rows, full.shape[self.shard_dim])
        local = full.detach().narrow(self.shard_dim, start, self.local_rows)
        return make_dtensor(local.to("cpu", self.orig_dtype), self.sharded_spec)

    def reset_sharded_param(self) -> bool:
        """A new local tensor (``to_empty``, ``module.to``, an assigning load) becomes the master: copied into a
        host buffer of its dtype, with a device shard of that dtype beside it (filled at the next unshard)."""
        local = self._new_local()
        if local is None:
            return False
        device = self.mesh_info.device if local.device.type != "meta" else local.device
        shard = torch.zeros(self.padded_shape, dtype=local.dtype, device=device)
        if device.type != "meta" and self.local_rows:
            shard.narrow(self.shard_dim, 0, self.local_rows).copy_(local.detach())
        self._adopt_padded_shard(shard)
        self.host_padded = self._host_twin(shard)
        self.local_view = self.host_padded.narrow(self.shard_dim, 0, self.local_rows)
        self.sharded_param._local_tensor = self.local_view  # type: ignore[attr-defined]
        if local.dtype != self.orig_dtype:
            self._retype(local.dtype)
        self.unsharded_flat = self.unsharded_local = self.unsharded_param = self.all_gather_view = None
        return True


class HostSync:
    """A ``optimizer_only`` group's masters and the freshness of its device shards ([Note: host masters])."""

    def __init__(self, group: GroupView) -> None:
        self.group = group
        self.watch = ShardWatch([p for p in group.params if isinstance(p, HostMasterParam)])  # frozen: none
        self.copies = 0  # host-to-device copies of a whole group (tests and trace read it)
        self.copied_bytes = 0

    def invalidate(self) -> None:
        self.watch.stale = True  # every device shard copied from its master at the next unshard

    def refresh(self) -> None:
        """Copy to the device the masters that changed since their last copy (none: nothing)."""
        due = self.watch.due()
        for param in due:
            param.padded_shard.copy_(param.host_padded, non_blocking=param.host_padded.is_pinned())
            self.copied_bytes += param.host_padded.nbytes
        if due:
            self.copies += 1
            self.group.trace("host_to_device_masters")
        self.watch.record()
