"""``explain``'s output: the tree of groups (identical groups once, with a count, unless ``--all``), their
policies with the YAML key names, the warnings, the summary and, for a training job, the peak ``estimate``
gives it. Lines are kept short enough to read at 80 columns; rich wraps the rest at word boundaries."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from .._runtime.root import ScheduleDefaults, schedule_defaults
from .._units import human_bytes
from ..config import FSDPConfig, ScheduleConfig
from ..estimate import MemoryEstimate
from .explain_plan import Explanation, GroupRow, GroupRun, LargeModule, collapse_rows
from .offload_text import optimizer_placement
from .validate import problems_table


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
    flags = _flag_texts(row)
    if flags:
        lines.append(" · ".join(flags))
    return lines


def _flag_texts(row: GroupRow) -> list[str]:
    """The group's non-default flags, its parameters' other shard dims and precision overrides."""
    policy = row.policy
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
    return flags


def size_lines(run: GroupRun) -> list[str]:
    """A group's parameters and bytes (a run's: each group's, then all of them): per rank sharded, whole
    unsharded, and per rank by kind (``NF4 frozen``, ``fp32 trainable``) when not all are trained alike."""
    row, count = run.first, run.count
    each = "each: " if count > 1 else ""
    tensors = len(row.param_names)
    trained = "" if row.trainable_numel == row.numel else f" ({row.trainable_numel:,} trainable)"
    trained = " (frozen)" if row.numel and not row.trainable_numel else trained
    lines = [
        f"{each}{row.numel:,} params{trained}, {tensors} tensor{'' if tensors == 1 else 's'}",
        f"{each}sharded [green]{human_bytes(row.sharded_bytes)}[/green]/rank · "
        f"unsharded {human_bytes(row.unsharded_bytes)}",
    ]
    if len(row.storage) > 1 or any(kind.endswith("frozen") for kind, _ in row.storage):
        lines.append("= " + storage_text(dict(row.storage)))
    if count > 1:
        lines.append(
            f"all {count}: sharded [green]{human_bytes(count * row.sharded_bytes)}[/green]/rank · "
            f"unsharded {human_bytes(count * row.unsharded_bytes)}"
        )
    return lines


def storage_text(storage: dict[str, int]) -> str:
    """``NF4 frozen 8.2 GiB + bf16 frozen 1,002.6 MiB + fp32 trainable 197.5 MiB``, largest first."""
    return " + ".join(f"{kind} {human_bytes(n)}" for kind, n in sorted(storage.items(), key=lambda kv: -kv[1]))


def explanation_tree(title: str, explanation: Explanation, show_all: bool = False) -> Tree:
    """One node per group in plan order (identical groups as one node with a count unless ``show_all``),
    then the ignored parameters."""
    tree = Tree(Text(title, style="bold"))
    runs = [GroupRun((row,)) for row in explanation.rows] if show_all else collapse_rows(explanation.rows)
    for run in runs:
        node = tree.add(Text.assemble((run.label, "bold cyan"), "  ", (run.first.rule, "magenta")))
        for line in size_lines(run):
            node.add(line)
        for line in policy_lines(run.first):
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


def summary_lines(explanation: Explanation) -> list[str]:
    """The model's parameters and groups; the bytes per rank and unsharded; by kind for a fine-tuning job."""
    e = explanation
    trained = f" ({e.trainable_numel:,} trainable)" if e.trainable_numel != e.total_numel else ""
    lines = [
        f"summary: {e.total_numel:,} params{trained} in {len(e.rows)} group{'' if len(e.rows) == 1 else 's'}",
        f"  per rank {human_bytes(e.sharded_bytes)} sharded vs {human_bytes(e.total_bytes)} unsharded "
        f"(shard degree {e.shard}, replicate {e.replicate})",
    ]
    if len(e.storage) > 1 or any(kind.endswith("frozen") for kind in e.storage):
        lines.append("  = " + storage_text(e.storage))
    return lines


def peak_lines(estimate: MemoryEstimate | None, step: str) -> list[str]:
    """The peak ``fsdp2lite estimate --method analytic`` gives the same job (``step``: its batch, sequence,
    optimizer and target), or how to get it."""
    if estimate is None:
        return ["[dim]peak: not counted (--finetune full|lora|qlora: as fsdp2lite estimate counts it)[/dim]"]
    reserved = f", about {human_bytes(estimate.reserved_bytes)} reserved" if estimate.reserved_bytes else ""
    host = f"; {human_bytes(estimate.host_bytes)} on the host" if estimate.host_bytes else ""
    parts = {"params": "parameters", "optimizer": "optimizer state", "activations": "activations"}
    return [
        f"peak: {human_bytes(estimate.peak_bytes)} allocated per rank in {estimate.phase}{reserved}{host}",
        f"  as fsdp2lite estimate --method analytic counts it: {step}",
        "  " + ", ".join(f"{word} {human_bytes(estimate.breakdown.get(key, 0))}" for key, word in parts.items()),
    ]


def show_explanation(
    console: Console,
    title: str,
    explanation: Explanation,
    peak: tuple[MemoryEstimate | None, str] = (None, ""),
    show_all: bool = False,
) -> None:
    """The tree, the schedule, the problems and warnings, the summary, then the peak (``peak``: the
    estimate and its step's words, or None)."""
    console.print(explanation_tree(title, explanation, show_all))
    console.print(Text(schedule_line(explanation.schedule), style="dim"))
    if explanation.unmatched:
        console.print(problems_table("error: rules that match nothing", explanation.unmatched))
    if explanation.refused:
        console.print(problems_table("error: what apply_config would refuse", explanation.refused))
    if explanation.large_in_root:
        console.print(large_modules_table(explanation.large_in_root))
    for line in [*summary_lines(explanation), *peak_lines(*peak)]:
        console.print(line)


def placement_text(placement: Any, config: FSDPConfig) -> str:
    """What an ``offload.budget`` resolved to, in one line (explain and estimate print it)."""
    kind = "optimizer_only" if config.offload.optimizer_only else "full"
    if config.offload.optimizer == "nvme":
        kind += f", optimizer state on NVMe at {config.offload.nvme_path}"
    return (
        f"{len(placement.offloaded)} of {placement.candidates} groups offloaded ({kind}, largest first): "
        f"{', '.join(placement.offloaded) or 'none'}; analytic peak {human_bytes(placement.estimate.peak_bytes)}"
    )
