"""``fsdp2lite estimate``: will it fit, and with what settings, before a job is launched.

    fsdp2lite estimate --model fsdp2lite.models:gpt_small --world-size 64 --batch 4 --seq 256
    fsdp2lite estimate --model pkg.mod:build --inputs pkg.mod:example --world-size 8 --method analytic
    fsdp2lite estimate --model ... --world-size 8 --budget 80GiB --write-config fits.yaml

One rank's peak of a steady-state training step and its composition (``fsdp2lite.estimate_memory``);
with ``--budget``, the settings that change memory are searched (mixed precision, reshard after
forward, forward prefetch depth, activation checkpointing of the groups, CPU offload) and the one
with the least communication whose peak fits is reported and, with ``--write-config``, written as a
YAML policy file. ``--json`` prints one JSON object last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..config import ConfigError, FSDPConfig, plan_config
from ..estimate import (
    BREAKDOWN_KEYS,
    DEVICES,
    METHODS,
    OPTIMIZERS,
    MemoryEstimate,
    default_config,
    element_size,
    estimate_memory,
)
from ..estimate.analytic import analytic_estimate
from ._args import UsageError, non_negative_int, positive_int
from .explain import build_on_meta, human_bytes, load_factory
from .validate import problems_table

DESCRIPTION = (
    "Estimate one rank's peak memory for a training step (forward, loss, backward, optimizer) at any world "
    "size, before launching: simulated with the real runtime on fake tensors, or a closed form. With "
    "--budget, find the settings with the least communication that fit."
)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``1.5 TB``, ``123456`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 80GiB, 512MiB or 2e9 bytes, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="pkg.module:factory, a Hugging Face model directory or config.json, hf:ORG/NAME (local cache), or a "
        "preset (llama-3.2-1b, llama-3-8b, llama-3-70b)",
    )
    parser.add_argument(
        "--config", metavar="CONFIG.yaml", help="the policy file (default: one group per repeated block)"
    )
    parser.add_argument("--world-size", type=positive_int, required=True, help="ranks of the job")
    parser.add_argument("--rank", type=non_negative_int, default=0, help="the rank to estimate (uneven shards differ)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per rank (token models)")
    parser.add_argument(
        "--seq", type=positive_int, default=None, help="tokens per sequence (default: the model's seq_len)"
    )
    parser.add_argument(
        "--inputs", metavar="MODULE:FN", help="a function returning one rank's example inputs (other models)"
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--method", choices=METHODS, default="simulate")
    parser.add_argument("--device", choices=DEVICES, default="cuda", help="the target: NCCL on CUDA, or gloo on CPU")
    parser.add_argument("--budget", type=parse_bytes, metavar="SIZE", help="search settings that fit, e.g. 80GiB")
    parser.add_argument("--write-config", metavar="OUT.yaml", help="with --budget: write the chosen settings")
    parser.add_argument("--all", action="store_true", help="with --budget: every setting tried, not the nearest few")
    parser.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        help="ranks sharing one machine's host memory (CPU offload per machine; default min(world size, 8))",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")


def run(args: argparse.Namespace) -> int:
    if args.write_config and args.budget is None:
        raise UsageError(
            "--write-config needs --budget (it writes the settings the search chose)", prog="fsdp2lite estimate"
        )
    if args.rank >= args.world_size:
        raise UsageError(
            f"argument --rank: must be < --world-size ({args.world_size}), got {args.rank}", prog="fsdp2lite estimate"
        )
    console = Console()
    factory = load_factory(args.model, prog="fsdp2lite estimate")
    model = build_on_meta(factory, args.model)  # a clear error now for a factory that does not build a module
    cache: dict[Any, Any] = {"model": model}  # analytic: one meta model and one trace per setting, for every estimate
    inputs = load_factory(args.inputs) if args.inputs else None
    loaded, config = _load_config(args, console)
    if not loaded:
        return 1
    common = {
        "world_size": args.world_size,
        "rank": args.rank,
        "inputs": inputs,
        "batch": args.batch,
        "seq": args.seq,
        "optimizer": args.optimizer,
        "method": args.method,
        "device": args.device,
    }
    estimate = _estimate(factory, config, common, args.model, cache)
    console.print(estimate_table(f"{args.model}, world size {args.world_size}, rank {args.rank}", estimate))
    record: dict[str, Any] = estimate.to_json()
    sent = communication_bytes(model, config or default_config(model), args.world_size)
    record["sent_per_step_bytes"] = sent  # the config's collectives, its communication policy included
    console.print(f"sent per rank per step: {human_bytes(sent)} (ring collectives; the config's communication policy)")
    code = 0
    if args.budget is not None:
        base = config or default_config(model)
        choice, tried = search_budget(factory, base, common, args.budget, args.model, cache)
        per_node = args.ranks_per_node or min(args.world_size, 8)
        console.print(search_table(args.budget, tried, choice, per_node, show_all=args.all))
        record["budget"] = {"bytes": args.budget, "fits": choice is not None, "tried": tried}
        if choice is None:
            console.print(f"[red]nothing tried fits {human_bytes(args.budget)}[/red]")
            code = 1
        else:
            record["budget"]["choice"] = choice
            if args.write_config:
                _write_config(args.write_config, base, choice)
                console.print(f"wrote {args.write_config} (fsdp2lite validate accepts it; apply_config applies it)")
    if args.json:
        print(json.dumps(record))
    return code


def _load_config(args: argparse.Namespace, console: Console) -> tuple[bool, FSDPConfig | None]:
    """(loaded, config); no --config: (True, None), the default plan."""
    if not args.config:
        return True, None
    try:
        return True, FSDPConfig.from_yaml(args.config)
    except ConfigError as exc:
        console.print(problems_table(f"{args.config}: invalid config", exc.problems))
        return False, None


def _estimate(
    factory: Any, config: FSDPConfig | None, common: dict[str, Any], spec: str, cache: dict[Any, Any] | None = None
) -> MemoryEstimate:
    """One estimate; with ``cache`` (the budget search, analytic), the model and traces are shared."""
    try:
        if cache is not None and common["method"] == "analytic":  # arguments checked by the first estimate
            keys = ("world_size", "rank", "inputs", "batch", "seq", "optimizer", "device")
            return analytic_estimate(factory, config, *(common[k] for k in keys), cache=cache)
        return estimate_memory(factory, config, **common)
    except (ValueError, TypeError, ConfigError) as exc:
        raise UsageError(f"cannot estimate {spec}: {exc}", prog="fsdp2lite estimate") from None


def estimate_table(title: str, estimate: MemoryEstimate) -> Table:
    """The peak and what it is made of."""
    table = Table(title=title)
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for key in BREAKDOWN_KEYS:
        value = estimate.breakdown.get(key, 0)
        share = value / estimate.peak_bytes if estimate.peak_bytes else 0.0
        table.add_row(key, human_bytes(value), f"{share:.0%}")
    where = estimate.phase + (f", in group '{estimate.group or '<root>'}'" if estimate.group is not None else "")
    table.add_row("[bold]peak[/bold]", f"[bold]{human_bytes(estimate.peak_bytes)}[/bold]", where)
    if estimate.host_bytes:
        table.add_row("host (CPU offload)", human_bytes(estimate.host_bytes), "not in the peak")
    caption = [f"method {estimate.method}, target {estimate.device}", *estimate.notes]
    table.caption = "\n".join(caption)
    return table


# ---- the budget search ------------------------------------------------------------------------------
SEARCH: dict[str, tuple[Any, ...]] = {
    "mixed_precision": ("fp32", "bf16"),
    "reshard_after_forward": (False, True),
    "forward_prefetch_depth": (1, 0),
    "activation_checkpointing": (False, True),
    "offload": (False, True),
}


def search_space(base: FSDPConfig, world_size: int) -> dict[str, tuple[Any, ...]]:
    """``SEARCH``, with ``reshard_after_forward: k`` added for the divisor k of the shard degree
    closest to its square root from below (when there is one between 1 and the degree)."""
    _, shard = base.mesh.resolve(world_size)
    divisors = [k for k in range(2, shard) if shard % k == 0 and k * k <= shard]
    space = dict(SEARCH)
    if divisors:
        space["reshard_after_forward"] = (*SEARCH["reshard_after_forward"], divisors[-1])
    return space


def search_budget(
    factory: Any,
    base: FSDPConfig,
    common: dict[str, Any],
    budget: int,
    spec: str,
    cache: dict[Any, Any] | None = None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Every combination of the search space on top of ``base``, estimated; the fitting one with the
    least communication per step is the choice, then one without CPU offload (host-device copies every
    step), then one without activation checkpointing (a second forward), then the smallest peak.
    ``cache`` (analytic): one meta model and one activation trace per compute dtype and checkpointing."""
    cache = {"model": build_on_meta(factory, spec)} if cache is None else cache
    model = cache["model"]
    space = search_space(base, common["world_size"])
    tried = []
    for values in itertools.product(*space.values()):
        settings = dict(zip(space, values))
        config = _with_settings(base, settings)
        estimate = _estimate(factory, config, common, spec, cache)
        comm = communication_bytes(model, config, common["world_size"])
        tried.append(
            {**settings, "peak_bytes": estimate.peak_bytes, "comm_bytes": comm, "fits": estimate.peak_bytes <= budget,
             "host_bytes": estimate.host_bytes}
        )  # fmt: skip
    fitting = [row for row in tried if row["fits"]]
    choice = (
        min(
            fitting,
            key=lambda row: (row["comm_bytes"], row["offload"], row["activation_checkpointing"], row["peak_bytes"]),
        )
        if fitting
        else None
    )
    return choice, tried


def _with_settings(base: FSDPConfig, settings: dict[str, Any]) -> FSDPConfig:
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
    data["offload"] = {"device": "cpu" if settings["offload"] else "none", "pin_memory": True}
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
        gather = numel * (element_size(param_dtype) if param_dtype is not None else 4)
        reduce = numel * (element_size(reduce_dtype) if reduce_dtype is not None else 4)
        comm = policy.communication  # CommPolicy: int8/fp8 codes plus one fp32 scale per block
        if comm.all_gather is not None:
            gather = numel * (1 + 4 / comm.block_size)
        if comm.reduce_scatter == "int8":
            reduce = numel * (1 + 4 / comm.block_size)
        ring = (shard - 1) / shard
        value = policy.reshard_after_forward
        if value == "auto":
            value = group.rule_index is not None  # the root keeps its parameters, the others reshard
        backward_ranks = shard if value is True else (value if isinstance(value, int) and value > 1 else 1)
        total += gather * ring + gather * (backward_ranks - 1) / backward_ranks + reduce * ring
    return int(total)


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["comm_bytes"], row["offload"], row["activation_checkpointing"], row["peak_bytes"])


def nearest_rows(tried: list[dict[str, Any]], choice: dict[str, Any] | None, few: int = 5) -> list[dict[str, Any]]:
    """The chosen setting and its nearest alternatives: the next fitting ones in the choice's order, and
    the cheapest in communication that do not fit (what a bigger budget would buy). Without a choice,
    the smallest peaks (how far off the budget is)."""
    ordered = sorted(tried, key=_order)
    if choice is None:
        return sorted(tried, key=lambda row: row["peak_bytes"])[:few]
    fitting = [row for row in ordered if row["fits"] and row is not choice][: few - 3]
    cheaper = [row for row in ordered if not row["fits"] and row["comm_bytes"] < choice["comm_bytes"]][-2:]
    return sorted([choice, *fitting, *cheaper], key=_order)


def search_table(
    budget: int, tried: list[dict[str, Any]], choice: dict[str, Any] | None, ranks_per_node: int, show_all: bool
) -> Table:
    rows = sorted(tried, key=_order) if show_all else nearest_rows(tried, choice)
    nearest = f"the choice and its nearest alternatives ({len(tried)} tried; --all shows them)"
    shown = "every setting tried" if show_all else nearest
    table = Table(title=f"settings for a budget of {human_bytes(budget)}: {shown}")
    columns = (*SEARCH, "peak", "sent/step", "host/rank", f"host/node ({ranks_per_node})", "fits")
    for column in columns:
        table.add_column(column, justify="left" if column in SEARCH or column == "fits" else "right")
    for row in rows:
        chosen = row is choice
        style = "bold green" if chosen else ("" if row["fits"] else "dim")
        host = row.get("host_bytes", 0)
        table.add_row(
            *(str(row[key]).lower() for key in SEARCH),
            human_bytes(row["peak_bytes"]),
            human_bytes(row["comm_bytes"]),
            human_bytes(host) if host else "-",
            human_bytes(host * ranks_per_node) if host else "-",
            ("chosen" if chosen else "yes") if row["fits"] else "no",
            style=style,
        )
    table.caption = "host: CPU offload's fp32 shards, gradients and optimizer state, per rank and per machine"
    return table


def _write_config(path: str, base: FSDPConfig, choice: dict[str, Any]) -> None:
    config = _with_settings(base, choice)
    text = f"# written by fsdp2lite estimate: fits with {choice['peak_bytes']:,} bytes at the peak\n" + config.to_yaml()
    Path(path).write_text(text)
    FSDPConfig.from_yaml(path)  # what was written reads back
