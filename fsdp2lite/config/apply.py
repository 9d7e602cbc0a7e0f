"""``apply_config``: shard a model as a config says, all or nothing (every check first, then the groups
bottom-up and the root; on a failure part-way every module is restored)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn

from .errors import ConfigError
from .plan import Plan, mesh_problems, plan_config
from .schema import FSDPConfig


def apply_config(model: nn.Module, config: FSDPConfig, mesh: Any = None) -> nn.Module:
    """Shard ``model`` as ``config`` says: matched groups bottom-up, then the root; returns ``model``.

    ``mesh`` defaults to one built from ``config.mesh`` over the default process group. All or nothing:
    every rule, parameter and mesh-dependent value is checked first (``ConfigError`` listing every
    problem), and if sharding still fails part-way, every module is put back as it was.
    """
    from .._snapshot import ModuleSnapshot
    from ..api import build_spec  # at call time: tests replace it to fail part-way
    from ..mesh import init_mesh, mesh_info_for
    from ..module import FSDPModule

    _check_apply_arguments(model, config, mesh)
    sharded = [path or "<root>" for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(
            f"apply_config: {type(model).__name__} is already sharded (fully_shard was applied to "
            f"{', '.join(sharded[:4])}{' ...' if len(sharded) > 4 else ''}); apply a config to an unsharded model"
        )
    plan = plan_config(model, config)
    problems = plan.problems + plan.refused
    if mesh is None and not problems:
        mesh = init_mesh(replicate=config.mesh.replicate, shard=config.mesh.shard, device_type=_device_type(model))
    if mesh is not None:
        info = mesh_info_for(mesh)
        problems += mesh_problems(plan, config, info.shard_size, info.replicate_size, info)
    if problems:
        raise ConfigError("config applied to " + type(model).__name__, problems)
    with ModuleSnapshot(model.modules()).all_or_nothing():  # the model is as it was before the call, or sharded
        _shard_plan(model, config, plan, mesh, build_spec)
    return model


def _check_apply_arguments(model: Any, config: Any, mesh: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply_config(model, config, mesh=None): model must be an nn.Module, got {type(model).__name__}"
        )
    if isinstance(config, str | Path):
        raise TypeError(
            f"apply_config takes an FSDPConfig, got the path {str(config)!r}: "
            f"pass fsdp2lite.FSDPConfig.from_yaml({str(config)!r})"
        )
    if isinstance(config, dict):
        raise TypeError("apply_config takes an FSDPConfig, got a dict: pass fsdp2lite.FSDPConfig.model_validate(...)")
    if not isinstance(config, FSDPConfig):
        raise TypeError(
            f"apply_config(model, config, mesh=None): config must be an FSDPConfig, got {type(config).__name__}"
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"apply_config: mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if config.offload.budget is not None:  # [Note: offload budget] (estimate/offload_budget.py)
        raise ValueError(
            f"apply_config: offload.budget: {config.offload.budget} is resolved by the planner (which groups go to "
            "the host depends on the batch and sequence): run `fsdp2lite estimate --config FILE --model M "
            "--world-size N --batch B --seq S --write-config OUT.yaml` and apply OUT.yaml, or apply "
            "fsdp2lite.estimate.resolve_offload_budget(...).config"
        )


def _shard_plan(model: nn.Module, config: FSDPConfig, plan: Plan, mesh: Any, build_spec: Any) -> None:
    """Each planned group built from its spec (planned and checked once, by ``plan_config`` and ``mesh_problems``:
    ``api.build_spec`` builds it as ``fully_shard`` builds the spec it plans), deepest first, then the root."""
    for group, spec in zip(plan.groups, plan.specs):
        build_spec(spec, mesh)  # [Note: one plan]
        module = group.modules[0]
        if group.policy.reduce_scatter_unused_params:
            module.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]
        state: Any = module._fsdp_state
        if not group.policy.unshard_in_backward and state.group is not None:
            module.set_unshard_in_backward(False)  # type: ignore[operator]
    config.schedule.apply_to(model)  # the model is the root: plans always end with it
    for group in plan.groups:  # last: nothing after this can fail
        if group.policy.activation_checkpointing:
            for module in group.modules:
                checkpoint_forward(module)


def checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward instead of keeping its activations
    (``torch.utils.checkpoint``, non-reentrant). fsdp2lite's hooks stay outside: the recompute runs
    after the group's pre-backward unshard ([Note: recompute] in _runtime/hooks.py)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]


def _device_type(model: nn.Module) -> str:
    import torch

    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if devices:
        return devices.pop()
    return "cuda" if torch.cuda.is_available() else "cpu"
