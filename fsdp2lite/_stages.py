"""``fully_shard(..., sharding=)``: the ZeRO stage of each mesh axis, checked and applied; and where the
optimizer steps (``CPUOffloadPolicy(optimizer_only=True)``).

``ShardingPolicy(shard=...)`` picks the shard axis's stage (``params``: ZeRO-3, ``optimizer``: ZeRO-1/2, a
resident group, [Note: resident groups]); ``ShardingPolicy(replicate=...)`` the replicate axis's (``none``:
HSDP, ``optimizer``: HFSDP, a replica-sharded group, [Note: replica-sharded groups]). ``optimizer_only``
offload keeps the shards on the device and the masters on the host ([Note: host masters]); ``optimizer="nvme"``
keeps the optimizer state in files between steps ([Note: optimizer state on NVMe]). What each stage cannot
hold is checked with the rest of the plan, before anything is sharded (``_plan.py``, [Note: one plan]).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ._runtime.group import FSDPParamGroup
from ._runtime.host_masters import HostMasters, HostSync
from ._runtime.param import ShardStorage
from ._runtime.param_policy import ParamPolicy
from ._runtime.replicas import ReplicaPieces, ReplicaSync
from ._runtime.zero import Resident, watch_optimizer_steps
from .host.nvme import make_nvme_state
from .policies import ShardingPolicy


def check_sharding(sharding: Any) -> ShardingPolicy | None:
    """The policy, after its type; None: ZeRO-3, HSDP. (What it cannot hold: the plan's checks, ``_plan.py``.)"""
    if sharding is None:
        return None
    if not isinstance(sharding, ShardingPolicy):
        raise TypeError(f"sharding must be a fsdp2lite.ShardingPolicy or None, got {type(sharding).__name__}")
    return sharding


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
        group.add_storage(Resident(group))
        watch_optimizer_steps()
    if sharding.replica_sharded:
        group.replicas = ReplicaSync(group)  # [Note: replica-sharded groups]
        group.add_storage(group.replicas)
        group.choose_replica_step()
        watch_optimizer_steps()
