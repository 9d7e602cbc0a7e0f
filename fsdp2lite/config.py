"""Whole sharding setups as data: ``FSDPConfig`` (the YAML schema), loading, rule matching, ``apply_config``.

    mesh: {replicate: 1, shard: -1}
    reshard_after_forward: auto          # true | false | int | auto (root false, others true)
    mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}
    offload: {device: none}              # none | cpu
    wrap:                                # ordered; the first rule a module matches wins
      - match: {class: Block}            # each matched module becomes its own group
      - match: {path: [norm, head]}
        group: true                      # all matches of this rule form one group
        mixed_precision: {param_dtype: fp32}
    ignore:
      - {path: "*.rotary.*"}             # parameters left unsharded and unreduced
    schedule:                            # the root's schedule settings; auto = the device's default
      forward_prefetch_depth: auto       # int >= 0 | auto (1 on CPU, 0 on CUDA)
      late_backward_prefetch: auto       # true | false | auto (true on CPU, false on CUDA)
      overlap_reduce_scatter: auto       # true | false | auto (false on CPU, true on CUDA)

YAML is read in exactly one function (``FSDPConfig.from_yaml``); everything after works on validated
objects. Errors are collected, not raised one by one: ``ConfigError.problems`` lists every problem
with its location, message and, for unknown keys, the closest valid key.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch.nn as nn
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .mesh import resolve_mesh_degrees
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, cast_dtype

_STRICT = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
ReshardAfterForward = bool | int | Literal["auto"]


class MeshConfig(BaseModel):
    """Device mesh degrees. ``replicate > 1`` means HSDP: shard within groups, replicate across them."""

    model_config = _STRICT

    replicate: int = Field(1, ge=1, description="replicas (outer mesh axis); 1 = plain FSDP")
    shard: int = Field(-1, description="ranks each parameter is sharded over; -1 = world_size / replicate")

    @field_validator("shard")
    @classmethod
    def _shard_positive_or_auto(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"shard must be a positive rank count or -1 (the remaining ranks), got {value}")
        return value

    def resolve(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) for ``world_size`` ranks; raises with the numbers when they do not fit."""
        return resolve_mesh_degrees(self.replicate, self.shard, world_size)


class OffloadConfig(BaseModel):
    """Where sharded parameters and gradients live between uses."""

    model_config = _STRICT

    device: Literal["none", "cpu"] = Field("none", description="none: on the device; cpu: on the host")
    pin_memory: bool = Field(True, description="pin host memory (with device: cpu) for async copies; needs CUDA")

    def to_policy(self) -> OffloadPolicy:
        return CPUOffloadPolicy(pin_memory=self.pin_memory) if self.device == "cpu" else OffloadPolicy()


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML requires unique keys; PyYAML
    would keep the last value silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(
                    Problem(
                        f"line {line}",
                        f"key {key!r} is given twice in one mapping (first on line {seen[key]})",
                        "keep one of them: YAML keys must be unique, and the last would silently win",
                    )
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class Match(BaseModel):
    """Which modules (or, under ``ignore``, which parameters) a rule selects; given keys must all match."""

    model_config = _STRICT

    class_: str | list[str] | None = Field(
        None, alias="class", description="module class name(s), e.g. Block or [Block, MLP]"
    )
    path: str | list[str] | None = Field(
        None, description="glob(s) over module paths (parameter names under ignore), e.g. 'layers.*'"
    )

    @model_validator(mode="after")
    def _not_empty(self) -> Match:
        if self.class_ is None and self.path is None:
            raise ValueError("a match needs 'class' and/or 'path'")
        return self

    def matches(self, path: str, class_name: str) -> bool:
        if self.class_ is not None and class_name not in _as_list(self.class_):
            return False
        return self.path is None or any(fnmatch.fnmatchcase(path, glob) for glob in _as_list(self.path))


class ScheduleConfig(BaseModel):
    """The root's schedule settings (docs/design.md, "Devices"); ``auto`` keeps the device's default."""

    model_config = _STRICT

    forward_prefetch_depth: int | Literal["auto"] = Field(
        "auto", description="groups all-gathered ahead in forward; auto: 1 on CPU, 0 on CUDA"
    )
    late_backward_prefetch: bool | Literal["auto"] = Field(
        "auto",
        description="in backward, all-gather the next group after this group's reduce-scatter (true) or at "
        "its pre-backward (false); auto: true on CPU, false on CUDA",
    )
    overlap_reduce_scatter: bool | Literal["auto"] = Field(
        "auto",
        description="wait each reduce-scatter one group later, overlapping the next group's backward (true) "
        "or right after issuing it (false); auto: false on CPU, true on CUDA",
    )

    @field_validator("forward_prefetch_depth", mode="before")
    @classmethod
    def _depth(cls, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, int) and value < 0):
            raise ValueError(f"forward_prefetch_depth is a group count >= 0 or auto, got {value!r}")
        return value

    def apply_to(self, root: Any) -> None:
        """Set every non-auto value on ``root`` (an FSDPModule that will be the root) through its
        ``set_<key>`` method, which checks it."""
        for key, value in self.model_dump().items():
            if value != "auto":
                getattr(root, f"set_{key}")(value)


class WrapRule(BaseModel):
    """One wrap rule: the modules it matches become groups, with optional policy overrides."""

    model_config = _STRICT

    match: Match = Field(description="which modules this rule takes")
    group: bool = Field(False, description="true: all matches form ONE group; false: one group per match")
    reshard_after_forward: ReshardAfterForward | None = Field(None, description="overrides the top-level value")
    mixed_precision: MixedPrecisionPolicy | None = Field(
        None, description="overrides the top-level fields it sets; the others are inherited"
    )
    offload: OffloadConfig | None = Field(None, description="overrides the top-level offload")
    reduce_scatter_unused_params: bool | None = Field(None, description="overrides the top-level value")
    unshard_in_backward: bool = Field(
        True, description="false: never all-gather these groups in backward (their backward needs no values)"
    )
    activation_checkpointing: bool = Field(
        False, description="true: recompute these modules' forward in backward instead of keeping activations"
    )


class ShardPlacementRule(BaseModel):
    """Parameters (by name glob) sharded on another dim than 0: ``shard_placement_fn`` as YAML."""

    model_config = _STRICT

    path: str | list[str] = Field(description="glob(s) over parameter names, e.g. '*.experts.*.weight'")
    dim: int = Field(description="the dim to shard on (torch.chunk along it); negative counts from the end")


class FSDPConfig(BaseModel):
    """A whole sharding setup: mesh, top-level policies, wrap rules, ignored parameters and the schedule."""

    model_config = _STRICT

    mesh: MeshConfig = Field(default_factory=MeshConfig, description="mesh degrees (see MeshConfig)")
    reshard_after_forward: ReshardAfterForward = Field(
        "auto",
        description="true | false | int (reshard to groups of that many ranks) | auto (root false, others true)",
    )
    mixed_precision: MixedPrecisionPolicy = Field(
        default_factory=MixedPrecisionPolicy, description="top-level mixed precision"
    )
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="top-level offload")
    wrap: list[WrapRule] = Field(default_factory=list, description="ordered wrap rules; first match wins")
    ignore: list[Match] = Field(default_factory=list, description="parameters left unsharded and unreduced")
    shard_placement: list[ShardPlacementRule] = Field(
        default_factory=list, description="parameters sharded on another dim than 0; first match wins"
    )
    reduce_scatter_unused_params: bool = Field(
        False, description="reduce zeros for parameters that got no gradient (ranks using different experts)"
    )
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig, description="the root's schedule settings (see ScheduleConfig)"
    )

    @field_validator("reshard_after_forward")
    @classmethod
    def _positive_int(cls, value: ReshardAfterForward) -> ReshardAfterForward:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"an int reshard_after_forward is a rank count >= 1, got {value}")
        return value

    @classmethod
    def from_yaml(cls, path: str | Path) -> FSDPConfig:
        """Load and validate a YAML file; raises ``ConfigError`` listing every problem found."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(path, [Problem("", f"cannot read the file: {exc.strerror or exc}", "")]) from None
        except UnicodeDecodeError:
            raise ConfigError(path, [Problem("", "not a text file (not UTF-8): is this a YAML config?", "")]) from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
        except _DuplicateKey as exc:
            raise ConfigError(path, [exc.problem]) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(path, [Problem(where, f"not valid YAML: {problem}", "")]) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            found = type(data).__name__
            raise ConfigError(path, [Problem("", f"the top level must be a mapping of keys, got a {found}", "")])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(path, problems_from(exc)) from None

    def to_yaml(self) -> str:
        """The config as YAML (dtypes by their short names); ``from_yaml`` reads it back equal."""
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


# ---- errors ---------------------------------------------------------------------------------------
class Problem(NamedTuple):
    """One problem in a config: where, what, and what would be valid."""

    location: str  # dotted path, e.g. "wrap.1.match.clas"
    message: str
    suggestion: str


class ConfigError(ValueError):
    """Every problem found in one config (or in applying it), reported together."""

    def __init__(self, source: str | Path, problems: list[Problem]) -> None:
        self.source = str(source)
        self.problems = problems
        lines = [f"{self.source}: {len(problems)} problem(s)"]
        for p in problems:
            hint = f" ({p.suggestion})" if p.suggestion else ""
            lines.append(f"  {p.location or '<top>'}: {p.message}{hint}")
        super().__init__("\n".join(lines))


def problems_from(exc: ValidationError) -> list[Problem]:
    """pydantic's errors as Problems; unknown keys get the closest valid key as a suggestion, and a value
    no member of a union accepts is one problem listing what would be valid (not one per member)."""
    problems: list[Problem] = []
    unions: dict[tuple[Any, ...], tuple[int, list[Any]]] = {}  # parent location -> (problem index, errors)
    for error in exc.errors():
        loc = tuple(error["loc"])
        location = ".".join(str(part) for part in loc)
        if error["type"] == "extra_forbidden":
            valid = _valid_keys(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            suggestion = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
            problems.append(Problem(location, f"unknown key '{loc[-1]}'", suggestion))
        elif _union_member(loc):
            if loc[:-1] not in unions:
                unions[loc[:-1]] = (len(problems), [])
                problems.append(Problem("", "", ""))  # a placeholder, keeping the order: filled in below
            unions[loc[:-1]][1].append(error)
        else:
            problems.append(Problem(location, error["msg"].removeprefix("Value error, "), ""))
    for parent, (index, errors) in unions.items():
        accepted = ", ".join(_member_phrase(str(error["loc"][-1])) for error in errors)
        location = ".".join(str(part) for part in parent)
        problems[index] = Problem(location, f"{errors[0]['input']!r} is not valid here", f"use {accepted}")
    return problems


def _union_member(loc: tuple[Any, ...]) -> bool:
    """pydantic tags an error of one union member with the member's type ('bool', 'int',
    "literal['auto']", 'list[str]'): a last location part that is no key where it stands."""
    if len(loc) < 2 or not isinstance(loc[-1], str):
        return False
    return loc[-1] not in _valid_keys(loc[:-1]) and loc[-2] in _valid_keys(loc[:-2])


def _member_phrase(tag: str) -> str:
    """How a union member's tag reads in a suggestion: ``literal['auto']`` -> ``auto``."""
    if tag.startswith("literal["):
        return tag.removeprefix("literal[").removesuffix("]").replace("'", "")
    return {"bool": "true or false", "int": "an integer", "str": "a string", "list[str]": "a list of strings"}.get(
        tag, tag
    )


def _valid_keys(loc: Sequence[str | int]) -> list[str]:
    """Keys allowed at ``loc`` in the FSDPConfig schema (aliases as written in YAML)."""
    model: Any = FSDPConfig
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part) or next((f for f in model.model_fields.values() if f.alias == part), None)
        if info is None:
            return []
        model = _model_in(info.annotation)
        if model is None:
            return []
    return [info.alias or name for name, info in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like ``list[Match]`` or ``Match | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


# ---- planning: which modules become which groups, under which policies ---------------------------
@dataclass(frozen=True)
class GroupPolicy:
    """The effective policies of one group (top-level values with the rule's overrides)."""

    reshard_after_forward: ReshardAfterForward
    mixed_precision: MixedPrecisionPolicy
    offload: OffloadConfig
    reduce_scatter_unused_params: bool = False
    unshard_in_backward: bool = True
    activation_checkpointing: bool = False

    def fully_shard_kwargs(self) -> dict[str, Any]:
        value = self.reshard_after_forward
        return {
            "reshard_after_forward": None if value == "auto" else value,
            "mp_policy": self.mixed_precision,
            "offload_policy": self.offload.to_policy(),
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


def plan_config(model: nn.Module, config: FSDPConfig) -> Plan:
    """Match the wrap rules (first match wins) and ignore rules, assign each parameter to the group
    ``fully_shard`` would give it (groups in plan order), and collect every problem: rules that match
    nothing, parameters tied across groups, 0-dim parameters."""
    plan = Plan()
    top = GroupPolicy(
        config.reshard_after_forward, config.mixed_precision, config.offload, config.reduce_scatter_unused_params
    )
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
    plan.refused.extend(_dtype_problems(plan))
    _plan_shard_dims(model, config, plan)
    return plan


def _dtype_problems(plan: Plan) -> list[Problem]:
    """A group all-gathers in one dtype: mixed parameter dtypes need a param_dtype (fully_shard's check)."""
    problems = []
    for group, params in zip(plan.groups, plan.params):
        param_dtype = group.policy.mixed_precision.param_dtype
        dtypes = {str(cast_dtype(p, param_dtype)).removeprefix("torch.") for p in params.values()}
        if len(dtypes) > 1:
            label = " + ".join(path or "<root>" for path in group.paths)
            problems.append(
                Problem(
                    label,
                    f"its parameters have several dtypes ({', '.join(sorted(dtypes))}), but a group all-gathers in one",
                    "set mixed_precision.param_dtype for it, or give those parameters a group of their own",
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
        hits = [name for name in params if any(fnmatch.fnmatchcase(name, g) for g in _as_list(rule.path))]
        if not hits:
            plan.problems.append(
                Problem(
                    f"shard_placement.{index}",
                    "matches no parameter",
                    f"parameter names look like: {next(iter(params), '')}",
                )
            )
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
    return GroupPolicy(
        top.reshard_after_forward if rule.reshard_after_forward is None else rule.reshard_after_forward,
        mixed,
        top.offload if rule.offload is None else rule.offload,
        unused if rule.reduce_scatter_unused_params is None else rule.reduce_scatter_unused_params,
        rule.unshard_in_backward,
        rule.activation_checkpointing,
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


def apply_config(model: nn.Module, config: FSDPConfig, mesh: Any = None) -> nn.Module:
    """Shard ``model`` as ``config`` says: matched groups bottom-up, then the root; returns ``model``.

    ``mesh`` defaults to one built from ``config.mesh`` over the default process group. All or nothing:
    every rule, parameter and mesh-dependent value is checked first (``ConfigError`` listing every
    problem), and if sharding still fails part-way, every module is put back as it was.
    """
    from ._snapshot import ModuleSnapshot
    from .api import FSDPModule, fully_shard
    from .mesh import init_mesh, mesh_info_for

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
        problems += mesh_problems(plan, config, mesh_info_for(mesh).shard_size)
    if problems:
        raise ConfigError("config applied to " + type(model).__name__, problems)
    snapshot = ModuleSnapshot(model.modules())
    try:
        _shard_plan(model, config, plan, mesh, fully_shard)
    except BaseException:
        snapshot.restore()  # all or nothing: the model is as it was before the call
        raise
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


def _shard_plan(model: nn.Module, config: FSDPConfig, plan: Plan, mesh: Any, fully_shard: Any) -> None:
    ignored = set(plan.ignored.values())
    params = dict(model.named_parameters())
    dims = {id(params[name]): dim for name, dim in plan.shard_dims.items()}
    placement_fn = _placement_fn(dims) if dims else None
    for group in plan.groups:
        kwargs = group.policy.fully_shard_kwargs()
        target: Any = group.modules[0] if len(group.modules) == 1 else list(group.modules)
        fully_shard(target, mesh, ignored_params=ignored, shard_placement_fn=placement_fn, **kwargs)
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
    after the group's pre-backward unshard ([Note: recompute] in _runtime/state.py)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]


def _placement_fn(dims: dict[int, int]) -> Any:
    from torch.distributed.tensor import Shard

    def shard_placement_fn(param: nn.Parameter) -> Any:
        dim = dims.get(id(param))
        return None if dim is None else Shard(dim)

    return shard_placement_fn


def _device_type(model: nn.Module) -> str:
    import torch

    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if devices:
        return devices.pop()
    return "cuda" if torch.cuda.is_available() else "cpu"
