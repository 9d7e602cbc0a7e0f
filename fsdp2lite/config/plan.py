"""Planning: which modules become which groups under which policies, and every check that needs the model.

``plan_config(model, config)`` matches the wrap rules against ``model.named_modules()`` (first rule wins),
collects the ignored and the dim-sharded parameters and records every problem instead of raising, so
``apply_config``, ``explain`` and ``estimate`` refuse exactly the same things.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..policies import CommPolicy, MixedPrecisionPolicy, ShardingPolicy, reduce_dtype_problem_by_policy
from .errors import Problem
from .schema import FSDPConfig, OffloadConfig, ReshardAfterForward, WrapRule, as_list


@dataclass(frozen=True)
class GroupPolicy:
    """The effective policies of one group (top-level values with the rule's overrides)."""

    reshard_after_forward: ReshardAfterForward
    mixed_precision: MixedPrecisionPolicy
    offload: OffloadConfig
    reduce_scatter_unused_params: bool = False
    unshard_in_backward: bool = True
    activation_checkpointing: bool = False
    communication: CommPolicy = field(default_factory=CommPolicy)
    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)

    def fully_shard_kwargs(self) -> dict[str, Any]:
        value = self.reshard_after_forward
        return {
            "reshard_after_forward": None if value == "auto" else value,
            "mp_policy": self.mixed_precision,
            "offload_policy": self.offload.to_policy(),
            "comm_policy": self.communication if self.communication.active else None,
            "sharding": self.sharding if self.sharding != ShardingPolicy() else None,
        }


@dataclass(frozen=True)
class GroupPlan:
    """One planned ``fully_shard`` call."""

    paths: tuple[str, ...]  # module paths ("" is the root)
    modules: tuple[nn.Module, ...]
    rule_index: int | None  # index into config.wrap; None for the root
    policy: GroupPolicy
    depth: int  # deepest module's depth: groups are applied deepest first


@dataclass
class Plan:
    """The result of matching a config's rules against a model, before anything is sharded."""

    groups: list[GroupPlan] = field(default_factory=list)  # bottom-up order, root last
    params: list[dict[str, nn.Parameter]] = field(default_factory=list)  # per group: name -> parameter
    ignored: dict[str, nn.Parameter] = field(default_factory=dict)  # parameter path -> parameter
    problems: list[Problem] = field(default_factory=list)  # rules that match nothing
    refused: list[Problem] = field(default_factory=list)  # parameters that cannot be sharded as planned
    shard_dims: dict[str, int] = field(default_factory=dict)  # parameter path -> shard dim, for matched ones
    precision: dict[str, MixedPrecisionPolicy] = field(default_factory=dict)  # parameter path -> its override


def plan_config(model: nn.Module, config: FSDPConfig) -> Plan:
    """Match the wrap rules (first match wins) and ignore rules, assign each parameter to the group
    ``fully_shard`` would give it (groups in plan order), and collect every problem: rules that match
    nothing, parameters tied across groups, 0-dim parameters."""
    plan = Plan()
    top = GroupPolicy(
        config.reshard_after_forward, config.mixed_precision, config.offload, config.reduce_scatter_unused_params,
        communication=config.communication, sharding=config.sharding,
    )  # fmt: skip
    matched: list[list[tuple[str, nn.Module]]] = [[] for _ in config.wrap]
    for path, module in model.named_modules():
        if path == "":
            continue  # the root gets the top-level policy
        for index, rule in enumerate(config.wrap):
            if rule.match.matches(path, type(module).__name__):
                matched[index].append((path, module))
                break
    class_names = sorted({type(m).__name__ for m in model.modules()})
    for index, (rule, hits) in enumerate(zip(config.wrap, matched)):
        if not hits:
            plan.problems.append(
                Problem(f"wrap.{index}.match", "matches no module", f"the model's classes: {', '.join(class_names)}")
            )
            continue
        policy = _rule_policy(top, rule)
        batches = [hits] if rule.group else [[hit] for hit in hits]
        for batch in batches:
            paths = tuple(p for p, _ in batch)
            depth = max(p.count(".") + 1 for p in paths)
            plan.groups.append(GroupPlan(paths, tuple(m for _, m in batch), index, policy, depth))
    for group in plan.groups:
        for path, module in zip(group.paths, group.modules):
            if type(module).forward is nn.Module.forward:
                plan.refused.append(
                    Problem(
                        path,
                        f"a {type(module).__name__} has no forward, so fully_shard cannot make it a group "
                        f"(matched by wrap.{group.rule_index})",
                        f"match its children instead, e.g. path: '{path}.*'",
                    )
                )
    plan.groups.sort(key=lambda g: -g.depth)  # stable: rule order within a depth
    plan.groups.append(GroupPlan(("",), (model,), None, top, 0))
    _plan_ignored(model, config, plan, class_names)
    plan.params, refused = _assign_params(plan.groups, {id(p) for p in plan.ignored.values()})
    plan.refused.extend(refused)
    _plan_precision(model, config, plan)
    plan.refused.extend(_dtype_problems(plan))
    plan.refused.extend(_resident_problems(plan))
    _plan_shard_dims(model, config, plan)
    return plan


def _rule_hits(names: list[str], paths: str | list[str], location: str, plan: Plan) -> list[str]:
    """The parameter names a rule's path glob(s) match; none: a problem at ``location``, naming the path."""
    hits = [name for name in names if any(fnmatch.fnmatchcase(name, glob) for glob in as_list(paths))]
    if not hits:
        plan.problems.append(
            Problem(
                location, f"matches no parameter (path {paths!r})", f"parameter names look like: {', '.join(names[:3])}"
            )
        )
    return hits


def _plan_precision(model: nn.Module, config: FSDPConfig, plan: Plan) -> None:
    """Each ``precision_overrides`` rule's parameters (first match wins); a rule matching none is a problem."""
    params = [name for name, _ in model.named_parameters() if name not in plan.ignored]
    for index, rule in enumerate(config.precision_overrides):
        for name in _rule_hits(params, rule.path, f"precision_overrides.{index}", plan):
            plan.precision.setdefault(name, rule.policy())


def _resident_problems(plan: Plan) -> list[Problem]:
    """ZeRO-1/2 groups keep their parameters: a reshard_after_forward that frees them contradicts it."""
    problems = []
    for group in plan.groups:
        value = group.policy.reshard_after_forward
        if group.policy.sharding.resident and value not in ("auto", False):
            label = " + ".join(path or "<root>" for path in group.paths)
            problems.append(
                Problem(
                    label,
                    f"sharding.shard: optimizer (ZeRO-1/2) keeps the parameters unsharded between steps, but "
                    f"reshard_after_forward: {str(value).lower()} would free them",
                    "leave reshard_after_forward at auto (or false) for it, or use sharding.shard: params",
                )
            )
    return problems


def _dtype_problems(plan: Plan) -> list[Problem]:
    """fully_shard's rule: a group's trainable parameters under one policy reduce in one dtype
    (``reduce_dtype_problem``; an override's parameters reduce apart: ``precision_overrides``)."""
    problems = []
    for group, params in zip(plan.groups, plan.params):
        policies = {name: plan.precision.get(name, group.policy.mixed_precision) for name in params}
        problem = reduce_dtype_problem_by_policy(params, policies)
        if problem is not None:
            label = " + ".join(path or "<root>" for path in group.paths)
            problems.append(
                Problem(
                    label,
                    problem,
                    "set mixed_precision.param_dtype (or reduce_dtype) for it, freeze the odd parameters, or give "
                    "them a group of their own",
                )
            )
    return problems


def mesh_problems(plan: Plan, config: FSDPConfig, shard_size: int) -> list[Problem]:
    """What only the mesh decides: an int ``reshard_after_forward`` must divide the shard degree. Shared
    by ``apply_config`` (its mesh) and ``explain`` (its ``--world-size``)."""
    problems = []
    divisors = [k for k in range(1, shard_size + 1) if shard_size % k == 0]
    for group in plan.groups:
        value = group.policy.reshard_after_forward
        if isinstance(value, int) and not isinstance(value, bool) and shard_size % value:
            rule = group.rule_index
            location = (
                "reshard_after_forward"
                if rule is None or config.wrap[rule].reshard_after_forward is None
                else f"wrap.{rule}.reshard_after_forward"
            )
            problem = Problem(
                location,
                f"{value} does not divide the shard degree {shard_size}",
                f"use one of {divisors}, true or false",
            )
            if problem not in problems:
                problems.append(problem)
    return problems


def _plan_shard_dims(model: nn.Module, config: FSDPConfig, plan: Plan) -> None:
    """Each ``shard_placement`` rule's parameters (first match wins), with their dims checked."""
    params = {name: p for name, p in model.named_parameters() if name not in plan.ignored}
    for index, rule in enumerate(config.shard_placement):
        hits = _rule_hits(list(params), rule.path, f"shard_placement.{index}", plan)
        for name in hits:
            if name in plan.shard_dims:
                continue  # an earlier rule took it
            ndim = params[name].dim()
            if not -ndim <= rule.dim < ndim:
                plan.refused.append(
                    Problem(
                        name,
                        f"shard_placement.{index} asks for dim {rule.dim}, but the parameter has shape "
                        f"{tuple(params[name].shape)}",
                        f"use a dim in 0 .. {ndim - 1} (or -{ndim} .. -1), or a narrower path",
                    )
                )
                continue
            plan.shard_dims[name] = rule.dim % ndim
    for name, dim in plan.shard_dims.items():
        group = next((g for g, owned in zip(plan.groups, plan.params) if name in owned), None)
        reshard = group.policy.reshard_after_forward if group is not None else None
        if dim and isinstance(reshard, int) and not isinstance(reshard, bool) and reshard > 1:
            plan.refused.append(
                Problem(
                    name,
                    f"sharded on dim {dim}, but its group reshards to {reshard} ranks after forward (dim-0 chunks)",
                    "use reshard_after_forward: true or false for that group, or shard the parameter on dim 0",
                )
            )


def _rule_policy(top: GroupPolicy, rule: WrapRule) -> GroupPolicy:
    mixed = top.mixed_precision
    if rule.mixed_precision is not None:
        overrides = {k: getattr(rule.mixed_precision, k) for k in rule.mixed_precision.model_fields_set}
        mixed = mixed.model_copy(update=overrides)
    unused = top.reduce_scatter_unused_params
    communication = top.communication
    if rule.communication is not None:
        overrides = {k: getattr(rule.communication, k) for k in rule.communication.model_fields_set}
        communication = communication.model_copy(update=overrides)
    return GroupPolicy(
        top.reshard_after_forward if rule.reshard_after_forward is None else rule.reshard_after_forward,
        mixed,
        top.offload if rule.offload is None else rule.offload,
        unused if rule.reduce_scatter_unused_params is None else rule.reduce_scatter_unused_params,
        rule.unshard_in_backward,
        rule.activation_checkpointing,
        communication,
        top.sharding if rule.sharding is None else rule.sharding,
    )


def _plan_ignored(model: nn.Module, config: FSDPConfig, plan: Plan, class_names: list[str]) -> None:
    owners = {join_path(mp, n): type(m).__name__ for mp, m in model.named_modules() for n in m._parameters}
    params = dict(model.named_parameters())
    for index, rule in enumerate(config.ignore):
        hits = [name for name in params if rule.matches(name, owners.get(name, ""))]
        if not hits:
            plan.problems.append(
                Problem(
                    f"ignore.{index}", "matches no parameter", f"parameter names look like: {next(iter(params), '')}"
                )
            )
        for name in hits:
            plan.ignored[name] = params[name]


def _assign_params(groups: list[GroupPlan], ignored: set[int]) -> tuple[list[dict[str, nn.Parameter]], list[Problem]]:
    """Each group's parameters (name -> parameter), sharding in plan order as ``apply_config`` does."""
    owned: list[dict[str, nn.Parameter]] = []
    refused: list[Problem] = []  # fully_shard raises for these, or (ties across sibling groups) unties them
    applied: set[int] = set()  # ids of modules of groups sharded before this one
    taken: dict[int, str] = {}  # id(parameter) -> label of the group that owns it
    for group in groups:
        label = " + ".join(path or "<root>" for path in group.paths)
        params: dict[str, nn.Parameter] = {}
        for name, param in _group_params(group, applied, ignored):
            if id(param) in taken:
                if taken[id(param)] != label:
                    refused.append(_tie_problem(name, taken[id(param)]))
                continue
            taken[id(param)] = label
            params[name] = param
            if param.dim() == 0:
                refused.append(Problem(name, "0-dim parameter: fully_shard shards on dim 0", _ignore_hint(name)))
        owned.append(params)
        applied.update(id(module) for module in group.modules)
    return owned, refused


def _tie_problem(name: str, owner: str) -> Problem:
    return Problem(
        name,
        f"tied to a parameter that group '{owner}' already owns; a tie must stay within one group",
        "put the modules sharing it in one rule with group: true, or leave them to one enclosing group",
    )


def _ignore_hint(name: str) -> str:
    return f"make it shape (1,), or leave it unsharded: ignore: [{{path: {name}}}]"


def _group_params(group: GroupPlan, applied: set[int], ignored: set[int]) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of the group's modules, not descending into modules of earlier groups."""
    seen: set[int] = set()
    for path, module in zip(group.paths, group.modules):
        for prefix, submodule in _walk(module, path, applied, seen):
            for name, param in submodule._parameters.items():
                if param is not None and id(param) not in ignored:
                    yield join_path(prefix, name), param


def _walk(module: nn.Module, path: str, applied: set[int], seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    if id(module) in seen:
        return
    seen.add(id(module))
    yield path, module
    for name, child in module.named_children():
        if id(child) not in applied:
            yield from _walk(child, join_path(path, name), applied, seen)


def join_path(prefix: str, name: str) -> str:
    """A module or parameter path: ``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name
