"""Where a group's shards live, chosen once from its plan: each parameter's ``ShardStorage`` ([Note: shard
storage], param.py) and the group's ``GroupStorage``s ([Note: group storage], seams.py).

    plan                                   parameter storage          group storages
    ZeRO-3 (sharding None, shard=params)   ShardStorage               none
    ZeRO-1/2 (shard="optimizer")           ShardStorage               Resident (zero.py)
    HFSDP (replicate="optimizer")          ReplicaPieces              ReplicaSync (replicas.py)
    CPUOffloadPolicy()                     its storage, a host home   HostShards (host_storage.py)
    CPUOffloadPolicy(optimizer_only=True)  HostMasters (trainable)    HostSync (host_masters.py), holding one

What each stage cannot hold (ZeRO-1/2 with a post-forward reshard, HFSDP on a 1-D mesh, ...) is refused by the
plan before anything is built ([Note: one plan]); nothing here checks again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from ..policies import ShardingPolicy
from .host_masters import HostMasters, HostSync
from .host_storage import HostShards
from .param import ShardStorage
from .param_policy import ParamPolicy
from .replicas import ReplicaPieces, ReplicaSync
from .seams import GroupStorage, GroupView
from .shard_home import DEVICE, HostHome
from .zero import Resident, watch_optimizer_steps


def param_storage(sharding: ShardingPolicy | None, policy: ParamPolicy, param: nn.Parameter) -> ShardStorage:
    """Where ``param``'s shard lives in a group under ``sharding`` and ``policy`` ([Note: shard storage]): host
    masters for the trainable parameters only (a frozen one has no gradient or optimizer state: its shard stays
    where it is, with no host copy; freeze before ``fully_shard``); under CPU offload its shard's home is the
    host (the one place that asks: [Note: shard home])."""
    if policy.host_masters:
        return HostMasters() if param.requires_grad else ShardStorage()
    home = HostHome(policy.pin_memory) if policy.offload_to_cpu else DEVICE
    return ReplicaPieces(home) if sharding is not None and sharding.replica_sharded else ShardStorage(home)


class GroupStorages(NamedTuple):
    """A new group's storages, in the order the group calls them, and HFSDP's replica collectives among them."""

    storages: tuple[GroupStorage, ...]  # those that keep the unsharded storage last: [Note: group storage]
    replicas: ReplicaSync | None  # HFSDP: [Note: replica-sharded groups]


def group_storages(group: GroupView, sharding: ShardingPolicy | None) -> GroupStorages:
    """The storages of ``group`` (its parameters and their storages made) under ``sharding``. Those that keep the
    unsharded storage (ZeRO-1/2) come last: it is judged fresh or not after every refresh has run (an HFSDP
    replica all-gather into the chunks moves the versions ZeRO-1/2's freshness compares). The host storage is made
    first: its packing writes the registered shards, and the others' watches start from what it wrote."""
    storages: list[GroupStorage] = []
    replicas = None
    pin = group.params[0].policy.pin_memory
    if any(param.storage.grads_on_host for param in group.params):  # host masters
        storages.append(HostSync(group, HostShards(group, pin)))  # [Note: host masters], [Note: host storage]
    elif group.params[0].home.on_host:  # host shards (CPU offload)
        storages.append(HostShards(group, pin))  # [Note: host storage]
    if sharding is not None and sharding.replica_sharded:
        replicas = ReplicaSync(group)  # [Note: replica-sharded groups]
        storages.append(replicas)
    if sharding is not None and sharding.resident:
        storages.append(Resident(group))  # [Note: resident groups]
    if any(not isinstance(s, HostShards) for s in storages):  # each of those compares versions a fused step
        watch_optimizer_steps()  # would not move: [Note: fused steps bump no version]
    return GroupStorages(tuple(sorted(storages, key=lambda s: s.keeps_unsharded)), replicas)
