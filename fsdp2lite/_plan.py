"""One ``fully_shard`` call planned: its ``GroupSpec``, made once and frozen, and every check on it, in one place.

``fully_shard`` is plan, check, build: ``owned_params`` walks the call's modules once (not into modules an
earlier call owns), ``GroupSpec`` records what the build needs (the parameters and their roles, the mesh's
shape, the policies, the sharding level, the reshard setting) and ``group_problems`` reports every problem of the
spec at once, before anything changes. ``config/plan.py`` builds the same spec for each group a policy file
plans (with no mesh yet: the mesh's checks run when ``apply_config`` or ``explain --world-size`` gives one), so a
policy file, ``explain`` and the estimators refuse exactly what ``fully_shard`` would, with the same words.

[Note: one plan]
A check lives here when it needs the parameters, the policies or the mesh's shape; the checks of the arguments
alone (types, the module list, ``dp_mesh_dims``) stay with the call (``_arguments.py``), and the checks that need
every group of a tree (ties across groups, one mesh, materialized parameters) run at the root's lazy init. A
check that also guards a later setter (``set_reshard_after_forward``) is one function the setter calls too
(``_runtime/post_forward.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._precision import override_casts
from ._runtime.extension import has_extension
from ._runtime.gather import quantized_gather_problem
from ._runtime.module_casts import ModuleCast
from ._runtime.post_forward import (
    is_rank_count,
    post_forward_align_problem,
    post_forward_dims_problem,
    post_forward_size_problem,
)
from ._summary import summarized
from .host.nvme import nvme_path_problem
from .mesh import MeshInfo, check_tp_mesh
from .policies import (
    CommPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingPolicy,
    cast_dtype,
    reduce_cast_dtype,
    reduce_dtype_problem_by_policy,
)


class Problem(NamedTuple):
    """One problem: where (a parameter, a group, a policy key), what, and what would be valid."""

    location: str  # a parameter or module path, a group's label, or a config key such as "wrap.1.match.clas"
    message: str
    suggestion: str


class PlanError(ValueError):
    """Every problem ``fully_shard`` found in one call, raised together; nothing was changed."""

    def __init__(self, owner: str, problems: list[Problem]) -> None:
        self.problems = problems
        lines = summarized([_line(p, owner) for p in problems])
        if len(problems) == 1:
            super().__init__(f"fully_shard({owner}): {lines[0]}")
        else:
            super().__init__(
                f"fully_shard({owner}): {len(problems)} problems\n" + "\n".join(f"  {line}" for line in lines)
            )


def _line(problem: Problem, owner: str) -> str:
    """``where: what; what would be valid`` (the location left out when it is the call itself)."""
    where = "" if problem.location == owner else f"{problem.location}: "
    hint = f"; {problem.suggestion}" if problem.suggestion else ""
    return f"{where}{problem.message}{hint}"


class OwnedParam(NamedTuple):
    """A parameter a call owns, and every (module, attribute) it is registered at (more than one: tied)."""

    fqn: str
    param: nn.Parameter
    places: list[tuple[nn.Module, str]]


def owned_params(
    roots: Iterable[tuple[str, nn.Module]], skip: Callable[[nn.Module], bool], ignored: set[int]
) -> list[OwnedParam]:
    """The parameters under ``roots`` (path, module), named from each root's path, in the modules
    ``walk_modules`` visits, without the ``ignored`` ones (ids); each once, with all its places."""
    owned: dict[int, OwnedParam] = {}
    for prefix, module in walk_modules(roots, skip):
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored:
                continue
            entry = owned.setdefault(id(param), OwnedParam(join_path(prefix, name), param, []))
            entry.places.append((module, name))
    return list(owned.values())


def walk_modules(
    roots: Iterable[tuple[str, nn.Module]], skip: Callable[[nn.Module], bool]
) -> Iterator[tuple[str, nn.Module]]:
    """The one module walk of a call: (path, module) under ``roots``, each module once, not descending into
    modules ``skip`` says another call owns (``fully_shard``: nested FSDPModules; a policy file's plan: the
    modules of the groups planned before)."""
    seen: set[int] = set()
    for path, root in roots:
        yield from _walk(root, path, skip, seen)


def _walk(
    module: nn.Module, path: str, skip: Callable[[nn.Module], bool], seen: set[int]
) -> Iterator[tuple[str, nn.Module]]:
    if id(module) in seen:
        return
    seen.add(id(module))
    yield path, module
    for name, child in module.named_children():
        if not skip(child):
            yield from _walk(child, join_path(path, name), skip, seen)


def join_path(prefix: str, name: str) -> str:
    """A module or parameter path: ``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class MeshShape:
    """What the checks need of a mesh: its degrees, and the mesh itself where there is one (``fully_shard``;
    ``explain --world-size`` has degrees only)."""

    shard_size: int
    replicate_size: int = 1
    info: MeshInfo | None = None

    @classmethod
    def of(cls, info: MeshInfo) -> MeshShape:
        return cls(info.shard_size, info.replicate_size if info.replicate_group is not None else 1, info)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a group and its role."""

    fqn: str
    param: nn.Parameter
    places: tuple[tuple[nn.Module, str], ...]  # every (module, attribute) it is registered at
    shard_dim: int  # as asked (``shard_placement_fn``, a ``shard_placement`` rule): checked, then normalized
    dim_source: str  # who asked for the dim: "shard_placement_fn", "shard_placement.0", or "" (the default 0)
    mixed_precision: MixedPrecisionPolicy  # its own: the group's, or an override's
    overridden: bool  # mixed_precision comes from mp_overrides / precision_overrides

    @property
    def owner(self) -> str:
        """The class of the first module it is registered at, for messages."""
        return type(self.places[0][0]).__name__

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    @property
    def tensor_parallel(self) -> bool:
        return isinstance(self.param, DTensor)

    @property
    def local(self) -> Any:
        return self.param._local_tensor if isinstance(self.param, DTensor) else self.param  # type: ignore[attr-defined]

    @property
    def hooked(self) -> bool:
        """Gathered through all-gather extension hooks (a tensor subclass such as NF4)."""
        return has_extension(self.local)

    @property
    def dim(self) -> int:
        """The shard dim, normalized (valid once ``group_problems`` found none for it)."""
        return self.shard_dim % max(self.local.dim(), 1)


@dataclass(frozen=True)
class GroupSettings:
    """The policies one group runs under, as ``fully_shard`` takes them (checked types, torch's converted)."""

    mixed_precision: MixedPrecisionPolicy  # the group's: casts the modules' inputs and outputs
    offload: OffloadPolicy
    comm: CommPolicy | None
    sharding: ShardingPolicy | None  # None: ZeRO-3 (and HSDP on a 2-D mesh)
    reshard_after_forward: bool | int | None  # None: the root keeps, every other group reshards

    @property
    def offloaded(self) -> CPUOffloadPolicy | None:
        return self.offload if isinstance(self.offload, CPUOffloadPolicy) else None

    @property
    def reshard_as_built(self) -> bool | int | None:
        """What the group is built with: ``reshard_after_forward``, except that a resident group (ZeRO-1/2) keeps
        its parameters through forward ([Note: resident groups]; the plan refuses anything but None/False)."""
        return False if self.sharding is not None and self.sharding.resident else self.reshard_after_forward


@dataclass(frozen=True)
class GroupSpec:
    """One group as ``fully_shard`` will build it, checked before anything is built ([Note: one plan])."""

    label: str  # the modules' classes (fully_shard) or paths (a policy file's plan), for messages
    modules: tuple[nn.Module, ...]
    paths: tuple[str, ...]  # each module's path in the model (a policy file's plan) or its class (fully_shard)
    params: tuple[ParamSpec, ...]
    settings: GroupSettings
    mesh: MeshShape | None  # None: not known yet (a policy file before apply)

    def on_mesh(self, mesh: MeshShape) -> GroupSpec:
        """The same group on ``mesh`` (a policy file's plan once the world size is known)."""
        return replace(self, mesh=mesh)

    @cached_property
    def casts(self) -> tuple[list[ModuleCast], list[tuple[str, str, str]]]:
        """The casts at the edges of the modules holding overridden parameters and their conflicts, worked out once
        for the plan's check and the build ([Note: override casts])."""
        return override_casts(self.params, self.settings.mixed_precision)


def group_problems(spec: GroupSpec) -> list[Problem]:
    """Every problem of ``spec``, none raised: the parameters, the policies, and (when known) the mesh."""
    problems = _module_problems(spec) + _param_problems(spec) + _policy_problems(spec)
    if spec.mesh is not None:
        problems += mesh_problems(spec)
    return problems


def _module_problems(spec: GroupSpec) -> list[Problem]:
    return [
        Problem(
            where,
            f"cannot shard a {type(module).__name__}: it has no forward, so its hooks would never run",
            f"shard its children instead: `for block in model.layers: fully_shard(block)`, or in a policy file "
            f"match: {{path: '{where}.*'}}",
        )
        for where, module in zip(spec.paths, spec.modules)
        if type(module).forward is nn.Module.forward
    ]


def _param_problems(spec: GroupSpec) -> list[Problem]:
    problems = []
    for p in spec.params:
        ndim = p.local.dim()
        if ndim == 0:
            problems.append(
                Problem(
                    p.fqn,
                    f"0-dim parameter (a scalar) of {p.owner}: fully_shard shards on dim 0",
                    f"make it shape (1,), or leave it unsharded: pass it in ignored_params (in a policy file, "
                    f"ignore: [{{path: {p.fqn}}}])",
                )
            )
        elif not -ndim <= p.shard_dim < ndim:
            problems.append(
                Problem(
                    p.fqn,
                    f"{p.dim_source} asks for dim {p.shard_dim}, but the parameter has shape {tuple(p.local.shape)}",
                    f"use a dim in 0 .. {ndim - 1} (or -{ndim} .. -1)",
                )
            )
    return problems


def settings_problems(settings: GroupSettings, label: str) -> list[Problem]:
    """The problems of a group's settings alone, whatever its parameters and mesh: the settings that contradict
    each other. A policy file's rules are checked for these before any model is built (``fsdp2lite validate``)."""
    problems = []
    sharding, offload = settings.sharding, settings.offloaded
    if sharding is not None and sharding.resident and settings.reshard_after_forward not in (None, False):
        problems.append(
            Problem(
                label,
                "sharding ShardingPolicy(shard='optimizer') (ZeRO-1/2) keeps the parameters unsharded between "
                f"steps, but reshard_after_forward={settings.reshard_after_forward!r} would free them",
                "leave reshard_after_forward at None / auto (or False), or shard='params'",
            )
        )
    if sharding is not None and sharding.align > 1 and (sharding.resident or sharding.replica_sharded):
        kind = "shard='optimizer' (ZeRO-1/2)" if sharding.resident else "replicate='optimizer' (HFSDP)"
        problems.append(
            Problem(
                label,
                f"ShardingPolicy(align={sharding.align}) pads ZeRO-3 and HSDP shards; {kind} is not built on aligned "
                "shards yet",
                "use align=1 with this sharding, or shard='params', replicate='none'",
            )
        )
    if offload is not None and offload.optimizer_only and sharding is not None and sharding.replica_sharded:
        problems.append(
            Problem(
                label,
                "CPUOffloadPolicy(optimizer_only=True) and ShardingPolicy(replicate='optimizer') (HFSDP) both "
                "move where the masters live",
                "pick one for this group",
            )
        )
    return problems


def _policy_problems(spec: GroupSpec) -> list[Problem]:
    problems = settings_problems(spec.settings, spec.label)
    named = {p.fqn: p.param for p in spec.params}
    problem = reduce_dtype_problem_by_policy(named, {p.fqn: p.mixed_precision for p in spec.params})
    if problem is not None:
        problems.append(
            Problem(
                spec.label,
                problem,
                "set the group's param_dtype (or reduce_dtype), freeze the odd parameters (requires_grad_(False)), "
                "or give them a group of their own",
            )
        )
    problems += [Problem(*problem) for problem in spec.casts[1]]  # [Note: override casts]
    problems += _post_forward_dims(spec) + _storage_problems(spec) + _quantized_gather_problems(spec)
    return problems


def _quantized_gather_problems(spec: GroupSpec) -> list[Problem]:
    """A quantized all-gather packs the group's parameters into one slot of one floating-point dtype: no
    parameter gathered through hooks, none of another dtype (an integer one, or one a precision override moves)."""
    comm = spec.settings.comm
    if comm is None or comm.all_gather is None or not spec.params:
        return []
    packed = [
        (p.fqn, None if p.hooked else cast_dtype(p.local, p.mixed_precision.param_dtype), p.local.is_floating_point())
        for p in spec.params
    ]
    reason = quantized_gather_problem(packed)
    if reason is None:
        return []
    overridden = [p.fqn for p in spec.params if p.overridden]
    if overridden and reason.startswith("of several dtypes"):
        reason += f"; precision overrides (mp_overrides / precision_overrides) move {', '.join(overridden[:4])}"
    return [
        Problem(
            spec.label,
            f"CommPolicy(all_gather={comm.all_gather!r}) quantizes a group's parameters together, but {reason}",
            "give them a group of their own, or keep all_gather=None (communication.all_gather: null) for this group",
        )
    ]


def _post_forward_dims(spec: GroupSpec) -> list[Problem]:
    value = spec.settings.reshard_after_forward
    if not is_rank_count(value) or value <= 1:
        return []
    if spec.mesh is not None and value >= spec.mesh.shard_size:
        return []  # the whole shard group: dim-0 chunks or not, it reshards as True
    problem = post_forward_dims_problem(value, [(p.fqn, p.dim) for p in spec.params if p.local.dim()])
    return [] if problem is None else [Problem(spec.label, *problem)]


def _storage_problems(spec: GroupSpec) -> list[Problem]:
    """What host masters, ZeRO-1/2 and HFSDP cannot hold: parameters gathered through hooks, and HFSDP's
    plain dim-0 parameters."""
    hooked = [p.fqn for p in spec.params if p.hooked]
    offload, sharding = spec.settings.offloaded, spec.settings.sharding
    problems = []
    if offload is not None and offload.optimizer_only:
        if hooked:
            problems.append(
                Problem(
                    spec.label,
                    "CPUOffloadPolicy(optimizer_only=True) keeps plain master shards on the host, but these gather "
                    f"through all-gather hooks (a tensor subclass such as NF4): {', '.join(hooked)}",
                    "offload them with optimizer_only=False (or not at all)",
                )
            )
    if sharding is not None and sharding.resident and hooked:
        problems.append(
            Problem(
                spec.label,
                "ShardingPolicy(shard='optimizer') keeps plain unsharded parameters, but these gather through "
                f"all-gather hooks (a tensor subclass such as NF4): {', '.join(hooked)}",
                "shard them with shard='params'",
            )
        )
    if sharding is not None and sharding.replica_sharded:
        odd = [f"{fqn} (all-gather hooks)" for fqn in hooked]
        odd += [f"{p.fqn} (tensor parallel)" for p in spec.params if p.tensor_parallel]
        odd += [f"{p.fqn} (Shard({p.dim}))" for p in spec.params if p.local.dim() and p.dim != 0]
        if odd:
            problems.append(
                Problem(
                    spec.label,
                    "ShardingPolicy(replicate='optimizer') (HFSDP) splits plain parameters sharded on dim 0 across "
                    f"the replicas; these are not: {', '.join(odd)}",
                    "give them a group with replicate='none'",
                )
            )
    return problems


def mesh_problems(spec: GroupSpec) -> list[Problem]:
    """The problems only the mesh decides (``spec.mesh`` set): the k of ``reshard_after_forward``, HFSDP's and
    per-parameter reduce dtypes' need of a 2-D mesh, tensor-parallel meshes, the NVMe directory."""
    mesh = spec.mesh
    if mesh is None:
        return []
    problems = []
    value = spec.settings.reshard_after_forward
    if is_rank_count(value):
        problem = post_forward_size_problem(value, mesh.shard_size)
        if problem is not None:
            problems.append(Problem(spec.label, *problem))
        align = 1 if spec.settings.sharding is None else spec.settings.sharding.align
        if problem is None and 1 < value < mesh.shard_size:
            problem = post_forward_align_problem(value, align)
            problems += [Problem(spec.label, *problem)] if problem is not None else []
    if spec.settings.sharding is not None and spec.settings.sharding.replica_sharded and mesh.replicate_size == 1:
        problems.append(
            Problem(
                spec.label,
                "ShardingPolicy(replicate='optimizer') (HFSDP) shards masters and optimizer state across the "
                f"replicas of a 2-D (replicate, shard) mesh, but this mesh is 1-D (shard {mesh.shard_size})",
                "pass init_device_mesh(..., (replicate, shard), mesh_dim_names=('replicate', 'shard')), or "
                "replicate='none'",
            )
        )
    return problems + _replica_dtype_problems(spec) + _tp_problems(spec) + _nvme_problems(spec)


def _replica_dtype_problems(spec: GroupSpec) -> list[Problem]:
    """On a 2-D mesh the step across replicas runs on the group's joined gradient, in one dtype."""
    if spec.mesh is None or spec.mesh.replicate_size == 1:
        return []
    by_dtype: dict[Any, list[str]] = {}
    for p in spec.params:
        if p.trainable:
            policy = p.mixed_precision
            by_dtype.setdefault(reduce_cast_dtype(p.param, policy.param_dtype, policy.reduce_dtype), []).append(p.fqn)
    if len(by_dtype) <= 1:
        return []
    listing = "; ".join(f"{str(d).removeprefix('torch.')}: {', '.join(names[:4])}" for d, names in by_dtype.items())
    return [
        Problem(
            spec.label,
            f"per-parameter precision overrides give this group's gradients several reduce dtypes ({listing}) on a "
            "2-D (HSDP) mesh, whose step across replicas runs in one dtype",
            "give the overridden parameters the group's reduce_dtype, or use a 1-D mesh",
        )
    ]


def _tp_problems(spec: GroupSpec) -> list[Problem]:
    """DTensor parameters (tensor parallel) must live on a sibling of the fully_shard mesh."""
    info = spec.mesh.info if spec.mesh is not None else None
    if info is None:
        return []
    problems = []
    for p in spec.params:
        if p.tensor_parallel and (problem := check_tp_mesh(info, p.param._spec)) is not None:  # type: ignore[attr-defined]
            problems.append(Problem(p.fqn, f"a DTensor (tensor parallel?) of {p.owner}, but {problem}", ""))
    return problems


def _nvme_problems(spec: GroupSpec) -> list[Problem]:
    """``optimizer='nvme'``: its directory must exist and be writable on this machine (checked with a real mesh,
    where the job runs: a policy file read elsewhere names a directory of the training machine)."""
    offload = spec.settings.offloaded
    if offload is None or offload.optimizer != "nvme" or offload.nvme_path is None:
        return []
    if spec.mesh is None or spec.mesh.info is None:
        return []  # a world size alone (explain): the directory is the training machine's
    trainable = sum(p.param.numel() * p.param.element_size() for p in spec.params if p.trainable)
    problem = nvme_path_problem(offload.nvme_path, 2 * -(-trainable // spec.mesh.shard_size))
    return [] if problem is None else [Problem("CPUOffloadPolicy(optimizer='nvme')", *problem)]
