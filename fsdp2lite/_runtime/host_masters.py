"""ZeRO-Offload's shape (``CPUOffloadPolicy(optimizer_only=True)``): shards on the device, masters on the host.

[Note: host masters]
``CPUOffloadPolicy()`` moves a group's shards to the host: every all-gather first copies them to the device
(twice a step: forward and backward), and gradients and optimizer state live on the host. With
``optimizer_only=True`` the group keeps its padded shards on the device, where the all-gathers read them as
without offload, and registers on the modules a host copy instead (pinned when asked): the master shard the
optimizer, ``clip_grad_norm_``, ``state_dict`` and checkpoints see. So:
- backward reduce-scatters on the device and copies the reduced gradients to the host in one copy per group
  (as ``CPUOffloadPolicy`` does, by the same ``HostShards`` that ``HostSync`` holds: [Note: host storage]), into
  the masters' ``.grad``;
- the user's optimizer steps the masters on the host (its state is created there); the group's masters are
  one host buffer, pinned at its exact size when asked ([Note: one host buffer per group]), that ``HostShards``;
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

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .host_storage import HostShards
from .param import FSDPParam, ShardStorage
from .seams import GroupView, ReducedGrads
from .zero import ShardRefresher, ShardWatch


class HostMasters(ShardStorage):
    """The storage of a trainable parameter under ``optimizer_only``: its padded shard stays on the device, its
    registered shard is a host copy, the master ([Note: host masters], [Note: shard storage])."""

    grads_on_host = True
    host_padded: torch.Tensor  # the master: padded_shard's twin on the host (pinned by the group's buffer)

    def register(self, param: FSDPParam) -> tuple[torch.Tensor, DTensorSpec]:
        device = param.mesh_info.device
        if param.padded_shard.device.type not in ("meta", device.type):  # host parameters on a device mesh
            param.adopt_shard(param.padded_shard.to(device))
        self.host_padded = _host_twin(param.padded_shard)
        return self.host_padded.narrow(param.shard_dim, 0, param.layout.local_rows), param.sharded_spec

    def host_tensor(self, param: FSDPParam) -> torch.Tensor | None:
        return self.host_padded

    def adopt_host(self, param: FSDPParam, view: torch.Tensor) -> None:
        self.host_padded = view
        param.register_view(view.narrow(param.shard_dim, 0, param.layout.local_rows))

    def local_of_full(self, param: FSDPParam, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full value, on the host like the master (no communication)."""
        return param.layout.local_of(full.detach()).to("cpu", param.orig_dtype)

    def renew(self, param: FSDPParam, local: torch.Tensor) -> bool:
        """A new local tensor (``to_empty``, ``module.to``, an assigning load) becomes the master: copied into a
        host buffer of its dtype, with a device shard of that dtype beside it (filled at the next unshard)."""
        device = param.mesh_info.device if local.device.type != "meta" else local.device
        shard = torch.zeros(param.padded_shape, dtype=local.dtype, device=device)
        if device.type != "meta" and param.layout.local_rows:
            shard.narrow(param.shard_dim, 0, param.layout.local_rows).copy_(local.detach())
        param.adopt_shard(shard)
        self.host_padded = _host_twin(shard)
        param.register_view(self.host_padded.narrow(param.shard_dim, 0, param.layout.local_rows))
        return True


def _host_twin(shard: torch.Tensor) -> torch.Tensor:
    """A pageable host copy of ``shard``: the group packs its masters into one buffer, the one it pins
    ([Note: one host buffer per group])."""
    if shard.device.type == "meta":
        return torch.empty_like(shard)
    return torch.empty(shard.shape, dtype=shard.dtype).copy_(shard)


def master(param: FSDPParam) -> torch.Tensor:
    """The host master of a parameter with ``HostMasters`` storage."""
    storage = param.storage
    if not isinstance(storage, HostMasters):
        raise RuntimeError(f"{param.fqn}: a host master asked of a parameter without one")
    return storage.host_padded


class HostSync(ShardRefresher):
    """A ``optimizer_only`` group's masters and the freshness of its device shards ([Note: host masters])."""

    host: HostShards  # the masters' one host buffer ([Note: host storage] in host_storage.py)

    def __init__(self, group: GroupView, host: HostShards) -> None:
        self.group, self.host = group, host  # packed first: the watch records the masters' versions in it
        self.watch = ShardWatch([p for p in group.params if p.storage.grads_on_host])  # frozen ones have none
        self.copies = 0  # host-to-device copies of a whole group (tests and trace read it)
        self.copied_bytes = 0

    def on_reset(self, renewed: bool) -> None:
        self.host.on_reset(renewed)  # renewed masters: packed anew
        super().on_reset(renewed)

    def after_reduce(self, reduced: ReducedGrads, reads_now: bool) -> ReducedGrads:
        return self.host.after_reduce(reduced, reads_now)  # into the masters' .grad, on the host

    def end_backward(self) -> None:
        self.host.end_backward()

    def refresh(self) -> None:
        """Copy to the device the masters that changed since their last copy (none: nothing)."""
        due = self.watch.due()
        for param in due:
            host = master(param)
            param.padded_shard.copy_(host, non_blocking=host.is_pinned())
            self.copied_bytes += host.nbytes
        if due:
            self.copies += 1
            self.group.trace("host_to_device_masters")
        self.watch.record()
