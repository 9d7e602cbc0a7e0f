"""The arguments of ``fully_shard`` that can be checked before its parameters and mesh are known: the modules,
``dp_mesh_dims``, ``reshard_after_forward``, ``sharding``, the policies' types, ``ignored_params``. Each check
raises naming the offending value and what is allowed; nothing has changed when one does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from .module import FSDPModule, check_reshard_after_forward
from .policies import CommPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardingPolicy, from_torch_policy


def check_call(
    module: Any, dp_mesh_dims: Any, reshard_after_forward: Any, sharding: Any
) -> tuple[tuple[nn.Module, ...], ShardingPolicy | None]:
    """The checks that need neither parameters nor mesh: the modules, and the sharding policy."""
    _check_dp_mesh_dims(dp_mesh_dims)
    modules = _check_modules(module)
    check_reshard_after_forward(reshard_after_forward)
    return modules, check_sharding(sharding)


def _check_dp_mesh_dims(dp_mesh_dims: Any) -> None:
    if dp_mesh_dims is None:
        return
    shard = getattr(dp_mesh_dims, "shard", None)
    replicate = getattr(dp_mesh_dims, "replicate", None)
    names = [n for part in (replicate, shard) if part for n in ((part,) if isinstance(part, str) else part)]
    sub = f"mesh[{', '.join(repr(n) for n in names)}]" if names else "mesh['dp']"
    raise NotImplementedError(
        f"fully_shard(dp_mesh_dims={dp_mesh_dims!r}): the SPMD form (parameters as DTensors on the full mesh) "
        f"is not supported by fsdp2lite; pass the data-parallel sub-mesh instead, mesh={sub} (2D: replicate, "
        "shard), with tensor-parallel parameters on their own sub-mesh (e.g. mesh['tp'])"
    )


def _check_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, list | tuple) else (module,)
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass a module or a non-empty list")
    seen: dict[int, int] = {}
    for index, m in enumerate(modules):
        if id(m) in seen:
            raise ValueError(
                f"fully_shard got the same {type(m).__name__} twice in its list (positions {seen[id(m)]} and "
                f"{index}); list each module once"
            )
        seen[id(m)] = index
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__[len('FSDP') :]}; "
                "each module can be sharded once"
            )
    return modules


def resolve_policies(
    mp_policy: Any, offload_policy: Any, comm_policy: Any = None
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    if comm_policy is not None and not isinstance(comm_policy, CommPolicy):
        raise TypeError(f"comm_policy must be a fsdp2lite.CommPolicy or None, got {type(comm_policy).__name__}")
    mp_policy, offload_policy = from_torch_policy(mp_policy), from_torch_policy(offload_policy)  # torch's too
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a MixedPrecisionPolicy (fsdp2lite's or torch's) or None, got {type(mp_policy).__name__}"
        )
    if offload_policy is None:
        offload_policy = OffloadPolicy()
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be an OffloadPolicy (fsdp2lite's or torch's) or None, got "
            f"{type(offload_policy).__name__}"
        )
    return mp_policy, offload_policy


def check_ignored(ignored_params: Any) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, Iterable) or isinstance(ignored_params, torch.Tensor):
        raise TypeError(f"ignored_params must be a set of nn.Parameter, got {type(ignored_params).__name__}")
    ignored = list(ignored_params)
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got a {type(p).__name__}")
    return {id(p) for p in ignored}


def check_sharding(sharding: Any) -> ShardingPolicy | None:
    """The policy, after its type; None: ZeRO-3, HSDP. What each ZeRO stage cannot hold is checked with the rest of
    the plan (``_plan.py``, [Note: one plan]); where it puts the shards is chosen with the group
    (``_runtime/storages.py``)."""
    if sharding is None:
        return None
    if not isinstance(sharding, ShardingPolicy):
        raise TypeError(f"sharding must be a fsdp2lite.ShardingPolicy or None, got {type(sharding).__name__}")
    return sharding
