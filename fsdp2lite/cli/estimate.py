"""``fsdp2lite estimate``: will it fit, and with what settings, before a job is launched.

    fsdp2lite estimate --model fsdp2lite.models:gpt_small --world-size 64 --batch 4 --seq 256
    fsdp2lite estimate --model pkg.mod:build --inputs pkg.mod:example --world-size 8 --method analytic
    fsdp2lite estimate --model llama-3-8b --world-size 8 --finetune lora --link nvlink4 --gpu h100
    fsdp2lite estimate --model llama-3-70b --world-size 4 --budget 24GiB --link pcie4 --gpu rtx4090 \
        --write-config qlora70b.yaml

One rank's peak of a steady-state training step and its composition (``fsdp2lite.estimate_memory``),
what the caching allocator reserves for it, and the step's time and tokens/s on a link and GPU
(``estimate.timing``). With ``--budget``, the settings are searched (``estimate_search``: what to train
and how to shard it) and the fastest that fits is reported and, with ``--write-config``, written as a
YAML policy file with the matching ``examples/train.py`` command. ``--json`` prints one JSON object on
stdout and the text on stderr.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .._units import parse_size
from ..config import ConfigError, FSDPConfig
from ..estimate import BREAKDOWN_KEYS, DEVICES, METHODS, OPTIMIZERS, MemoryEstimate, default_config, estimate_memory
from ..estimate.common import default_seq, token_spec
from ..estimate.cuda_context import CudaContext, cuda_context
from ..estimate.finetune import Finetune, plan_model, planned_factory
from ..estimate.offload_budget import resolve_offload_budget
from ..estimate.timing import GPUS, LINKS, Gpu, Link, StepTime, find_gpu, find_link
from ..finetune.feasible import finetune_problems, refusal
from ..finetune.sharding import finetune_config
from ._args import UsageError, non_negative_int, positive_int
from .estimate_job import DATA_PLACEHOLDER, one_line, shown_command, train_arguments, write_config
from .estimate_search import (
    DEFAULT_NVME_PATH,
    SearchJob,
    communication_bytes,
    config_for_setting,
    nearest_rows,
    room,
    search_budget,
    search_order,
    setting_time,
)
from .estimate_text import answer_lines, context_line, recommendation, search_table, wrapped
from .explain import build_on_meta, human_bytes, load_factory, placement_text
from .finetune_args import add_finetune_arguments, check_feasible, finetune_from_args
from .offload_text import host_rows, machine_line, machine_record, nothing_fits
from .validate import problems_table

__all__ = ["communication_bytes", "nearest_rows", "parse_bytes", "run", "add_arguments"]

DESCRIPTION = (
    "Estimate one rank's peak memory for a training step (forward, loss, backward, optimizer) at any world "
    "size, before launching: simulated with the real runtime on fake tensors, or a closed form. With "
    "--budget, find the settings with the least communication that fit."
)


def parse_bytes(text: str) -> int:
    """``80GiB``, ``1.5 TB``, ``2e9``, ``123456`` -> bytes (``_units.parse_size``, as an argparse type)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_bytes_or_zero(text: str) -> int:
    """``parse_bytes``, and ``0`` (none)."""
    return 0 if text.strip() == "0" else parse_bytes(text)


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
    parser.add_argument(
        "--method", choices=METHODS, default=None, help="simulate (default) or analytic; --budget searches analytically"
    )
    parser.add_argument("--device", choices=DEVICES, default="cuda", help="the target: NCCL on CUDA, or gloo on CPU")
    add_finetune_arguments(
        parser,
        "what is trained: full, lora (adapters on a frozen bf16 base) or qlora (the base in NF4); default full, "
        "and with --budget all three are searched",
    )
    speed = parser.add_argument_group("step time")
    speed.add_argument("--link", default=None, help=f"the GPUs' interconnect: {', '.join(LINKS)} (default nvlink4)")
    speed.add_argument("--link-gbps", type=_positive_float, default=None, help="or its bandwidth in GB/s")
    speed.add_argument("--gpu", default=None, help=f"the GPU: {', '.join(GPUS)} (default h100)")
    speed.add_argument("--tflops", type=_positive_float, default=None, help="or its achieved dense BF16 TFLOP/s")
    _add_search_arguments(parser)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout (the text answer goes to stderr)"
    )


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """``--budget`` and what the search reads: host memory, NVMe path, ranks per machine."""
    search = parser.add_argument_group("budget search")
    search.add_argument("--budget", type=parse_bytes, metavar="SIZE", help="device memory per GPU, e.g. 24GiB")
    search.add_argument(
        "--host-ram",
        type=parse_bytes,
        default=256 * 2**30,
        metavar="SIZE",
        help="host memory per machine (256GiB): --budget drops settings over it; without, over it is flagged",
    )
    search.add_argument(
        "--nvme-path",
        default=DEFAULT_NVME_PATH,
        metavar="DIR",
        help=f"with --budget: the nvme_path a setting with optimizer state on NVMe writes (default "
        f"{DEFAULT_NVME_PATH}, a placeholder: a directory on a local NVMe drive)",
    )
    search.add_argument(
        "--write-config",
        metavar="OUT.yaml",
        help="with --budget: write the chosen settings and the command to run them",
    )
    search.add_argument(
        "--global-batch",
        type=positive_int,
        default=64,
        metavar="N",
        help="sequences per optimizer step across the job (64): sets the written command's --grad-accum",
    )
    search.add_argument(
        "--data", default=DATA_PLACEHOLDER, metavar="FILE", help="the training data the written command reads"
    )
    search.add_argument(
        "--tokenizer", metavar="DIR", help="the tokenizer the written command names (chat data needs its template)"
    )
    search.add_argument(
        "--steps", type=positive_int, default=1000, metavar="N", help="the written command's optimizer steps (1000)"
    )
    search.add_argument("--all", action="store_true", help="with --budget: every setting tried, not the nearest few")
    search.add_argument(
        "--cuda-context",
        type=parse_bytes_or_zero,
        metavar="SIZE",
        default=None,
        help="with --budget on a CUDA target: what the CUDA context takes from the budget before PyTorch allocates "
        "(default: the --gpu's, 619 MiB measured on an H200; 0 to take nothing off)",
    )
    search.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        help="ranks sharing one machine's host memory (CPU offload per machine; default min(world size, 8))",
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _hardware(args: argparse.Namespace) -> tuple[str | Link, str | Gpu, str]:
    """(link, gpu, how they were chosen); bad names name the valid ones."""
    for flag, value, find in (("--link", args.link, find_link), ("--gpu", args.gpu, find_gpu)):
        try:
            find(value) if value is not None else None
        except ValueError as exc:
            raise UsageError(f"argument {flag}: {exc}", "fsdp2lite estimate") from None
    link: str | Link = (
        Link(args.link_gbps, LINKS[args.link or "nvlink4"].latency_us) if args.link_gbps else (args.link or "nvlink4")
    )
    gpu: str | Gpu = Gpu(args.tflops, 1.0) if args.tflops else (args.gpu or "h100")
    named = f"{args.link_gbps} GB/s" if args.link_gbps else (args.link or "nvlink4 (assumed: --link)")
    device = f"{args.tflops} TFLOP/s" if args.tflops else (args.gpu or "h100 (assumed: --gpu)")
    return link, gpu, f"{device} over {named}"


def run(args: argparse.Namespace) -> int:
    prog = "fsdp2lite estimate"
    if args.rank >= args.world_size:
        raise UsageError(f"argument --rank: must be < --world-size ({args.world_size}), got {args.rank}", prog=prog)
    link, gpu, hardware = _hardware(args)
    finetune = finetune_from_args(args, prog)  # the flags as explain reads them
    console = Console(stderr=args.json)  # --json: stdout holds the JSON object alone, the text goes to stderr
    factory = load_factory(args.model, prog=prog)
    model = build_on_meta(factory, args.model)  # a clear error now for a factory that does not build a module
    search_finetune = args.finetune is None and args.budget is not None
    inputs = load_factory(args.inputs) if args.inputs else None
    loaded, config = _load_config(args, console)
    if not loaded:
        return 1
    shard = (config or default_config(model)).mesh.resolve(args.world_size)[1]
    check_feasible(model, finetune, args.model, prog, shard)  # [Note: one feasibility rule]: as train.py checks
    excluded = _excluded_kinds(model, finetune, shard, console) if search_finetune else {}
    search_finetune = search_finetune and "lora" not in excluded  # nothing to adapt: only full training searched
    common = {
        "world_size": args.world_size, "rank": args.rank, "inputs": inputs, "batch": args.batch,
        "seq": default_seq(model, args.seq) if inputs is None and _is_token_model(model) else args.seq,
        "optimizer": args.optimizer, "device": args.device,
    }  # fmt: skip
    per_node = args.ranks_per_node or min(args.world_size, 8)
    base = config or default_config(model)
    if args.write_config and args.budget is None and base.offload.budget is None:
        raise UsageError(
            "--write-config needs --budget (it writes the settings the search chose) or a --config with "
            "offload.budget (it writes the placement the budget resolved to)",
            prog=prog,
        )
    if base.offload.budget is not None:
        base = _resolve_budget(args, console, planned_factory(factory, finetune), base, common)
    if args.budget is not None:
        job = SearchJob(
            factory, args.model, common, finetune, search_finetune, link, gpu, per_node, args.host_ram, args.nvme_path,
            excluded=tuple(excluded),
        )  # fmt: skip
        return _run_search(args, console, job, base, hardware, model)
    method = args.method or "simulate"
    chosen_config = finetune_config(base) if finetune.adapters else base  # as examples/train.py applies it
    estimate = _estimate(factory, chosen_config, {**common, "method": method}, args.model, finetune)
    console.print(estimate_table(f"{args.model}, world size {args.world_size}, rank {args.rank}", estimate))
    record: dict[str, Any] = estimate.to_json()
    meta = model  # the meta model built above, now the one this job trains
    plan_model(meta, finetune)
    record["sent_per_step_bytes"] = sent = communication_bytes(meta, chosen_config, args.world_size)
    console.print(f"sent per rank per step: {human_bytes(sent)} (ring collectives; the config's communication policy)")
    job = SearchJob(factory, args.model, common, finetune, False, link, gpu, per_node, args.host_ram)
    speed = setting_time(meta, chosen_config, job, finetune)
    console.print(speed_line(speed, hardware))
    _show_machine(console, record, (speed, estimate), per_node, args)
    if args.json:
        print(json.dumps(record))
    return 0


def _excluded_kinds(model: Any, finetune: Finetune, shard: int, console: Console) -> dict[str, str]:
    """The fine-tuning kinds a ``--budget`` search leaves out, each with the refusal train.py would print
    ([Note: one feasibility rule]; printed once each): both adapter kinds when no target matches, qlora
    when its NF4 base cannot be split over ``shard`` ranks."""
    excluded = {}
    for kind in ("lora", "qlora"):
        problems = finetune_problems(model, kind, finetune.targets, shard)
        if problems:
            excluded[kind] = refusal(kind, shard, problems, model, finetune.targets)
    if "lora" in excluded:  # the same problem (no target) for both kinds: said once
        excluded["qlora"] = excluded["lora"] = excluded["lora"].replace("--finetune lora:", "--finetune lora|qlora:")
    for why in dict.fromkeys(excluded.values()):
        for line in f"not searched: {why}".splitlines():
            console.print(wrapped(line, console.width), soft_wrap=True)
    return excluded


def _resolve_budget(
    args: argparse.Namespace, console: Console, factory: Any, config: FSDPConfig, common: dict[str, Any]
) -> FSDPConfig:
    """The config's ``offload.budget`` resolved ([Note: offload budget]): the placement printed, and written
    with ``--write-config`` (without ``--budget``); the resolved config is what the rest estimates."""
    keys = ("world_size", "batch", "seq", "optimizer", "device", "inputs")
    try:
        placement = resolve_offload_budget(factory, config, **{key: common[key] for key in keys})
    except ValueError as exc:
        raise UsageError(f"argument --config: {exc}", prog="fsdp2lite estimate") from None
    console.print(
        f"offload budget {human_bytes(placement.budget)}: {placement_text(placement, config)}", soft_wrap=True
    )
    if not placement.fits:
        activations = placement.estimate.breakdown.get("activations", 0)
        console.print(
            f"[red]the budget {human_bytes(placement.budget)} is not reached even with every group offloaded: "
            f"{human_bytes(placement.estimate.peak_bytes)} at the peak, of which activations alone are "
            f"{human_bytes(activations)}[/red] (a smaller batch or sequence, or activation checkpointing)"
        )
    if args.write_config and args.budget is None:
        Path(args.write_config).write_text(
            f"# {args.config}'s offload budget resolved by fsdp2lite estimate for world size {args.world_size}, "
            f"batch {args.batch}\n" + placement.config.to_yaml(),
            encoding="utf-8",
        )
        console.print(f"wrote {args.write_config}")
    return placement.config


def _context(args: argparse.Namespace) -> CudaContext:
    """What the CUDA context takes off ``--budget`` (none on a CPU target); a budget it leaves nothing of is
    refused, naming both."""
    if args.device != "cuda":
        return CudaContext(0, "a CPU target has no CUDA context")
    given = CudaContext(args.cuda_context or 0, "--cuda-context")  # 0: nothing taken off
    context = cuda_context(args.gpu or "h100") if args.cuda_context is None else given
    if args.budget <= context.nbytes:
        raise UsageError(
            f"argument --budget: {human_bytes(args.budget)} leaves nothing beside the CUDA context of "
            f"{human_bytes(context.nbytes)} ({context.source}); give the card's memory, e.g. 24GiB",
            "fsdp2lite estimate",
        )
    return context


def _is_token_model(model: Any) -> bool:
    return token_spec(model) is not None


def _run_search(
    args: argparse.Namespace, console: Console, job: SearchJob, base: FSDPConfig, hardware: str, model: Any
) -> int:
    caches: dict[bool, dict[Any, Any]] = {False: {"model": model}}
    context = _context(args)
    usable = args.budget - context.nbytes  # what PyTorch's allocator can have of the card
    choice, tried = search_budget(job, base, usable, caches)
    rows = sorted(tried, key=search_order) if args.all else nearest_rows(tried, choice)
    table = search_table(args.budget, tried, rows, choice, args.all, console.width, args.device)
    console.print(table)
    record: dict[str, Any] = {"budget": {"bytes": args.budget, "host_ram": args.host_ram, "fits": choice is not None,
                                         "cuda_context_bytes": context.nbytes, "usable_bytes": usable,
                                         "tried": tried}}  # fmt: skip
    if context.nbytes:
        console.print(wrapped(context_line(args.budget, context), console.width), soft_wrap=True)
    if choice is None:
        free = room(args.device, usable)
        console.print(f"[red]{nothing_fits(tried, usable, args.host_ram, job.ranks_per_node, free)}[/red]",
                      soft_wrap=True)  # fmt: skip
        if args.json:
            print(json.dumps(record))
        return 1
    facts = {**job.common, "global_batch": args.global_batch, "hardware": hardware}
    lines = [*recommendation(choice), *answer_lines(choice, usable, facts)]
    if choice["reserved_bytes"] >= choice["reserved_expandable_bytes"] * 1.05:
        grown = human_bytes(choice["reserved_expandable_bytes"])
        lines.append(f"  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: about {grown} reserved instead")
    for number, line in enumerate(lines):
        console.print(wrapped(line, console.width), style="bold" if number == 0 else None, soft_wrap=True)
    record["budget"]["choice"] = choice
    planned = caches[choice["finetune"] != "full"]["model"]  # the meta model the choice was planned on
    if choice.get("optimizer_state") == "nvme" and args.nvme_path == DEFAULT_NVME_PATH:
        console.print(f"  nvme_path {DEFAULT_NVME_PATH} is a placeholder: give --nvme-path a local NVMe directory")
    if args.method == "simulate":  # asked for: the choice measured on the real runtime too
        finetune = Finetune(choice["finetune"], job.finetune.rank, job.finetune.targets)
        checked = _estimate(job.factory, config_for_setting(base, choice, planned),
                            {**job.common, "method": "simulate"}, args.model, finetune)  # fmt: skip
        console.print(estimate_table(f"the choice, simulated ({args.model})", checked))
        record["budget"]["simulated"] = checked.to_json()
    record.update({key: choice[key] for key in ("finetune", "peak_bytes", "reserved_bytes", "host_bytes_per_machine",
                                                "tokens_per_s", "step_s")})  # fmt: skip
    if args.write_config:
        header = [
            f"written by fsdp2lite estimate for {args.model} on {args.world_size} ranks, a "
            f"{human_bytes(args.budget)} budget: {choice['finetune']}, {human_bytes(choice['reserved_bytes'])} "
            f"reserved at the peak, about {choice['tokens_per_s']:,.0f} tokens/s"
        ]
        write_config(args.write_config, base, choice, planned, header)
        run_facts = {"data": args.data, "tokenizer": args.tokenizer, "global_batch": args.global_batch}
        run_facts["steps"] = args.steps
        words = train_arguments(args.write_config, choice, job, args.model, run_facts)
        console.print(f"wrote {args.write_config}; run it with:\n  {shown_command(words)}", soft_wrap=True)
        if args.data == DATA_PLACEHOLDER:
            note = f"  --data {DATA_PLACEHOLDER} is a placeholder: your JSON Lines or text file (estimate's --data)"
            console.print(wrapped(note, console.width), soft_wrap=True)
        record["train_command"] = one_line(words)
    if args.json:
        print(json.dumps(record))
    return 0


def speed_line(speed: StepTime, hardware: str) -> str:
    return (
        f"step time on {hardware}: {speed.step_s:.3f} s (compute {speed.compute_s:.3f} s, collectives "
        f"{speed.comm_s:.3f} s, host copies {speed.h2d_s:.3f} s, exposed {speed.exposed_comm_s:.3f} s); "
        f"{speed.tokens_per_s:,.0f} tokens/s for the job"
    )


def _show_machine(
    console: Console,
    record: dict[str, Any],
    measured: tuple[StepTime, MemoryEstimate],
    per_node: int,
    args: argparse.Namespace,
) -> None:
    """Host memory and NVMe per machine (against ``--host-ram``) printed; them and the step time recorded."""
    speed, estimate = measured
    machine = machine_line(estimate, per_node, args.ranks_per_node is None, args.host_ram)
    if machine is not None:
        console.print(machine, soft_wrap=True)
    record.update(_speed_record(speed, estimate, per_node))
    record.update(machine_record(estimate, per_node, args.host_ram))


def _speed_record(speed: StepTime, estimate: MemoryEstimate, per_node: int) -> dict[str, Any]:
    return {
        "host_bytes_per_machine": estimate.host_bytes * per_node,
        "tokens_per_s": speed.tokens_per_s,
        "step_time": {k: getattr(speed, k) for k in ("compute_s", "comm_s", "exposed_comm_s", "h2d_s", "step_s")},
    }


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
    factory: Any, config: FSDPConfig | None, common: dict[str, Any], spec: str, finetune: Finetune
) -> MemoryEstimate:
    try:
        return estimate_memory(factory, config, **common, finetune=finetune)
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
    if estimate.reserved_bytes:
        share = estimate.reserved_bytes / estimate.peak_bytes if estimate.peak_bytes else 0.0
        table.add_row("reserved (caching allocator)", human_bytes(estimate.reserved_bytes), f"{share:.2f}x the peak")
    host_rows(table, estimate)
    caption = [f"method {estimate.method}, target {estimate.device}, {estimate.finetune}", *estimate.notes]
    if estimate.reserved_bytes and estimate.reserved_bytes >= estimate.reserved_expandable_bytes * 1.05:
        caption.append(
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: {human_bytes(estimate.reserved_expandable_bytes)} "
            "reserved instead (freed blocks serve any later request of their stream)"
        )
    table.caption = "\n".join(caption)
    return table
