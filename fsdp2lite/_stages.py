"""``fully_shard(..., sharding=)``: the ZeRO stage of each mesh axis, checked and applied; and where the
optimizer steps (``CPUOffloadPolicy(optimizer_only=True)``).

``ShardingPolicy(shard=...)`` picks the shard axis's stage (``params``: ZeRO-3, ``optimizer``: ZeRO-1/2, a
resident group, [Note: resident groups]); ``ShardingPolicy(replicate=...)`` the replicate axis's (``none``:
HSDP, ``optimizer``: HFSDP, a replica-sharded group, [Note: replica-sharded groups]). ``optimizer_only``
offload keeps the shards on the device and the masters on the host ([Note: host masters]); ``optimizer="nvme"``
keeps the optimizer state in files between steps ([Note: optimizer state on NVMe]). Every check here
runs before anything is sharded and names the value, the parameter or the mesh, and what would be valid.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._runtime.extension import has_extension
from ._runtime.group import FSDPParamGroup
from ._runtime.host_masters import HostMasters, HostSync
from ._runtime.param import ParamPolicy, ShardStorage
from ._runtime.replicas import ReplicaPieces, ReplicaSync
from ._runtime.zero import Resident, watch_optimizer_steps
from .host.nvme import check_nvme_path, make_nvme_state
from .mesh import MeshInfo
from .policies import ShardingPolicy

Owned = list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]


def check_sharding(sharding: Any, reshard_after_forward: bool | int | None) -> ShardingPolicy | None:
    """The policy, after its type and its agreement with ``reshard_after_forward``; None: ZeRO-3, HSDP."""
    if sharding is None:
        return None
    if not isinstance(sharding, ShardingPolicy):
        raise TypeError(f"sharding must be a fsdp2lite.ShardingPolicy or None, got {type(sharding).__name__}")
    if sharding.resident and reshard_after_forward not in (None, False):
        raise ValueError(
            f"sharding=ShardingPolicy(shard='optimizer') keeps the parameters unsharded between steps (ZeRO-1/2); "
            f"reshard_after_forward={reshard_after_forward!r} would free them: leave it None (or False)"
        )
    return sharding


def check_parameters(
    sharding: ShardingPolicy | None, policy: ParamPolicy, info: MeshInfo, owned: Owned, dims: list[int]
) -> None:
    """Parameters and mesh a non-default ``sharding`` (or host masters) can take: ValueError naming what cannot."""
    hooked = [fqn for fqn, param, _ in owned if has_extension(_local(param))]
    if policy.nvme_path is not None:
        trainable = sum(p.numel() * p.element_size() for _, p, _ in owned if p.requires_grad)
        check_nvme_path(policy.nvme_path, "CPUOffloadPolicy(optimizer='nvme')", 2 * -(-trainable // info.shard_size))
    if policy.host_masters:
        if hooked:
            raise ValueError(
                f"CPUOffloadPolicy(optimizer_only=True) keeps plain master shards on the host, but these gather "
                f"through all-gather hooks (a tensor subclass such as NF4): {', '.join(hooked)}; offload them with "
                "optimizer_only=False (or not at all)"
            )
        if sharding is not None and sharding.replica_sharded:
            raise ValueError(
                "CPUOffloadPolicy(optimizer_only=True) and ShardingPolicy(replicate='optimizer') (HFSDP) both "
                "move where the masters live; pick one for this group"
            )
    if sharding is None:
        return
    if sharding.resident and hooked:
        raise ValueError(
            f"sharding=ShardingPolicy(shard='optimizer') keeps plain unsharded parameters, but these gather "
            f"through all-gather hooks (a tensor subclass such as NF4): {', '.join(hooked)}; shard them with "
            "shard='params'"
        )
    if not sharding.replica_sharded:
        return
    if info.replicate_group is None:
        raise ValueError(
            f"sharding=ShardingPolicy(replicate='optimizer') (HFSDP) shards masters and optimizer state across the "
            f"replicas of a 2-D (replicate, shard) mesh, but this mesh is 1-D (shape {tuple(info.mesh.shape)}): pass "
            "init_device_mesh(..., (replicate, shard), mesh_dim_names=('replicate', 'shard')), or replicate='none'"
        )
    odd = [f"{fqn} (all-gather hooks)" for fqn in hooked]
    odd += [f"{fqn} (tensor parallel)" for fqn, param, _ in owned if isinstance(param, DTensor)]
    odd += [f"{fqn} (Shard({dim}))" for (fqn, _, _), dim in zip(owned, dims) if dim != 0]
    odd += [f"{fqn} (0-dim)" for fqn, param, _ in owned if _local(param).dim() == 0]
    if odd:
        raise ValueError(
            f"sharding=ShardingPolicy(replicate='optimizer') (HFSDP) splits plain parameters sharded on dim 0 "
            f"across the replicas; these are not: {', '.join(odd)}. Give them a group with replicate='none'"
        )


def _local(param: nn.Parameter) -> Any:
    return param._local_tensor if isinstance(param, DTensor) else param  # type: ignore[attr-defined]


def param_storage(sharding: ShardingPolicy | None, policy: ParamPolicy, param: nn.Parameter) -> ShardStorage:
    """Where ``param``'s shard lives in a group under ``sharding`` and ``policy`` ([Note: shard storage]): host
    masters for the trainable parameters only (a frozen one has no gradient or optimizer state: its shard stays
    where it is, with no host copy; freeze before ``fully_shard``)."""
    if policy.host_masters:
        return HostMasters() if param.requires_grad else ShardStorage()
    return ReplicaPieces() if sharding is not None and sharding.replica_sharded else ShardStorage()


def apply_sharding(group: FSDPParamGroup, sharding: ShardingPolicy | None) -> None:
    """Make a new group resident (ZeRO-1/2), replica-sharded (HFSDP), with host masters, as asked."""
    if any(param.storage.grads_on_host for param in group.params):  # host masters
        group.add_storage(HostSync(group))  # [Note: host masters]
        watch_optimizer_steps()  # [Note: fused steps bump no version]
    if group.params[0].policy.nvme_path is not None:
        make_nvme_state(group)  # [Note: optimizer state on NVMe]
    if sharding is None:
        return
    if sharding.resident:
        group.set_reshard_after_forward(False)  # kept through forward: [Note: resident groups]
        group.add_storage(Resident(group))
        watch_optimizer_steps()
    if sharding.replica_sharded:
        group.replicas = ReplicaSync(group)  # [Note: replica-sharded groups]
        group.add_storage(group.replicas)
        group.choose_replica_step()
        watch_optimizer_steps()
