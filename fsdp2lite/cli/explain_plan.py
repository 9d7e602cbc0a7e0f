"""``explain``'s numbers, as data: per planned group what its ``fully_shard`` call would own and what each
rank would hold, computed from ``plan_config`` without a process group; and the groups that repeat.

Which group owns a parameter follows ``fully_shard``: a group owns the parameters of its modules that
no group sharded before it owns (groups are sharded in plan order), minus the ignored ones; tied
parameters are counted once. A rank's bytes for one parameter are its padded shard as stored
(``estimate.analytic.stored_nbytes``, the function the estimators' S term sums):
``ceil(size(d) / shard) * (numel / size(d)) * element_size`` for its shard dim d (0 unless
``shard_placement`` says otherwise), with ``shard`` the mesh's shard degree; for a weight qlora keeps in
NF4, that many weights at NF4's 4.127 bits.

A fine-tuning job (``finetune`` lora or qlora) is counted on the model ``estimate.finetune.plan_model``
makes, the one the estimators and ``examples/train.py --finetune`` train: the base frozen in bf16, fp32
LoRA adapters, for qlora the adapted base weights in NF4.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .._plan import GroupSpec
from ..config import FSDPConfig, GroupPlan, GroupPolicy, Problem, ScheduleConfig, join_path, mesh_problems, plan_config
from ..config.schema import as_list
from ..estimate.finetune import Finetune, PlannedLora, nf4_bytes
from ..estimate.plan_bytes import nf4_paths, stored_nbytes
from ..migrate.blocks import block_classes
from ..policies import short_dtype_name

LARGE_MODULE_SHARE = 0.10  # a module left in the root group with this share of the model's bytes is flagged


@dataclass(frozen=True)
class GroupRow:
    """One planned group: what its ``fully_shard`` call would own and what each rank would hold."""

    paths: tuple[str, ...]  # module paths; "" is the root
    rule: str  # the rule that matched: "wrap[0]: class=Block", or "top-level" for the root
    param_names: tuple[str, ...]  # the parameters it owns, tied ones once
    numel: int  # parameter elements
    sharded_bytes: int  # per rank: the padded local shards, as stored (NF4 for qlora's adapted weights)
    unsharded_bytes: int  # the full parameters, as stored
    policy: GroupPolicy
    shard_dims: tuple[int, ...] = ()  # per parameter in param_names: the dim it is sharded on
    precision: tuple[str, ...] = ()  # per overridden parameter: "param_dtype/reduce_dtype" (precision_overrides)
    class_name: str = ""  # its modules' classes, "+"-joined
    shapes: tuple[tuple[int, ...], ...] = ()  # per parameter in param_names
    trainable_numel: int = 0  # elements of the parameters that get gradients and optimizer state
    storage: tuple[tuple[str, int], ...] = ()  # per rank, sharded bytes by kind: ("NF4 frozen", n), ...

    @property
    def is_root(self) -> bool:
        return self.paths == ("",)

    @property
    def label(self) -> str:
        return " + ".join(path or "<root>" for path in self.paths)

    def same_as(self, other: GroupRow) -> bool:
        """Identical but for where it is: one module of the same class, rule, parameters (names under the
        module, shapes, bytes, trainability) and policies. The root is like no other group."""
        if self.is_root or other.is_root or len(self.paths) != 1 or len(other.paths) != 1:
            return False
        return self._shape() == other._shape() and self.policy == other.policy

    def _shape(self) -> tuple[object, ...]:
        prefix = self.paths[0] + "."
        local = tuple(name.removeprefix(prefix) for name in self.param_names)
        return (
            self.class_name,
            self.rule,
            local,
            self.shapes,
            self.numel,
            self.sharded_bytes,
            self.unsharded_bytes,
            self.trainable_numel,
            self.storage,
            self.shard_dims,
            self.precision,
        )


@dataclass(frozen=True)
class GroupRun:
    """Identical groups (``GroupRow.same_as``), shown as one node: ``80 x LlamaDecoderLayer``."""

    rows: tuple[GroupRow, ...]  # plan order

    @property
    def count(self) -> int:
        return len(self.rows)

    @property
    def first(self) -> GroupRow:
        return self.rows[0]

    @property
    def label(self) -> str:
        """``80 x LlamaDecoderLayer (model.layers.0 .. model.layers.79)``; one group: its paths."""
        if self.count == 1:
            return self.first.label
        return f"{self.count} x {self.first.class_name} ({path_span([row.paths[0] for row in self.rows])})"


def path_span(paths: list[str]) -> str:
    """``layers.0 .. layers.79`` for numbered paths in a row; else the first two, ``...`` and the last."""
    numbered = [re.fullmatch(r"(.*\.)?(\d+)", path) for path in paths]
    if all(numbered):
        prefixes = {m.group(1) or "" for m in numbered if m}
        numbers = [int(m.group(2)) for m in numbered if m]
        if len(prefixes) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{paths[0]} .. {paths[-1]}"
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, {paths[1]}, ..., {paths[-1]}"


def collapse_rows(rows: list[GroupRow]) -> list[GroupRun]:
    """The rows with identical groups gathered into one run each, at the first one's place (plan order)."""
    runs: list[list[GroupRow]] = []
    for row in rows:
        run = next((run for run in runs if run[0].same_as(row)), None)
        if run is None:
            runs.append([row])
        else:
            run.append(row)
    return [GroupRun(tuple(run)) for run in runs]


@dataclass(frozen=True)
class ParamSize:
    """One parameter left out of sharding (under ``ignore``): every rank holds all of it."""

    name: str
    numel: int
    nbytes: int
    kind: str = ""  # "fp32 trainable", "bf16 frozen"


@dataclass(frozen=True)
class LargeModule:
    """A submodule whose parameters all stay in the root group, with a share of the model's bytes."""

    path: str
    class_name: str
    nbytes: int
    share: float  # of the whole model's parameter bytes
    suggestion: str  # a wrap rule that would make it (or every module of its class) a group


@dataclass(frozen=True)
class Explanation:
    """Everything ``explain`` shows, computed without a process group."""

    replicate: int
    shard: int  # the shard degree: the ranks each parameter is split over
    schedule: ScheduleConfig  # the root's schedule settings, as the config gives them
    rows: list[GroupRow]  # plan order: bottom-up, root last
    ignored: list[ParamSize]
    unmatched: list[Problem]  # rules that match nothing (plan_config's problems)
    refused: list[Problem]  # what cannot be sharded as planned: ties across groups, 0-dim parameters
    large_in_root: list[LargeModule]
    total_numel: int  # every parameter of the model, tied ones once
    total_bytes: int  # the same, as stored
    finetune: Finetune = field(default_factory=Finetune)  # what is trained
    trainable_numel: int = 0  # of total_numel: the parameters with gradients and optimizer state

    @property
    def sharded_bytes(self) -> int:
        """Parameter bytes per rank: every group's padded shards plus the ignored parameters (the S term
        of ``estimate --method analytic`` before CPU offload moves any to the host)."""
        return sum(row.sharded_bytes for row in self.rows) + sum(p.nbytes for p in self.ignored)

    @property
    def storage(self) -> dict[str, int]:
        """``sharded_bytes`` by kind (``NF4 frozen``, ``bf16 frozen``, ``fp32 trainable``, ...)."""
        kinds: Counter[str] = Counter()
        for row in self.rows:
            kinds.update(dict(row.storage))
        for param in self.ignored:
            kinds[param.kind] += param.nbytes
        return dict(kinds)


def param_nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def explain_config(
    model: nn.Module, config: FSDPConfig, world_size: int, finetune: Finetune | None = None
) -> Explanation:
    """Plan ``config`` on ``model`` and count, per group, what each of ``world_size`` ranks holds.
    ``finetune`` lora/qlora: ``model`` is the planned one (``estimate.finetune.plan_model``); qlora's
    adapted base weights are counted at NF4's size."""
    finetune = finetune or Finetune()
    if finetune.adapters and not any(isinstance(m, PlannedLora) for m in model.modules()):
        raise ValueError(
            f"explain_config(finetune={finetune.kind!r}) counts the model the job trains: pass the one "
            "estimate.finetune.plan_model(model, finetune) makes"
        )
    replicate, shard = config.mesh.resolve(world_size)
    plan = plan_config(model, config)
    nf4 = nf4_paths(model) if finetune.kind == "qlora" else set()
    rows = [_group_row(model, group, spec, config, shard, nf4) for group, spec in zip(plan.groups, plan.specs)]
    unique = dict(model.named_parameters())  # tied parameters once
    ignored = {id(p) for p in plan.ignored.values()}
    root_ids = {id(p) for p in plan.params[-1].values()}
    stored = {id(p): _full_nbytes(p, name in nf4) for name, p in unique.items()}
    return Explanation(
        replicate=replicate,
        shard=shard,
        schedule=config.schedule,
        rows=rows,
        ignored=[ParamSize(name, p.numel(), param_nbytes(p), _kind(p, False)) for name, p in plan.ignored.items()],
        unmatched=list(plan.problems),
        refused=list(plan.refused) + mesh_problems(plan, config, shard, replicate),
        large_in_root=_large_in_root(model, root_ids, ignored, stored),
        total_numel=sum(p.numel() for p in unique.values()),
        total_bytes=sum(stored.values()),
        finetune=finetune,
        trainable_numel=sum(p.numel() for p in unique.values() if p.requires_grad),
    )


def _group_row(
    model: nn.Module, group: GroupPlan, spec: GroupSpec, config: FSDPConfig, shard: int, nf4: set[str]
) -> GroupRow:
    """One group's row, from the spec ``fully_shard`` builds for it ([Note: one plan])."""
    storage: Counter[str] = Counter()
    for p in spec.params:
        storage[_kind(p.param, p.fqn in nf4)] += stored_nbytes(p.param, shard, p.dim, p.fqn in nf4)
    overrides = [p.mixed_precision for p in spec.params if p.overridden]
    classes = dict.fromkeys(type(model.get_submodule(path)).__name__ for path in group.paths)
    return GroupRow(
        paths=group.paths,
        rule=rule_label(config, group.rule_index),
        param_names=tuple(p.fqn for p in spec.params),
        numel=sum(p.param.numel() for p in spec.params),
        sharded_bytes=sum(storage.values()),
        unsharded_bytes=sum(_full_nbytes(p.param, p.fqn in nf4) for p in spec.params),
        policy=group.policy,
        shard_dims=tuple(p.dim for p in spec.params),
        precision=tuple(f"{_dtype_name(o.param_dtype)}/{_dtype_name(o.reduce_dtype)}" for o in overrides),
        class_name="+".join(classes),
        shapes=tuple(tuple(p.param.shape) for p in spec.params),
        trainable_numel=sum(p.param.numel() for p in spec.params if p.param.requires_grad),
        storage=tuple(sorted(storage.items())),
    )


def _full_nbytes(param: torch.Tensor, nf4: bool) -> int:
    """The whole parameter's bytes as stored."""
    return nf4_bytes(param.numel()) if nf4 else param_nbytes(param)


def _kind(param: torch.Tensor, nf4: bool) -> str:
    """``fp32 trainable``, ``bf16 frozen``, ``NF4 frozen``."""
    return f"{'NF4' if nf4 else short_dtype_name(param.dtype)} {'trainable' if param.requires_grad else 'frozen'}"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "own" if dtype is None else str(dtype).removeprefix("torch.")


def rule_label(config: FSDPConfig, rule_index: int | None) -> str:
    """``wrap[1]: path=[tok_emb, head] (group)``; ``top-level`` for the root."""
    if rule_index is None:
        return "top-level"
    rule = config.wrap[rule_index]
    keys = [(key, value) for key, value in (("class", rule.match.class_), ("path", rule.match.path)) if value]
    text = " ".join(f"{key}={value if isinstance(value, str) else '[' + ', '.join(value) + ']'}" for key, value in keys)
    return f"wrap[{rule_index}]: {text}" + {True: " (group)", "tied": " (tied modules grouped)"}.get(rule.group, "")


def rule_words(config: FSDPConfig) -> str:
    """The default plan's rules in words: the classes they match, and the modules a path rule gives a group each
    (the estimate's default for a Hugging Face model: its embedding and its head)."""
    paths = [glob for rule in config.wrap if rule.match.class_ is None for glob in as_list(rule.match.path or [])]
    shown = [glob for glob in paths if not glob.startswith("*")]
    words = ", ".join(rule_classes(config)) or "root only"
    return words + (f"; {' and '.join(shown)} a group each" if shown else "")


def rule_classes(config: FSDPConfig) -> list[str]:
    """The class names the config's wrap rules match."""
    names: list[str] = []
    for rule in config.wrap:
        value = rule.match.class_
        names += [value] if isinstance(value, str) else list(value or [])
    return names


def _large_in_root(
    model: nn.Module, root_ids: set[int], ignored: set[int], stored: dict[int, int]
) -> list[LargeModule]:
    """The outermost submodules whose parameters all stay in the root, with >= 10% of the bytes as stored
    (``stored``: per parameter id)."""
    total_bytes = sum(stored.values())
    found = [
        (path, module, nbytes)
        for path, module, nbytes in _root_only_modules(model, root_ids, ignored, stored)
        if total_bytes and nbytes >= LARGE_MODULE_SHARE * total_bytes
    ]
    classes = Counter(type(module).__name__ for _, module, _ in found)
    large = []
    for path, module, nbytes in found:
        name = type(module).__name__
        large.append(LargeModule(path, name, nbytes, nbytes / total_bytes, _suggest_rule(path, module, classes)))
    return large


def _suggest_rule(path: str, module: nn.Module, classes: Counter[str]) -> str:
    """A wrap rule for a large module left in the root: one group per block when it holds repeated blocks
    (its ``_no_split_modules``, or a list of same-class modules with half its parameters or more: the whole
    stack as one group would all-gather at once), else one group of it or of every module of its class."""
    blocks = block_classes(module, min_share=0.5)
    if blocks is not None:
        names = blocks.classes
        return f"- match: {{class: {names[0] if len(names) == 1 else '[' + ', '.join(names) + ']'}}}"
    name = type(module).__name__
    return f"- match: {{class: {name}}}" if classes[name] > 1 else f"- match: {{path: {path}}}"


def _root_only_modules(
    model: nn.Module, root_ids: set[int], ignored: set[int], stored: dict[int, int]
) -> Iterator[tuple[str, nn.Module, int]]:
    """Outermost submodules (not containers without forward) whose parameters all stay in the root."""
    stack = list(reversed(list(model.named_children())))
    seen: set[int] = set()
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        params = [p for p in module.parameters() if id(p) not in ignored]
        containers = (nn.ModuleList, nn.ModuleDict)  # no forward: fully_shard takes their children
        if params and not isinstance(module, containers) and all(id(p) in root_ids for p in params):
            yield path, module, sum(stored[id(p)] for p in params)
            continue
        stack.extend(reversed([(join_path(path, name), child) for name, child in module.named_children()]))
