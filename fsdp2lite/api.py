"""``fully_shard``: the public entry to the runtime, and every check of its arguments.

``fully_shard(module)`` takes the parameters of ``module`` that no nested ``fully_shard`` call owns,
shards each on dim 0 as a DTensor, makes them one communication group, registers the hooks and swaps
the module's class to a subclass of ``FSDPModule`` (module.py) in place. Call it bottom-up: blocks first,
root last.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._arguments import check_call, check_ignored, resolve_policies
from ._plan import (
    GroupSettings,
    GroupSpec,
    MeshShape,
    OwnedParam,
    ParamSpec,
    PlanError,
    group_problems,
    owned_params,
    walk_modules,
)
from ._precision import OverrideFn, resolve_overrides
from ._runtime.group import FSDPParamGroup
from ._runtime.hooks import FSDPState
from ._runtime.identity import sharded_param_ids
from ._runtime.module_casts import OverridePatterns, install_casts
from ._runtime.param import FSDPParam
from ._runtime.param_policy import ParamPlace, ParamPolicy
from ._runtime.seams import GroupContext
from ._runtime.storages import param_storage
from ._snapshot import ModuleSnapshot, all_modules
from .forward_pass import register_fsdp_forward_method
from .host import HostEngine
from .mesh import MeshInfo, backend_device_type, default_mesh, mesh_info_for
from .module import FSDPModule, UnshardHandle
from .policies import (
    CommPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingPolicy,
)

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

M = TypeVar("M", nn.Module, list[nn.Module])


@functools.cache
def _fsdp_class(cls: type) -> type:
    """``FSDP<Name>(FSDPModule, <Name>)``, one per original class."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def fully_shard(
    module: M,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    comm_policy: CommPolicy | None = None,
    sharding: ShardingPolicy | None = None,
    mp_overrides: Mapping[str, MixedPrecisionPolicy] | OverrideFn | None = None,
) -> M:
    """Shard ``module`` (or a list of modules, as one group) over ``mesh``; returns it, now an FSDPModule.

    Args:
        module: a module with a ``forward``, or a non-empty list of them forming one group.
        mesh: a 1D ``DeviceMesh``, or 2D ``(replicate, shard)`` for HSDP; None builds a 1D one over the
            default process group. Parameters that tensor parallelism already made DTensors on a
            sibling mesh (``mesh["tp"]`` beside ``mesh["dp"]``) are sharded over this one too.
        reshard_after_forward: free the unsharded parameters after forward (True), keep them until
            backward (False), keep a k-rank shard so backward all-gathers over k ranks (int k, a
            divisor of the shard group size), or None: False for the root, True for every other group.
        shard_placement_fn: ``fn(param) -> Shard(d) | None`` picks the dim each parameter is sharded
            on (``torch.chunk`` along it); None (or a None result) shards dim 0.
        mp_policy: dtypes of the all-gather/compute (param_dtype), the gradient reduction
            (reduce_dtype), outputs and inputs; None: no casts. Sharded parameters and their
            gradients keep the parameters' own dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded parameters and gradients on the host
            (the optimizer steps there); None or ``OffloadPolicy()``: no offload.
        ignored_params: parameters left unsharded and unreduced.
        comm_policy: ``CommPolicy(all_gather="int8", reduce_scatter="all_to_all", ...)``: fewer bytes on the
            wire, full precision elsewhere (README, "Communication"); None sends as torch's fully_shard does.
        dp_mesh_dims: torch's SPMD form; not supported: anything but None raises, naming the sub-mesh to pass.
        sharding: ``ShardingPolicy(shard="optimizer")`` (or ``ShardingPolicy.zero_stage(1|2)``): ZeRO-1/2, the
            group's unsharded parameters stay resident between steps and are all-gathered once after the
            shards change ([Note: resident groups]); None or ``shard="params"``: ZeRO-3, torch's behaviour.
            ``ShardingPolicy(replicate="optimizer")`` on a 2D mesh: HFSDP, masters and optimizer state sharded
            across the replicas too ([Note: replica-sharded groups]); ``replicate="none"``: HSDP.
        mp_overrides: per-parameter mixed precision: ``{"*norm*": MixedPrecisionPolicy(param_dtype=torch.float32)}``
            (fnmatch patterns over the call's parameter names, first match wins; or ``fn(param) -> policy | None``)
            gives the matching parameters their own ``param_dtype`` and ``reduce_dtype`` inside this one group:
            one all-gather, one reduce-scatter per reduce dtype ([Note: per-parameter mixed precision]); the
            module holding them casts its inputs to that ``param_dtype`` and its outputs to the override's
            ``output_dtype``, else back to the group's compute dtype ([Note: override casts]). One mapping
            serves every call: a pattern matching nothing under the root is refused at the first forward.
    """
    modules, sharding = check_call(module, dp_mesh_dims, reshard_after_forward, sharding)
    mp_policy, offload_policy = resolve_policies(mp_policy, offload_policy, comm_policy)
    owned = _collect_params(modules, check_ignored(ignored_params))
    settings = GroupSettings(mp_policy, offload_policy, comm_policy, sharding, reshard_after_forward)
    overrides, patterns = resolve_overrides(mp_overrides, owned)
    planned = _param_specs(owned, shard_placement_fn, overrides, mp_policy)
    spec = GroupSpec(_label(modules), modules, _classes(modules), planned, settings, mesh=None)  # plan
    shard_spec(spec, mesh, patterns)  # check and build
    return module


def shard_spec(spec: GroupSpec, mesh: DeviceMesh | None, patterns: OverridePatterns | None = None) -> None:
    """Check a planned group on its mesh, every problem at once, then build it, all or nothing: ``fully_shard``'s
    second half."""
    owned = [OwnedParam(p.fqn, p.param, list(p.places)) for p in spec.params]
    spec, mesh_info = _checked_on_mesh(spec, mesh, owned)  # check: every problem at once, before any change
    _build(spec, mesh_info, patterns)


def build_spec(spec: GroupSpec, mesh: DeviceMesh | None) -> None:
    """Build a group whose problems its planner already reported, with and without the mesh (``apply_config``
    with each group of its policy file's plan: planned and checked once, [Note: one plan]), all or nothing."""
    owned = [OwnedParam(p.fqn, p.param, list(p.places)) for p in spec.params]
    mesh_info = _mesh_info(mesh, owned, spec.settings.offloaded is not None)
    _build(spec.on_mesh(MeshShape.of(mesh_info)), mesh_info, None)


def _build(spec: GroupSpec, mesh_info: MeshInfo, patterns: OverridePatterns | None) -> None:
    """The parameters, the group made from the spec, the hooks, the override casts and the FSDP classes: all or
    nothing (every module restored if any step fails)."""
    modules, mp_policy = spec.modules, spec.settings.mixed_precision
    with ModuleSnapshot(all_modules(modules)).all_or_nothing():
        params = _make_params(spec, mesh_info)
        group = _make_group(params, spec, mesh_info)
        _install(modules, FSDPState(modules, group, mp_policy, patterns))
        install_casts(spec.casts[0])  # planned with the spec: [Note: override casts]
    _register_composable(modules)
    TALLY.calls, TALLY.modules = TALLY.calls + 1, TALLY.modules + len(modules)


@dataclasses.dataclass
class ShardTally:
    """What ``fully_shard`` did in this process: the calls that sharded (one group each) and the modules they
    made FSDPModules. The launcher's exit report reads it (``python -m fsdp2lite.run``: a script that ran under
    it without any call is told so); only ``fully_shard`` writes it, once per call, after the build."""

    calls: int = 0
    modules: int = 0


TALLY = ShardTally()


def _checked_on_mesh(spec: GroupSpec, mesh: DeviceMesh | None, owned: list[OwnedParam]) -> tuple[GroupSpec, MeshInfo]:
    """The spec on its mesh, with every problem raised together (``PlanError``); where no mesh can be had (no
    process group yet), the problems that need none are raised before that error."""
    try:
        mesh_info = _mesh_info(mesh, owned, spec.settings.offloaded is not None)
    except (RuntimeError, TypeError, ValueError):
        if problems := group_problems(spec):
            raise PlanError(spec.label, problems) from None
        raise
    spec = spec.on_mesh(MeshShape.of(mesh_info))
    if problems := group_problems(spec):
        raise PlanError(spec.label, problems)
    return spec, mesh_info


def _label(modules: tuple[nn.Module, ...]) -> str:
    return ", ".join(_classes(modules))


def _classes(modules: tuple[nn.Module, ...]) -> tuple[str, ...]:
    return tuple(type(m).__name__ for m in modules)


def _install(modules: tuple[nn.Module, ...], state: FSDPState) -> None:
    """Give the modules their state and their FSDP class (the last step of ``fully_shard``)."""
    for m in modules:
        m._fsdp_state = state  # type: ignore[assignment]
        m.__class__ = _fsdp_class(type(m))  # type: ignore[arg-type]  # classes are hashable


def _make_group(params: tuple[FSDPParam, ...], spec: GroupSpec, mesh_info: MeshInfo) -> FSDPParamGroup | None:
    """The call's group (None when it owns no parameter), made from its checked spec (its storages and forms
    chosen there, once), with a host engine of its own until the root's lazy init hands it the root's."""
    _accept_full_tensors_on_load(params)
    if not params:
        return None
    return FSDPParamGroup(spec, params, GroupContext(mesh_info, HostEngine()))


def _register_composable(modules: tuple[nn.Module, ...]) -> None:
    """Leave the marks torch's own ``fully_shard`` leaves, so other tools see FSDP2-managed modules:
    ``fully_shard`` in torch's composable-API registry on the called modules (torch's ``replicate()``
    then leaves their parameters to us, instead of reducing them twice, and refuses to wrap them), and
    ``_is_fsdp_managed_module`` / ``_fsdp_use_orig_params`` on every module the call manages
    (transformers' ``generate`` syncs ranks on the first; torch.compile reads both). Marks only: no
    torch FSDP code runs."""
    from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

    item = RegistryItem()  # one per call, shared by its modules, as torch's contract does
    for module in modules:
        registry = module.__dict__.setdefault(REGISTRY_KEY, {})
        registry.setdefault("fully_shard", item)
    for _, managed in walk_modules([("", root) for root in modules], _is_fsdp):
        managed._is_fsdp_managed_module = True  # type: ignore[assignment]
        managed._fsdp_use_orig_params = True  # type: ignore[assignment]


def _state_of(module: nn.Module) -> FSDPState:
    """``fully_shard.state(module)``: the fsdp2lite state of a module ``fully_shard`` was applied to
    (torch's gives its own FSDPState; ours has the group, the hooks and, after the first forward, the
    root's shared context)."""
    state = module.__dict__.get("_fsdp_state") if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"fully_shard.state: {type(module).__name__} is not sharded (fully_shard was not applied to it)"
        )
    return state


fully_shard.state = _state_of  # type: ignore[attr-defined]


def _param_specs(
    owned: list[OwnedParam],
    shard_placement_fn: Any,
    overrides: list[MixedPrecisionPolicy | None],
    mp_policy: MixedPrecisionPolicy,
) -> tuple[ParamSpec, ...]:
    """Each owned parameter's part of the plan: its shard dim as asked, its mixed precision (``mp_overrides``)."""
    dims = _shard_dims(shard_placement_fn, owned)
    source = "shard_placement_fn" if shard_placement_fn is not None else "the default"
    return tuple(
        ParamSpec(fqn, param, tuple(places), dim, source, override or mp_policy, override is not None)
        for (fqn, param, places), dim, override in zip(owned, dims, overrides)
    )


def _make_params(spec: GroupSpec, info: MeshInfo) -> tuple[FSDPParam, ...]:
    """The group's parameters, each under its policy (the group's, or an override's dtypes) and MixedPrecisionPolicy
    (for the all-gather hooks), with the storage the spec's sharding and the policy ask for (``storages.py``)."""
    base = _param_policy(spec.settings.mixed_precision, spec.settings.offload, info, spec.settings.sharding)
    made = []
    for p in spec.params:
        mp = p.mixed_precision
        policy = (
            dataclasses.replace(base, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
            if p.overridden
            else base
        )
        places = tuple(ParamPlace(m, n) for m, n in p.places)
        storage = param_storage(spec.settings.sharding, policy, p.param)
        made.append(FSDPParam(p.param, p.fqn, places, info, policy, p.dim, mp, storage=storage))
    return tuple(made)


def _shard_dims(fn: Any, owned: list[OwnedParam]) -> list[int]:
    """The dim each parameter is asked to be sharded on: ``fn(param)`` as ``Shard(d)``, or 0 for None (its range
    is the plan's check: ``_plan.py``)."""
    if fn is None:
        return [0] * len(owned)
    if not callable(fn):
        raise TypeError(f"shard_placement_fn must be a callable param -> Shard(dim) | None, got {type(fn).__name__}")
    dims = []
    for fqn, param, places in owned:
        placement = fn(param)
        if placement is not None and (not isinstance(placement, Shard) or isinstance(placement, _StridedShard)):
            raise TypeError(
                f"shard_placement_fn returned {placement!r} for parameter '{fqn}' of {type(places[0][0]).__name__}; "
                "it must return Shard(dim) or None (Shard(0))"
            )
        dims.append(0 if placement is None else placement.dim)
    return dims


def _accept_full_tensors_on_load(params: tuple[FSDPParam, ...]) -> None:
    """``load_state_dict`` takes plain full tensors too: a pre-hook on each module that holds a managed
    parameter replaces a full-shaped plain tensor by this rank's shard (DTensors pass through)."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, FSDPParam]]]] = {}
    for param in params:
        if param.tp_spec is not None:
            continue  # tensor parallel: a full tensor needs its tp piece first; load DTensors instead
        for place in param.places:
            by_module.setdefault(id(place.module), (place.module, []))[1].append((place.name, param))
    for module, entries in by_module.values():

        def shard_full(_module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any, entries=entries) -> None:
            for name, param in entries:
                value = state_dict.get(prefix + name)
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == param.orig_shape
                ):
                    state_dict[prefix + name] = param.shard_full_tensor(value)

        module.register_load_state_dict_pre_hook(shard_full)


# ---- input checks that need the parameters or the mesh (the others: _arguments.py) ----------------
def _param_policy(
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    mesh_info: MeshInfo,
    sharding: ShardingPolicy | None = None,
) -> ParamPolicy:
    """The policies the parameters run under, now that the compute device is known (pinning needs CUDA)."""
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    if pin and mesh_info.device.type != "cuda":
        warnings.warn(
            f"CPUOffloadPolicy(pin_memory=True) on a '{mesh_info.mesh.device_type}' mesh: host shards are not "
            "pinned (pinning only speeds up copies to a CUDA device). Pass CPUOffloadPolicy(pin_memory=False) "
            "to silence this.",
            stacklevel=5,
        )
        pin = False
    host_masters = offload and offload_policy.optimizer_only  # type: ignore[attr-defined]
    nvme = offload and offload_policy.optimizer == "nvme"  # type: ignore[attr-defined]
    return ParamPolicy(
        mp_policy.param_dtype,
        mp_policy.reduce_dtype,
        offload and not host_masters,
        pin,
        host_masters=host_masters,
        nvme_path=offload_policy.nvme_path if nvme else None,  # type: ignore[attr-defined]
        shard_align=1 if sharding is None else sharding.align,  # [Note: padded shard] in _runtime/layout.py
    )


def _nested_params(modules: tuple[nn.Module, ...]) -> dict[int, str]:
    """id(original Parameter) -> name, for parameters that nested fully_shard calls took."""
    taken: dict[int, str] = {}
    for root in modules:
        for path, module in root.named_modules():
            state = getattr(module, "_fsdp_state", None)
            if state is None or state.group is None:
                continue
            for param in state.group.params:
                original = param.orig_param_ref()
                if original is not None:
                    taken[id(original)] = f"{path}.{param.fqn}" if path else param.fqn
    return taken


def _collect_params(modules: tuple[nn.Module, ...], ignored: set[int]) -> list[OwnedParam]:
    """The parameters this call owns, with every (module, name) place they are registered at: the modules' walk
    stops at nested FSDPModules (``_plan.walk_modules``); a list's modules are named ``[i].``."""
    roots = [(f"[{index}]" if len(modules) > 1 else "", root) for index, root in enumerate(modules)]
    owned = owned_params(roots, _is_fsdp, ignored)
    taken = _nested_params(modules)
    sharded = sharded_param_ids()  # DTensors an enclosing call made: sharded bottom-up the wrong way round
    for fqn, param, places in owned:
        _check_param(param, fqn, type(places[0][0]).__name__, taken, sharded)
    return owned


def _is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _check_param(param: nn.Parameter, fqn: str, owner: str, taken: dict[int, str], sharded: set[int]) -> None:
    """A parameter another call already owns: raised at once (the order of the calls is wrong, not the plan)."""
    if isinstance(param, DTensor) and id(param) in sharded:
        raise ValueError(
            f"parameter '{fqn}' of {owner} is already sharded: fully_shard was applied to a module "
            "that encloses it first. Apply fully_shard bottom-up: submodules first, then the root"
        )
    if id(param) in taken:
        raise ValueError(
            f"parameter '{fqn}' of {owner} is tied to '{taken[id(param)]}', already managed by another (nested) "
            "fully_shard call; tied parameters must be in one group: shard a module containing "
            "every use (or leave the tied modules to the enclosing call)"
        )


def _mesh_info(mesh: DeviceMesh | None, owned: list[OwnedParam], offload: bool) -> MeshInfo:
    devices = {param.device for _, param, _ in owned}
    real = {d for d in devices if d.type != "meta"}
    if len({d.type for d in real}) > 1:
        raise ValueError(f"parameters of one fully_shard call must share a device type, got {sorted(map(str, real))}")
    if mesh is None:
        if real and not offload:
            device_type = next(iter(real)).type  # the parameters are where the job computes
        else:
            device_type = backend_device_type(next(iter(real)).type if real else None)  # [Note: device rule]
        mesh = default_mesh(device_type)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard(mesh=...) takes a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}"
        )
    allowed = {mesh.device_type, "meta"} | ({"cpu"} if offload else set())  # offload starts from host params
    for fqn, param, _ in owned:
        if param.device.type not in allowed:
            raise ValueError(
                f"parameter '{fqn}' is on {param.device} but the mesh is a '{mesh.device_type}' mesh; "
                f"move the module to {mesh.device_type} (or build it on the meta device) before "
                "fully_shard, or pass a mesh of its device type"
            )
    return mesh_info_for(mesh)
