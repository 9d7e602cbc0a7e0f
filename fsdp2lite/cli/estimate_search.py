"""``fsdp2lite estimate --budget``: the settings that fit, and the fastest of them.

Each setting is estimated with the analytic method (the whole search answers in seconds, a 70B model
included) and timed on the named link and GPU (``estimate.timing``). A setting fits when its *reserved*
device peak (what the caching allocator holds: an OOM comes from that) is within the budget and its
host memory per machine (CPU offload's shards, gradients and optimizer state, times the ranks on one
machine) within ``--host-ram``. The choice is the fitting setting with the most tokens per second; ties
go to the smaller peak.

Without ``--finetune`` the search covers what to train: full, lora and qlora, each with and without
activation checkpointing and offload (none, ``optimizer_only``: ZeRO-Offload, or full) (bf16 compute). With
``--finetune`` given, it covers how to shard that job: mixed precision (full only), reshard after forward,
forward prefetch depth, activation checkpointing and the three offloads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from ..config import FSDPConfig, plan_config
from ..estimate import element_size
from ..estimate.analytic import analytic_estimate, nf4_paths
from ..estimate.common import default_seq
from ..estimate.finetune import Finetune, planned_factory
from ..estimate.timing import Gpu, Link, plan_step_time
from ._args import UsageError
from .explain import human_bytes

OFFLOADS = (False, "optimizer", True)  # none, ZeRO-Offload (optimizer_only: masters and state on the host), full
SEARCH: dict[str, tuple[Any, ...]] = {
    "mixed_precision": ("fp32", "bf16"),
    "reshard_after_forward": (False, True),
    "forward_prefetch_depth": (1, 0),
    "activation_checkpointing": (False, True),
    "offload": OFFLOADS,
}
FINETUNE_SEARCH: dict[str, tuple[Any, ...]] = {
    "finetune": ("full", "lora", "qlora"),
    "activation_checkpointing": (False, True),
    "offload": OFFLOADS,
}
FIXED = {"mixed_precision": "bf16", "reshard_after_forward": True, "forward_prefetch_depth": 1}
SHOWN = ("finetune", *SEARCH)
HEADERS = {"mixed_precision": "precision", "reshard_after_forward": "reshard", "forward_prefetch_depth": "prefetch",
           "activation_checkpointing": "checkpoint", "host/machine": "host/node"}  # fmt: skip


@dataclass
class SearchJob:
    """What every setting of one search shares."""

    factory: Any
    spec: str
    common: dict[str, Any]  # estimate_memory's keyword arguments (analytic is used whatever the method)
    finetune: Finetune  # rank and targets; its kind is searched when ``search_finetune``
    search_finetune: bool
    link: str | Link
    gpu: str | Gpu
    ranks_per_node: int
    host_ram: int


def search_space(base: FSDPConfig, world_size: int, job: SearchJob) -> dict[str, tuple[Any, ...]]:
    """``FINETUNE_SEARCH`` when the fine-tuning kind is searched; else ``SEARCH`` for that kind (bf16
    only for lora/qlora), with ``reshard_after_forward: k`` added for the divisor k of the shard degree
    closest to its square root from below (when there is one between 1 and the degree)."""
    if job.search_finetune:
        return dict(FINETUNE_SEARCH)
    _, shard = base.mesh.resolve(world_size)
    divisors = [k for k in range(2, shard) if shard % k == 0 and k * k <= shard]
    space = {"finetune": (job.finetune.kind,), **SEARCH}
    if job.finetune.adapters:
        space["mixed_precision"] = ("bf16",)
    if divisors:
        space["reshard_after_forward"] = (*SEARCH["reshard_after_forward"], divisors[-1])
    return space


def search_budget(
    job: SearchJob, base: FSDPConfig, budget: int, caches: dict[bool, dict[Any, Any]]
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Every setting of ``search_space`` on top of ``base``, estimated and timed; (the choice, every row).
    ``caches``: per "has adapters", the meta model and its activation traces, shared by the settings."""
    space = search_space(base, job.common["world_size"], job)
    tried = []
    for values in itertools.product(*space.values()):
        settings = {**FIXED, **dict(zip(space, values))}
        if settings["finetune"] == "qlora" and settings["offload"] == "optimizer":
            continue  # NF4 weights gather through hooks, which optimizer_only refuses
        tried.append(evaluate(job, config_for_setting(base, settings), settings, budget, caches))
    fitting = [row for row in tried if row["fits"]]
    choice = min(fitting, key=_order) if fitting else None
    return choice, tried


def evaluate(
    job: SearchJob, config: FSDPConfig, settings: dict[str, Any], budget: int, caches: dict[bool, dict[Any, Any]]
) -> dict[str, Any]:
    """One setting's row: its estimate, timing and whether it fits."""
    finetune = Finetune(settings["finetune"], job.finetune.rank, job.finetune.targets)
    cache = caches.setdefault(finetune.adapters, {})
    factory = planned_factory(job.factory, finetune)
    keys = ("world_size", "rank", "inputs", "batch", "seq", "optimizer", "device")
    try:
        estimate = analytic_estimate(factory, config, *(job.common[k] for k in keys), cache=cache, finetune=finetune)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot estimate {job.spec}: {exc}", prog="fsdp2lite estimate") from None
    model = cache["model"]
    speed = setting_time(model, config, job, finetune)
    host = estimate.host_bytes * job.ranks_per_node
    reserved = estimate.reserved_bytes or estimate.peak_bytes
    return {
        **settings,
        "peak_bytes": estimate.peak_bytes,
        "reserved_bytes": reserved,
        "reserved_expandable_bytes": estimate.reserved_expandable_bytes or reserved,
        "host_bytes": estimate.host_bytes,
        "host_bytes_per_machine": host,
        "comm_bytes": communication_bytes(model, config, job.common["world_size"]),
        "step_s": speed.step_s,
        "tokens_per_s": speed.tokens_per_s,
        "fits": reserved <= budget and host <= job.host_ram,
    }


def setting_time(model: Any, config: FSDPConfig, job: SearchJob, finetune: Finetune) -> Any:
    """The step time of ``model`` (built for ``finetune``) under ``config`` on the job's link and GPU."""
    world = job.common["world_size"]
    _, shard = config.mesh.resolve(world)
    plan = plan_config(model, config)
    seq = default_seq(model, job.common["seq"])
    return plan_step_time(
        model, plan, shard=shard, world_size=world, tokens_per_gpu=job.common["batch"] * seq, seq=seq,
        link=job.link, gpu=job.gpu, finetune=finetune.kind,  # type: ignore[arg-type]
        nf4=nf4_paths(model) if finetune.kind == "qlora" else (),
    )  # fmt: skip


def config_for_setting(base: FSDPConfig, settings: dict[str, Any]) -> FSDPConfig:
    data = base.model_dump(mode="json", by_alias=True)
    data["mixed_precision"] = (
        {"param_dtype": "bf16", "reduce_dtype": "fp32"}
        if settings["mixed_precision"] == "bf16"
        else {"param_dtype": None, "reduce_dtype": None}
    )
    for rule in data["wrap"]:
        rule.pop("mixed_precision", None)
        rule.pop("reshard_after_forward", None)
        rule.pop("offload", None)
        rule["activation_checkpointing"] = settings["activation_checkpointing"]
    kind = settings["offload"]
    data["offload"] = {"device": "cpu" if kind else "none", "pin_memory": True, "optimizer_only": kind == "optimizer"}
    data["reshard_after_forward"] = settings["reshard_after_forward"]
    data["schedule"]["forward_prefetch_depth"] = settings["forward_prefetch_depth"]
    return FSDPConfig.model_validate(data)


def communication_bytes(model: Any, config: FSDPConfig, world_size: int) -> int:
    """Bytes one rank sends per step in its collectives (a ring sends (n - 1) / n of the buffer of an
    n-rank all-gather or reduce-scatter): each group all-gathered over the shard group in forward,
    again in backward when resharded after forward (over k ranks for ``reshard_after_forward: k``;
    never the root's, which keeps its parameters by default), and reduce-scattered once. HSDP's
    replica all-reduce is the same in every setting searched and left out. A ``communication`` policy sends
    1-byte codes and a 4-byte scale per block instead (an all-to-all reduce-scatter sends what a ring
    reduce-scatter does: (n - 1) / n of the buffer)."""
    plan = plan_config(model, config)
    _, shard = config.mesh.resolve(world_size)
    total = 0.0
    for group, params in zip(plan.groups, plan.params):
        policy = group.policy
        param_dtype = policy.mixed_precision.param_dtype
        reduce_dtype = policy.mixed_precision.reduce_dtype or param_dtype
        numel = sum(p.numel() for p in params.values())
        trained = sum(p.numel() for p in params.values() if p.requires_grad)
        gather = numel * (element_size(param_dtype) if param_dtype is not None else 4)
        reduce = trained * (element_size(reduce_dtype) if reduce_dtype is not None else 4)
        comm = policy.communication  # CommPolicy: int8/fp8 codes plus one fp32 scale per block
        if comm.all_gather is not None:
            gather = numel * (1 + 4 / comm.block_size)
        if comm.reduce_scatter == "int8":
            reduce = trained * (1 + 4 / comm.block_size)
        ring = (shard - 1) / shard
        value = policy.reshard_after_forward
        if value == "auto":
            value = group.rule_index is not None and not policy.sharding.resident  # root and ZeRO-1/2 keep them
        backward_ranks = shard if value is True else (value if isinstance(value, int) and value > 1 else 1)
        total += gather * ring + gather * (backward_ranks - 1) / backward_ranks + reduce * ring
    return int(total)


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    """Fastest first (to 0.1%: the model is not finer); among equals, the least offload (none, then
    optimizer_only, then full: host copies each step, host memory), then the smaller reserved peak."""
    return (-round(row["tokens_per_s"], -max(0, len(str(int(row["tokens_per_s"]))) - 3)),
            OFFLOADS.index(row["offload"]), row["reserved_bytes"])  # fmt: skip


def nearest_rows(tried: list[dict[str, Any]], choice: dict[str, Any] | None, few: int = 5) -> list[dict[str, Any]]:
    """The chosen setting and its nearest alternatives: the next fastest fitting ones, and the fastest
    that do not fit (what a bigger budget would buy). Without a choice, the smallest reserved peaks
    (how far off the budget is)."""
    ordered = sorted(tried, key=_order)
    if choice is None:
        return sorted(tried, key=lambda row: row["reserved_bytes"])[:few]
    fitting = [row for row in ordered if row["fits"] and row is not choice][: few - 3]
    faster = [row for row in ordered if not row["fits"] and row["tokens_per_s"] > choice["tokens_per_s"]][:2]
    return sorted([choice, *fitting, *faster], key=_order)


def search_table(budget: int, tried: list[dict[str, Any]], choice: dict[str, Any] | None, show_all: bool) -> Table:
    rows = sorted(tried, key=_order) if show_all else nearest_rows(tried, choice)
    nearest = f"the choice and its nearest alternatives ({len(tried)} tried; --all)"
    shown = "every setting tried" if show_all else nearest
    table = Table(title=f"settings for a budget of {human_bytes(budget)}: {shown}")
    varied = [key for key in SHOWN if len({str(row[key]) for row in tried}) > 1] or ["finetune"]
    values = (*varied, "allocated", "reserved", "host/machine", "tokens/s", "fits")
    for column in values:
        header = HEADERS.get(column, column)
        table.add_column(header, justify="left" if column in SHOWN or column == "fits" else "right")
    for row in rows:
        chosen = row is choice
        host = row["host_bytes_per_machine"]
        table.add_row(
            *(str(row[key]).lower() for key in varied),
            human_bytes(row["peak_bytes"]),
            human_bytes(row["reserved_bytes"]),
            human_bytes(host) if host else "-",
            f"{row['tokens_per_s']:,.0f}",
            ("chosen" if chosen else "yes") if row["fits"] else "no",
            style="bold green" if chosen else ("" if row["fits"] else "dim"),
        )
    table.caption = "fits: reserved within the budget and host/machine (CPU offload) within --host-ram"
    return table


def write_config(path: str, base: FSDPConfig, choice: dict[str, Any]) -> None:
    """The chosen setting as a policy file (read back to check it)."""
    config = config_for_setting(base, choice)
    text = (
        f"# written by fsdp2lite estimate: {choice['finetune']}, {choice['reserved_bytes']:,} bytes reserved at the "
        f"peak, about {choice['tokens_per_s']:,.0f} tokens/s\n" + config.to_yaml()
    )
    Path(path).write_text(text)
    FSDPConfig.from_yaml(path)


def train_command(path: str, choice: dict[str, Any], job: SearchJob, model_spec: str) -> str:
    """The ``examples/train.py`` command line that runs the chosen setting."""
    world = job.common["world_size"]
    nodes = -(-world // job.ranks_per_node)
    launch = f"torchrun --standalone --nproc-per-node {world}"
    if nodes > 1:
        launch = (
            f"torchrun --nnodes {nodes} --nproc-per-node {job.ranks_per_node} --rdzv-backend c10d "
            "--rdzv-endpoint HOST:29500"
        )
    source = f"--weights {model_spec}" if Path(model_spec).is_dir() else f"--weights PATH/TO/{model_spec}"
    parts = [launch, "examples/train.py", f"--config {path}", source]
    parts.append(f"--finetune {choice['finetune']}")
    if choice["finetune"] != "full":
        parts.append(f"--lora-rank {job.finetune.rank} --lora-targets {','.join(job.finetune.targets)}")
    checkpointing = choice["activation_checkpointing"]
    parts.append("--activation-checkpointing" if checkpointing else "--no-activation-checkpointing")
    seq = job.common["seq"]  # run() resolved a token model's default
    parts.append(f"--batch {job.common['batch']}" + (f" --seq {seq}" if seq else ""))
    return " ".join(parts)
