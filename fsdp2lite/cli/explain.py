"""``fsdp2lite explain``: what a config would do to a model, before any process is started.

    fsdp2lite explain configs/bf16.yaml --model fsdp2lite.models:gpt_small --world-size 8

The model comes from a factory (``pkg.module:callable``, called with no arguments) built under
``torch.device("meta")``: no parameter memory is allocated, however large the model. ``plan_config``
matches the rules (no process group is needed), and the output is a tree with one node per planned
group, in the order ``apply_config`` shards them (bottom-up, the root last): its module paths, the rule
that matched, its parameter count, the bytes each rank holds sharded and the unsharded bytes, and its
effective policies. Then the warnings: rules that match nothing (exit 1), parameters tied across
groups or 0-dim (they cannot be sharded as planned, exit 1), and large modules left in the root group.

Which group owns a parameter follows ``fully_shard``: a group owns the parameters of its modules that
no group sharded before it owns (groups are sharded in plan order), minus the ignored ones; tied
parameters are counted once. A rank's bytes for one parameter are its padded shard:
``ceil(size(d) / shard) * (numel / size(d)) * element_size`` for its shard dim d (0 unless ``shard_placement``
says otherwise), with ``shard`` the mesh's shard degree.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from .._plan import GroupSpec
from .._runtime.root import ScheduleDefaults, schedule_defaults
from .._units import human_bytes
from ..config import (
    ConfigError,
    FSDPConfig,
    GroupPlan,
    GroupPolicy,
    Problem,
    ScheduleConfig,
    join_path,
    mesh_problems,
    plan_config,
)
from ..estimate import default_config, sharded_nbytes
from ..migrate.blocks import block_classes
from ._args import UsageError, positive_int
from ._hf_models import FORMS, hf_factory, is_hf_spec
from .offload_text import optimizer_placement
from .validate import problems_table

DESCRIPTION = (
    "Show how a config would shard a model, without starting any process: one node per group (modules, "
    "matching rule, parameters, bytes per rank sharded vs unsharded, policies), then the warnings. The model "
    "is built on the meta device, so no memory is used."
)
LARGE_MODULE_SHARE = 0.10  # a module left in the root group with this share of the model's bytes is flagged
_PROG = "fsdp2lite explain"


# ---- the numbers, as data -----------------------------------------------------------------------
@dataclass(frozen=True)
class GroupRow:
    """One planned group: what its ``fully_shard`` call would own and what each rank would hold."""

    paths: tuple[str, ...]  # module paths; "" is the root
    rule: str  # the rule that matched: "wrap[0]: class=Block", or "top-level" for the root
    param_names: tuple[str, ...]  # the parameters it owns, tied ones once
    numel: int  # parameter elements
    sharded_bytes: int  # per rank: the padded local shards
    unsharded_bytes: int  # the full parameters
    policy: GroupPolicy
    shard_dims: tuple[int, ...] = ()  # per parameter in param_names: the dim it is sharded on
    precision: tuple[str, ...] = ()  # per overridden parameter: "param_dtype/reduce_dtype" (precision_overrides)

    @property
    def is_root(self) -> bool:
        return self.paths == ("",)

    @property
    def label(self) -> str:
        return " + ".join(path or "<root>" for path in self.paths)


@dataclass(frozen=True)
class ParamSize:
    """One parameter left out of sharding (under ``ignore``): every rank holds all of it."""

    name: str
    numel: int
    nbytes: int


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
    total_bytes: int

    @property
    def sharded_bytes(self) -> int:
        """Parameter bytes per rank: every group's padded shards plus the ignored parameters."""
        return sum(row.sharded_bytes for row in self.rows) + sum(p.nbytes for p in self.ignored)


def param_nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def explain_config(model: nn.Module, config: FSDPConfig, world_size: int) -> Explanation:
    """Plan ``config`` on ``model`` and count, per group, what each of ``world_size`` ranks holds."""
    replicate, shard = config.mesh.resolve(world_size)
    plan = plan_config(model, config)
    ignored = {id(p) for p in plan.ignored.values()}
    owned = plan.params
    rows = [_group_row(group, spec, config, shard) for group, spec in zip(plan.groups, plan.specs)]
    unique = dict(model.named_parameters())  # tied parameters once
    total_bytes = sum(param_nbytes(p) for p in unique.values())
    root_ids = {id(p) for p in owned[-1].values()}
    return Explanation(
        replicate=replicate,
        shard=shard,
        schedule=config.schedule,
        rows=rows,
        ignored=[ParamSize(name, p.numel(), param_nbytes(p)) for name, p in plan.ignored.items()],
        unmatched=list(plan.problems),
        refused=list(plan.refused) + mesh_problems(plan, config, shard, replicate),
        large_in_root=_large_in_root(model, root_ids, ignored, total_bytes),
        total_numel=sum(p.numel() for p in unique.values()),
        total_bytes=total_bytes,
    )


def _group_row(group: GroupPlan, spec: GroupSpec, config: FSDPConfig, shard: int) -> GroupRow:
    """One group's row, from the spec ``fully_shard`` builds for it ([Note: one plan])."""
    params = {p.fqn: p.param for p in spec.params}
    shard_dims = tuple(p.dim for p in spec.params)
    overrides = [p.mixed_precision for p in spec.params if p.overridden]
    return GroupRow(
        paths=group.paths,
        rule=rule_label(config, group.rule_index),
        param_names=tuple(params),
        numel=sum(p.numel() for p in params.values()),
        sharded_bytes=sum(sharded_nbytes(p, shard, d) for p, d in zip(params.values(), shard_dims)),
        unsharded_bytes=sum(param_nbytes(p) for p in params.values()),
        policy=group.policy,
        shard_dims=shard_dims,
        precision=tuple(f"{_dtype_name(o.param_dtype)}/{_dtype_name(o.reduce_dtype)}" for o in overrides),
    )


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "own" if dtype is None else str(dtype).removeprefix("torch.")


def rule_label(config: FSDPConfig, rule_index: int | None) -> str:
    """``wrap[1]: path=[tok_emb, head] (group)``; ``top-level`` for the root."""
    if rule_index is None:
        return "top-level"
    rule = config.wrap[rule_index]
    keys = [(key, value) for key, value in (("class", rule.match.class_), ("path", rule.match.path)) if value]
    text = " ".join(f"{key}={value if isinstance(value, str) else '[' + ', '.join(value) + ']'}" for key, value in keys)
    return f"wrap[{rule_index}]: {text}" + (" (group)" if rule.group else "")


def _large_in_root(model: nn.Module, root_ids: set[int], ignored: set[int], total_bytes: int) -> list[LargeModule]:
    """The outermost submodules whose parameters all stay in the root, with >= 10% of the bytes."""
    found = [
        (path, module, nbytes)
        for path, module, nbytes in _root_only_modules(model, root_ids, ignored)
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


def _root_only_modules(model: nn.Module, root_ids: set[int], ignored: set[int]) -> Iterator[tuple[str, nn.Module, int]]:
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
            yield path, module, sum(param_nbytes(p) for p in params)
            continue
        stack.extend(reversed([(join_path(path, name), child) for name, child in module.named_children()]))


# ---- the model: a factory built on the meta device ----------------------------------------------
def _rule_classes(config: FSDPConfig) -> list[str]:
    names: list[str] = []
    for rule in config.wrap:
        value = rule.match.class_
        names += [value] if isinstance(value, str) else list(value or [])
    return names


def load_factory(spec: str, prog: str = _PROG) -> Callable[[], Any]:
    """The callable named by ``pkg.module:factory`` (the attribute may be dotted), or a Hugging Face
    model's builder (a directory, config.json, ``hf:ID`` or a preset: ``_hf_models``); ``UsageError`` if
    neither."""
    if is_hf_spec(spec):
        return hf_factory(spec, prog)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"argument --model: expected {FORMS}; got {spec!r}", prog)
    if os.getcwd() not in sys.path:  # like `python -m`: modules next to the user's working directory import
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own code failing: one line either way
        raise UsageError(
            f"argument --model: cannot import {module_name!r} from {spec!r}: {_one_line(exc)}", _PROG
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"argument --model: {module_name!r} has no attribute {attr!r} (from {spec!r})", _PROG)
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(
            f"argument --model: {spec!r} is not callable (type {type(target).__name__}); "
            "expected a function returning an nn.Module",
            _PROG,
        )
    return target


def build_on_meta(factory: Callable[[], Any], spec: str) -> nn.Module:
    """Call the factory under ``torch.device("meta")``: parameters get shapes and dtypes, no storage."""
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:
        raise UsageError(f"argument --model: {spec}() raised {_one_line(exc)}", _PROG) from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"argument --model: {spec}() returned a {type(model).__name__}, not an nn.Module", _PROG)
    return model


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


# ---- output -------------------------------------------------------------------------------------
def policy_lines(row: GroupRow) -> list[str]:
    """The group's effective policies, with the YAML key names: reshard and offload, then dtypes."""
    policy = row.policy
    reshard = policy.reshard_after_forward
    if reshard == "auto":
        reshard_text = f"{'false' if row.is_root else 'true'} (auto)"
    else:
        reshard_text = str(reshard).lower()
    offload: str = policy.offload.device
    if offload == "cpu" and policy.offload.optimizer_only:
        offload += " (optimizer_only: shards stay, masters and optimizer state on the host)"
    if offload.startswith("cpu") and policy.offload.pin_memory:
        offload += " (pin_memory)"
    dtypes = policy.mixed_precision.model_dump(mode="json")  # dtypes by their short names
    mixed = " ".join(f"{key}={dtypes[key] or 'null'}" for key in ("param_dtype", "reduce_dtype", "output_dtype"))
    if not policy.mixed_precision.cast_forward_inputs:
        mixed += " cast_forward_inputs=false"
    lines = [f"reshard_after_forward={reshard_text} · offload={offload}", f"mixed_precision: {mixed}"]

    placement = optimizer_placement(policy)
    if placement is not None:
        lines.insert(1, placement)
    if policy.sharding.resident:
        lines.append("sharding: shard=optimizer (ZeRO-1/2: parameters resident, gathered once after each step)")
    if policy.sharding.replica_sharded:
        lines.append(
            "sharding: replicate=optimizer (HFSDP: masters and optimizer state split across the replicas, "
            "gathered across them once after each step)"
        )
    comm = policy.communication
    if comm.active:
        parts = [f"all_gather={comm.all_gather}"] if comm.all_gather else []
        parts += [f"reduce_scatter={comm.reduce_scatter}"] if comm.reduce_scatter else []
        lines.append(f"communication: {' '.join(parts)} block_size={comm.block_size}")
    flags = [
        text
        for text, on in (
            ("reduce_scatter_unused_params=true", policy.reduce_scatter_unused_params),
            ("unshard_in_backward=false", not policy.unshard_in_backward),
            ("activation_checkpointing=true", policy.activation_checkpointing),
        )
        if on
    ]
    other = Counter(d for d in row.shard_dims if d)
    if other:
        flags.append("shard_placement: " + ", ".join(f"Shard({d}) x{n}" for d, n in sorted(other.items())))
    for text, count in sorted(Counter(row.precision).items()):  # [Note: per-parameter mixed precision]
        flags.append(f"precision_overrides: {text} x{count}")
    if flags:
        lines.append(" · ".join(flags))
    return lines


def explanation_tree(title: str, explanation: Explanation) -> Tree:
    """One node per group in plan order, then the ignored parameters."""
    tree = Tree(Text(title, style="bold"))
    for row in explanation.rows:
        node = tree.add(Text.assemble((row.label, "bold cyan"), "  ", (row.rule, "magenta")))
        tensors = len(row.param_names)
        node.add(
            f"{row.numel:,} params, {tensors} tensor{'' if tensors == 1 else 's'} · "
            f"sharded [green]{human_bytes(row.sharded_bytes)}[/green]/rank · "
            f"unsharded {human_bytes(row.unsharded_bytes)}"
        )
        for line in policy_lines(row):
            node.add(Text(line, style="dim"))
    if explanation.ignored:
        node = tree.add(Text("ignored (unsharded on every rank)", style="bold yellow"))
        for param in explanation.ignored:
            node.add(Text(f"{param.name}: {param.numel:,} params, {human_bytes(param.nbytes)}"))
    return tree


def large_modules_table(large: list[LargeModule]) -> Table:
    table = Table(title="warning: large modules left in the root group", title_style="bold yellow")
    table.add_column("module", style="cyan")
    table.add_column("class")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("suggested wrap rule", style="green")
    for module in large:
        table.add_row(
            escape(module.path),
            module.class_name,
            human_bytes(module.nbytes),
            f"{module.share:.0%}",
            escape(module.suggestion),
        )
    return table


def schedule_line(schedule: ScheduleConfig) -> str:
    """``schedule (root): forward_prefetch_depth=auto (CPU 1, CUDA 0) · ...``, YAML spelling; what auto
    means comes from the runtime's own defaults."""
    cpu, cuda = schedule_defaults(on_cuda=False), schedule_defaults(on_cuda=True)
    parts = []
    for key in ScheduleDefaults._fields:
        value = getattr(schedule, key)
        if value == "auto":
            parts.append(f"{key}=auto (CPU {_yaml(getattr(cpu, key))}, CUDA {_yaml(getattr(cuda, key))})")
        else:
            parts.append(f"{key}={_yaml(value)}")
    return "schedule (root): " + " · ".join(parts)


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def summary_line(explanation: Explanation) -> str:
    e = explanation
    return (
        f"summary: {e.total_numel:,} params in {len(e.rows)} group{'' if len(e.rows) == 1 else 's'}; per rank "
        f"{human_bytes(e.sharded_bytes)} sharded vs {human_bytes(e.total_bytes)} unsharded "
        f"(shard degree {e.shard}, replicate {e.replicate})"
    )


def show_explanation(console: Console, title: str, explanation: Explanation) -> None:
    console.print(explanation_tree(title, explanation))
    console.print(Text(schedule_line(explanation.schedule), style="dim"), soft_wrap=True)
    if explanation.unmatched:
        console.print(problems_table("error: rules that match nothing", explanation.unmatched))
    if explanation.refused:
        console.print(problems_table("error: what apply_config would refuse", explanation.refused))
    if explanation.large_in_root:
        console.print(large_modules_table(explanation.large_in_root))
    console.print(summary_line(explanation), soft_wrap=True)


# ---- the subcommand -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs="?",
        help="YAML policy file (default: a Hugging Face model's _no_split_modules, else one group per repeated block)",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="pkg.module:factory (e.g. fsdp2lite.models:gpt_small), a Hugging Face model directory or config.json, "
        "hf:ORG/NAME (local cache only) or a preset (llama-3-70b, ...); built on the meta device",
    )
    parser.add_argument(
        "--world-size", type=positive_int, default=8, help="ranks the model would be sharded over (default 8)"
    )


def run(args: argparse.Namespace) -> int:
    """0 when the plan is clean; 1 for an invalid config, a rule matching nothing or a refused parameter."""
    factory = load_factory(args.model)
    console = Console()
    model = build_on_meta(factory, args.model)
    try:
        config = FSDPConfig.from_yaml(args.config) if args.config else default_config(model)
    except ConfigError as exc:
        console.print(problems_table(args.config, exc.problems))
        return 1
    try:
        config.mesh.resolve(args.world_size)
    except ValueError as exc:
        raise UsageError(f"argument --world-size: {exc}", _PROG) from None
    if config.offload.budget is not None:
        config = _resolved_budget(console, factory, config, args.world_size)
    explanation = explain_config(model, config, args.world_size)
    source = args.config or "the default plan (" + (", ".join(_rule_classes(config)) or "root only") + ")"
    title = f"{type(model).__name__} ({args.model}) under {source}, world size {args.world_size}"
    show_explanation(console, title, explanation)
    return 1 if explanation.unmatched or explanation.refused else 0


def _resolved_budget(console: Console, factory: Any, config: FSDPConfig, world_size: int) -> FSDPConfig:
    """``offload.budget`` resolved at batch 1 and the model's default sequence ([Note: offload budget]);
    ``fsdp2lite estimate --config`` resolves it at the batch and sequence given."""
    from ..estimate.offload_budget import resolve_offload_budget

    try:
        placement = resolve_offload_budget(factory, config, world_size)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot resolve offload.budget: {exc}", _PROG) from None
    console.print(
        f"offload budget {human_bytes(placement.budget)} at batch 1 (fsdp2lite estimate --config takes yours): "
        + placement_text(placement, config)
        + ("" if placement.fits else " [red](over the budget even with every group offloaded)[/red]"),
        soft_wrap=True,
    )
    return placement.config


def placement_text(placement: Any, config: FSDPConfig) -> str:
    """What an ``offload.budget`` resolved to, in one line (explain and estimate print it)."""
    kind = "optimizer_only" if config.offload.optimizer_only else "full"
    if config.offload.optimizer == "nvme":
        kind += f", optimizer state on NVMe at {config.offload.nvme_path}"
    return (
        f"{len(placement.offloaded)} of {placement.candidates} groups offloaded ({kind}, largest first): "
        f"{', '.join(placement.offloaded) or 'none'}; analytic peak {human_bytes(placement.estimate.peak_bytes)}"
    )
