"""Planning: which modules become which groups under which policies, and every check that needs the model.

``plan_config(model, config)`` matches the wrap rules against ``model.named_modules()`` (first rule wins),
collects the ignored and the dim-sharded parameters and records every problem instead of raising, so
``apply_config``, ``explain`` and ``estimate`` refuse exactly the same things.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from .._plan import (
    GroupSettings,
    GroupSpec,
    MeshShape,
    ParamSpec,
    group_problems,
    join_path,
    owned_params,
    settings_problems,
)
from .._plan import mesh_problems as plan_mesh_problems
from ..mesh import MeshInfo
from ..policies import CommPolicy, MixedPrecisionPolicy, ShardingPolicy
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
    dim_rules: dict[str, int] = field(default_factory=dict)  # parameter path -> the shard_placement rule that set it
    specs: list[GroupSpec] = field(default_factory=list)  # per group: what fully_shard will build ([Note: one plan])
    places: dict[str, tuple[tuple[nn.Module, str], ...]] = field(default_factory=dict)  # path -> (module, attribute)s


def plan_config(model: nn.Module, config: FSDPConfig) -> Plan:
    """Match the wrap rules (first match wins) and ignore rules, assign each parameter to the group
    ``fully_shard`` would give it (groups in plan order), and collect every problem: rules that match
    nothing, parameters tied across groups, 0-dim parameters."""
    plan = Plan()
    top = _top_policy(config)
    matched: list[list[tuple[str, nn.Module]]] = [[] for _ in config.wrap]
    tests = [rule.match.matcher() for rule in config.wrap]
    for path, module in model.named_modules():
        if path == "":
            continue  # the root gets the top-level policy
        for index, test in enumerate(tests):
            if test(path, type(module).__name__):
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
        batches = [hits] if rule.group is True else tied_batches(hits) if rule.group == "tied" else [[h] for h in hits]
        for batch in batches:
            paths = tuple(p for p, _ in batch)
            depth = max(p.count(".") + 1 for p in paths)
            plan.groups.append(GroupPlan(paths, tuple(m for _, m in batch), index, policy, depth))
    plan.groups.sort(key=lambda g: -g.depth)  # stable: rule order within a depth
    plan.groups.append(GroupPlan(("",), (model,), None, top, 0))
    _plan_ignored(model, config, plan, class_names)
    plan.params, refused = _assign_params(plan.groups, plan)
    plan.refused.extend(refused)
    _plan_precision(model, config, plan)
    _plan_shard_dims(model, config, plan)
    plan.specs = [_group_spec(group, params, plan) for group, params in zip(plan.groups, plan.params)]
    for spec in plan.specs:
        plan.refused.extend(group_problems(spec))  # fully_shard's own checks ([Note: one plan])
    return plan


def tied_batches(hits: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """``group: tied``: one batch per matched module, but modules sharing a parameter (a tied embedding and
    head) in one batch, in match order: ``[wte, wpe, lm_head]`` with ``lm_head.weight is wte.weight`` gives
    ``[[wte, lm_head], [wpe]]``."""
    batches: list[list[tuple[str, nn.Module]]] = []
    owner: dict[int, int] = {}  # id(parameter) -> index of the batch holding it
    for path, module in hits:
        ids = [id(p) for p in module.parameters()]
        joined = next((owner[i] for i in ids if i in owner), None)
        if joined is None:
            joined = len(batches)
            batches.append([])
        batches[joined].append((path, module))
        owner.update((i, joined) for i in ids)
    return batches


def _group_spec(group: GroupPlan, params: dict[str, nn.Parameter], plan: Plan) -> GroupSpec:
    """The spec ``fully_shard`` builds for ``group`` (no mesh yet), its parameters named by model paths."""
    policy = group.policy
    specs = []
    for name, param in params.items():
        override = plan.precision.get(name)
        rule = plan.dim_rules.get(name)
        specs.append(
            ParamSpec(
                name,
                param,
                plan.places[name],
                plan.shard_dims.get(name, 0),
                "the default" if rule is None else f"shard_placement.{rule}",
                override or policy.mixed_precision,
                override is not None,
            )
        )
    label = " + ".join(path or "<root>" for path in group.paths)
    return GroupSpec(label, group.modules, group.paths, tuple(specs), _settings(policy), mesh=None)


def _settings(policy: GroupPolicy) -> GroupSettings:
    """``policy`` as the settings ``fully_shard`` takes."""
    kwargs = policy.fully_shard_kwargs()
    return GroupSettings(
        policy.mixed_precision,
        kwargs["offload_policy"],
        kwargs["comm_policy"],
        kwargs["sharding"],
        kwargs["reshard_after_forward"],
    )


def policy_problems(config: FSDPConfig) -> list[Problem]:
    """What contradicts itself in the top level's policy or a rule's, found without a model: ``fully_shard``'s
    own checks of a group's settings (``settings_problems``), on the policy each rule's groups and the root get.
    ``plan_config`` finds the same on each planned group; ``fsdp2lite validate`` reports these."""
    top = _top_policy(config)
    policies = [("", top)] + [(f"wrap.{index}", _rule_policy(top, rule)) for index, rule in enumerate(config.wrap)]
    return [problem for where, policy in policies for problem in settings_problems(_settings(policy), where)]


def _top_policy(config: FSDPConfig) -> GroupPolicy:
    """The root's policy: the top-level values."""
    return GroupPolicy(
        config.reshard_after_forward,
        config.mixed_precision,
        config.offload,
        config.reduce_scatter_unused_params,
        communication=config.communication,
        sharding=config.sharding,
    )


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


def mesh_problems(
    plan: Plan, config: FSDPConfig, shard_size: int, replicate_size: int = 1, info: MeshInfo | None = None
) -> list[Problem]:
    """What only the mesh decides (an int ``reshard_after_forward`` must divide the shard degree, HFSDP needs
    replicas...): ``fully_shard``'s mesh checks on each planned group. Shared by ``apply_config`` (its mesh, whose
    ``info`` adds the checks that need the mesh itself: tensor-parallel meshes, the NVMe directory) and
    ``explain`` (its ``--world-size``). ``config``: kept for callers of earlier releases."""
    mesh = MeshShape(shard_size, replicate_size, info)
    problems: list[Problem] = []
    for group, spec in zip(plan.groups, plan.specs):
        rule = "" if group.rule_index is None else f"wrap.{group.rule_index}"
        for problem in plan_mesh_problems(spec.on_mesh(mesh)):
            if problem.location == spec.label:  # a group's setting: name the rule that gave it, once for its groups
                problem = problem._replace(location=rule)
            if problem not in problems:
                problems.append(problem)
    return problems


def _plan_shard_dims(model: nn.Module, config: FSDPConfig, plan: Plan) -> None:
    """Each ``shard_placement`` rule's parameters (first match wins); the dims are checked with the rest of the
    group's plan (``_plan.group_problems``)."""
    params = {name: p for name, p in model.named_parameters() if name not in plan.ignored}
    for index, rule in enumerate(config.shard_placement):
        for name in _rule_hits(list(params), rule.path, f"shard_placement.{index}", plan):
            if name not in plan.shard_dims:  # else an earlier rule took it
                ndim = params[name].dim()
                plan.shard_dims[name] = rule.dim % ndim if -ndim <= rule.dim < ndim else rule.dim  # else refused
                plan.dim_rules[name] = index


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


def _assign_params(groups: list[GroupPlan], plan: Plan) -> tuple[list[dict[str, nn.Parameter]], list[Problem]]:
    """Each group's parameters (name -> parameter), sharding in plan order as ``apply_config`` does: the walk
    ``fully_shard`` makes (``_plan.owned_params``), stopping at the modules of the groups planned before."""
    ignored = {id(p) for p in plan.ignored.values()}
    owned: list[dict[str, nn.Parameter]] = []
    refused: list[Problem] = []  # ties across sibling groups: fully_shard raises for them
    applied: set[int] = set()  # ids of modules of groups sharded before this one
    taken: dict[int, str] = {}  # id(parameter) -> label of the group that owns it
    for group in groups:
        label = " + ".join(path or "<root>" for path in group.paths)
        params: dict[str, nn.Parameter] = {}
        for name, param, places in owned_params(zip(group.paths, group.modules), lambda m: id(m) in applied, ignored):
            if id(param) in taken:
                if taken[id(param)] != label:
                    refused.append(_tie_problem(name, taken[id(param)]))
                continue
            taken[id(param)] = label
            params[name] = param
            plan.places[name] = tuple(places)
        owned.append(params)
        applied.update(id(module) for module in group.modules)
    return owned, refused


def _tie_problem(name: str, owner: str) -> Problem:
    return Problem(
        name,
        f"tied to a parameter that group '{owner}' already owns; a tie must stay within one group",
        "put the modules sharing it in one rule with group: true, or leave them to one enclosing group",
    )
