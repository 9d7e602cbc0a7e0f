"""Offload that fits a workstation (issue 33): host memory, disk and pinned memory of CPU offload, fsdp2lite against
torch's fully_shard with torch's CPUOffloadPolicy. Why: an offloaded job's host memory decides whether it fits a
workstation; NVMe trades it for disk and I/O per step; page-locked memory is memory the OS can neither swap nor lend.

``--device cpu`` (default): bench_offload.py's GPT (16.8M parameters, one sequence per rank), seed 0, every block a
group, then the root, AdamW (lr 1e-4, fp32, torch's CPU for-loop), gloo ranks, steps interleaved run by run:
    torch             torch's ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))``: the rival
    fsdp2lite         ``fl.CPUOffloadPolicy(pin_memory=False)``: the optimizer state in host memory
    fsdp2lite + NVMe  ``fl.CPUOffloadPolicy(pin_memory=False, optimizer="nvme", nvme_path=DIR)`` (``--nvme-path``,
                      else a temporary directory; [Note: optimizer state on NVMe])
Per run: median step and ``optimizer.step()`` times and medians of per-step ratios against torch; host bytes held for
the optimizer state (``optimizer.state``'s tensors plus NVMe's staging slots), disk reserved and NVMe bytes read and
written per step (``fsdp2lite.offload.nvme_stats``), host bytes of the shards (fsdp2lite: ``host_arena.nbytes``;
torch: its sharded parameters' local bytes); the largest loss difference from fsdp2lite in memory (NVMe: 0.0).

``--device cuda``: one process per library, rank 0 of 8 on torch's fake process group, a 1.3B GPT (GPT-3 XL's shape:
d 2048, 24 layers, vocab 50257, tied; seq 1024) built on the GPU, fp32 masters, bf16 parameters, fp32 reduction,
``CPUOffloadPolicy(pin_memory=True)``, one AdamW step. Pinned host bytes after sharding and after the step (before
``zero_grad``): torch's caching host allocator's (``torch.cuda.memory.host_memory_stats()``: blocks in use and cached,
each a power of two; ``allocated_bytes.current`` in torch 2.13's layout, ``reserved_bytes.current`` in the earlier
one) plus fsdp2lite's group buffers registered with the driver at their exact size (``host_arena.pinning ==
"registered"``, unseen by the allocator). Reported: pinned bytes fsdp2lite / torch (target <= 0.6), the exact shard
bytes, and a closed form (``shard_plan``). ``--dry-run``: the same without CUDA, the GPT on meta, sharded on a CPU
mesh: the plan and closed form only, no step, no files.

How to run (not with torchrun):
    .venv/bin/python benchmarks/bench_offload_memory.py [--steps 20] [--warmup 2] [--world-size 2] [--nvme-path DIR]
        [--layers 4] [--d-model 512] [--heads 8] [--vocab 8192] [--seq-len 64] [--batch 1] [--out-dir DIR] [--no-save]
    python benchmarks/bench_offload_memory.py --device cuda                      # a CUDA machine
    .venv/bin/python benchmarks/bench_offload_memory.py --device cuda --dry-run  # its plan, without a GPU
A rich table, then one JSON line; unless --no-save or --dry-run, ``<out-dir>/offload-memory-<device>-<YYYYmmdd-
HHMMSS>.json`` (every number, machine, versions, command) and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _results import environment, environment_markdown, finish_run, gpt_title, markdown_table
from bench_offload import Run, make_batch, time_interleaved
from bench_step import median_ratio, spawn_and_read
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2lite as fl
from fsdp2lite._spawn import exit_rank_process
from fsdp2lite.models import GPT, GPTConfig
from fsdp2lite.offload import nvme_stats

LR = 1e-4
MIB = 2**20
PINNED_TARGET = 0.6  # issue 33: pinned host bytes fsdp2lite / torch on the GPU
RIVAL, REFERENCE, NVME = "torch", "fsdp2lite", "fsdp2lite + NVMe"  # times against torch, losses against fsdp2lite
IN_BACKWARD = "fsdp2lite + step_in_backward"  # the CUDA half's third library: one gradient buffer for all groups
DEFAULTS = {  # per --device: model, batch and world size
    "cpu": {"layers": 4, "d_model": 512, "heads": 8, "vocab": 8192, "seq_len": 64, "batch": 1, "world_size": 2},
    "cuda": {"layers": 24, "d_model": 2048, "heads": 16, "vocab": 50257, "seq_len": 1024, "batch": 1, "world_size": 8},
}
BYTE_FIELDS = ("optimizer_state_in_memory", "staging", "disk_reserved", "nvme_state", "nvme_read_per_step",
               "nvme_written_per_step", "nvme_read_total", "nvme_written_total", "shard_host")  # fmt: skip


@dataclass(frozen=True)
class Setup:  # one way to shard the model and keep its optimizer state
    name: str  # row label and JSON key
    library: str  # "fsdp2lite" or "torch"
    optimizer: str  # where fsdp2lite keeps the state: "cpu" (host memory) or "nvme"


SETUPS = (Setup(RIVAL, "torch", "cpu"), Setup(REFERENCE, "fsdp2lite", "cpu"), Setup(NVME, "fsdp2lite", "nvme"))


# ---- CPU: host memory, disk and NVMe traffic ------------------------------------------------------------------
def build(setup: Setup, config: GPTConfig, mesh: DeviceMesh, nvme_path: str) -> Run:
    """The GPT (seed 0), every block then the root sharded with CPU offload; AdamW as torch picks it on CPU."""
    torch.manual_seed(0)
    model = GPT(config)
    nvme = {"optimizer": "nvme", "nvme_path": nvme_path} if setup.optimizer == "nvme" else {}
    for module in [*model.blocks, model]:
        if setup.library == "fsdp2lite":
            fl.fully_shard(module, mesh, offload_policy=fl.CPUOffloadPolicy(pin_memory=False, **nvme))
        else:
            torch_fully_shard(module, mesh=mesh, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    return Run(model, [torch.optim.AdamW(model.parameters(), lr=LR)], True, [])


def _local_bytes(tensor: torch.Tensor) -> int:
    return tensor.to_local().nbytes if hasattr(tensor, "to_local") else tensor.nbytes  # a DTensor: this rank's


def host_bytes(setup: Setup, run: Run) -> list[int]:
    """``BYTE_FIELDS`` of one run on this rank, after its last step."""
    (optimizer,) = run.optimizers
    in_memory = sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    mine = setup.library == "fsdp2lite"
    shards = fl.offload.host_memory(run.model).shards if mine else sum(map(_local_bytes, run.model.parameters()))
    stats = nvme_stats(optimizer)
    if stats is None:
        return [in_memory, 0, 0, 0, 0, 0, 0, 0, shards]
    moved = [stats.step_bytes_read, stats.step_bytes_written, stats.bytes_read, stats.bytes_written]
    return [in_memory, stats.staging_bytes, stats.reserved_bytes, stats.state_bytes, *moved, shards]


def measure_rank(
    rank: int, world_size: int, config: GPTConfig, batch_size: int, warmup: int, steps: int, nvme_path: str
) -> dict[str, Any]:
    """Every run built, timed interleaved; then its bytes. Times and bytes max, losses mean over the ranks."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    batch = make_batch(config, batch_size, rank)
    runs = [build(setup, config, mesh, nvme_path) for setup in SETUPS]
    times = time_interleaved(runs, batch, warmup, steps)  # (run, step, [whole, optimizer.step()])
    held = torch.tensor([host_bytes(setup, run) for setup, run in zip(SETUPS, runs)], dtype=torch.int64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    dist.all_reduce(held, op=dist.ReduceOp.MAX)  # the largest rank's
    losses = torch.tensor([run.losses for run in runs], dtype=torch.float64)  # (run, step)
    dist.all_reduce(losses)
    return {
        "n_params": sum(p.numel() for p in runs[0].model.parameters()),  # DTensors: global numel
        "step_s": {s.name: times[i, :, 0].tolist() for i, s in enumerate(SETUPS)},
        "opt_step_s": {s.name: times[i, :, 1].tolist() for i, s in enumerate(SETUPS)},
        "losses": {s.name: (losses[i] / world_size).tolist() for i, s in enumerate(SETUPS)},
        "bytes": {s.name: dict(zip(BYTE_FIELDS, held[i].tolist())) for i, s in enumerate(SETUPS)},
    }


def _rank_entry(rank: int, out_file: str, init_file: str, world_size: int, *args: Any) -> None:
    torch.set_num_threads(1)  # ranks share the cores: one thread each
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result = measure_rank(rank, world_size, *args)
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))
    dist.barrier()  # rank 0's file is written before any rank leaves
    dist.destroy_process_group()
    exit_rank_process()  # no interpreter finalization after gloo ([Note: rank exit] in fsdp2lite/_spawn.py)


def disk_of(path: str) -> dict[str, Any]:
    """The file system holding ``path`` (the longest mount point of /proc/mounts above it) and its free bytes."""
    real = os.path.realpath(path)
    mounts = Path("/proc/mounts").read_text().splitlines() if os.path.exists("/proc/mounts") else []
    above = [(m[0], m[1].replace("\\040", " "), m[2]) for m in (line.split() for line in mounts)]
    above = [m for m in above if real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    # the longest mount point; of two on the same point the later, which hides the earlier
    device, mount, kind = max(reversed(above), key=lambda m: len(m[1]), default=("unknown", "/", "unknown"))
    stat = os.statvfs(real)
    return {"path": real, "device": device, "mount": mount, "fs_type": kind,
            "free_bytes": stat.f_bavail * stat.f_frsize, "in_ram": kind in ("tmpfs", "ramfs")}  # fmt: skip


def summarize_row(setup: Setup, result: dict[str, Any]) -> dict[str, Any]:
    """One run's numbers: ms and their ratios against torch (medians of per-step ratios), bytes, losses."""
    whole, opt = result["step_s"][setup.name], result["opt_step_s"][setup.name]
    held, losses = result["bytes"][setup.name], result["losses"][setup.name]
    return {
        "library": setup.library, "optimizer_state": setup.optimizer,
        "step_ms_median": 1e3 * statistics.median(whole), "step_ms": [1e3 * t for t in whole],
        "step_vs_torch": median_ratio(whole, result["step_s"][RIVAL]),
        "opt_step_ms_median": 1e3 * statistics.median(opt), "opt_step_ms": [1e3 * t for t in opt],
        "opt_step_vs_torch": median_ratio(opt, result["opt_step_s"][RIVAL]),
        "host_optimizer_bytes": held["optimizer_state_in_memory"] + held["staging"], **held, "losses": losses,
        "max_loss_diff_vs_fsdp2lite": max(abs(a - b) for a, b in zip(losses, result["losses"][REFERENCE], strict=True)),
    }  # fmt: skip


def summarize_cpu(result: dict[str, Any], args: argparse.Namespace, config: GPTConfig, disk: dict[str, Any]) -> dict:
    rows = {setup.name: summarize_row(setup, result) for setup in SETUPS}
    nvme, memory = rows[NVME], rows[REFERENCE]
    return {
        "model": asdict(config), "n_params": result["n_params"], "batch_per_rank": args.batch,
        "world_size": args.world_size, "backend": "gloo", "device": "cpu", "optimizer": f"AdamW lr {LR}, fp32",
        "warmup": args.warmup, "steps": args.steps, "load_average_at_start": args.load, "nvme_disk": disk,
        "runs": rows, "nvme_host_optimizer_ratio": nvme["host_optimizer_bytes"] / memory["host_optimizer_bytes"],
        "nvme_bit_for_bit": nvme["max_loss_diff_vs_fsdp2lite"] == 0.0,
    }  # fmt: skip


CPU_COLUMNS = ("run", "step ms", "vs torch", "opt step ms", "vs torch", "host optim MiB", "disk MiB", "NVMe read/step"
               " MiB", "NVMe write/step MiB", "shards MiB", "last loss", "max dloss vs fsdp2lite")  # fmt: skip


def _mib(nbytes: float | None, digits: int = 2) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.{digits}f}"


def cpu_rows(summary: dict[str, Any]) -> list[list[str]]:
    return [
        [
            name, f"{row['step_ms_median']:.1f}", f"{row['step_vs_torch']:.3f}", f"{row['opt_step_ms_median']:.2f}",
            f"{row['opt_step_vs_torch']:.3f}", _mib(row["host_optimizer_bytes"]), _mib(row["disk_reserved"]),
            _mib(row["nvme_read_per_step"]), _mib(row["nvme_written_per_step"]), _mib(row["shard_host"]),
            f"{row['losses'][-1]:.6f}", f"{row['max_loss_diff_vs_fsdp2lite']:.1e}",
        ]
        for name, row in summary["runs"].items()
    ]  # fmt: skip


def title(what: str, summary: dict[str, Any], ranks: str) -> str:
    return f"{what}: {gpt_title(summary)}, {ranks}"


def cpu_notes(summary: dict[str, Any]) -> list[str]:
    nvme, disk = summary["runs"][NVME], summary["nvme_disk"]
    ram = "RAM (tmpfs): the NVMe row measures memory copies, not a disk"
    cache = "a disk, but through the page cache (no O_DIRECT): a state this small is likely served from RAM"
    return [
        f"NVMe directory {disk['path']} is on {disk['device']} ({disk['fs_type']}, mounted at {disk['mount']}, "
        f"{disk['free_bytes'] / 1e9:.1f} GB free): {ram if disk['in_ram'] else cache}",
        f"NVMe: host memory for the optimizer state {summary['nvme_host_optimizer_ratio']:.3f}x in-memory offload's; "
        f"state {_mib(nvme['nvme_state'])} MiB on disk, read {_mib(nvme['nvme_read_total'])} and written "
        f"{_mib(nvme['nvme_written_total'])} MiB over {summary['warmup'] + summary['steps']} steps (the first step "
        f"reads nothing); losses bit for bit: {summary['nvme_bit_for_bit']}",
        "host optim: optimizer.state's tensors (the largest rank's) plus NVMe's two staging slots; disk: reserved for "
        "the state files; shards: fsdp2lite's host_arena bytes (64-byte aligned, padded), torch's sharded parameters' "
        "local bytes; opt step: optimizer.step() alone, where NVMe reads and writes; max dloss: largest |loss - "
        "fsdp2lite's in-memory loss| over the steps",
        f"load average at start {summary['load_average_at_start']:.2f}",
    ]


def run_cpu(args: argparse.Namespace, config: GPTConfig, console: Console) -> tuple[dict[str, Any], str]:
    """The CPU half: one spawn of gloo ranks, the NVMe files under ``--nvme-path`` or a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="fsdp2lite-bench-") as tmp:
        nvme_path = args.nvme_path or tmp
        disk = disk_of(nvme_path)
        with console.status(f"{args.world_size} gloo ranks, {len(SETUPS)} runs, {args.warmup} + {args.steps} steps"):
            rank_args = (config, args.batch, args.warmup, args.steps, nvme_path)
            result = spawn_and_read(_rank_entry, args.world_size, (str(Path(tmp) / "pg"), args.world_size, *rank_args))
    summary = summarize_cpu(result, args, config, disk)
    ranks = f"{args.world_size} gloo ranks, {args.steps} steps after {args.warmup} warm-up"
    return summary, report(console, title("CPU offload memory", summary, ranks), CPU_COLUMNS, cpu_rows(summary),
                           cpu_notes(summary))  # fmt: skip


# ---- CUDA: pinned host bytes -----------------------------------------------------------------------------------
def allocator_pinned_bytes() -> tuple[int | None, str]:
    """Bytes of pinned blocks torch's caching host allocator holds (in use and cached, each rounded up to a power
    of two), and the key read; None and why when this torch cannot say."""
    read = getattr(torch.cuda.memory, "host_memory_stats", None)
    if read is None:
        return None, f"torch {torch.__version__} has no torch.cuda.memory.host_memory_stats()"
    stats = read()
    if not stats:
        return None, "host_memory_stats() is empty: CUDA is not initialized (no CUDA device, or --dry-run)"
    if "active_bytes.current" in stats:  # torch 2.13's layout: allocated_bytes counts active and cached blocks
        return int(stats["allocated_bytes.current"]), "allocated_bytes.current"
    if "reserved_bytes.current" in stats:  # the earlier layout: reserved_bytes every block, allocated_bytes active
        return int(stats["reserved_bytes.current"]), "reserved_bytes.current"
    return None, f"host_memory_stats() has no known pinned-bytes key: {sorted(stats)}"


def gpu_build(library: str, config: GPTConfig, mesh: DeviceMesh) -> tuple[GPT, torch.optim.Optimizer | None]:
    """The GPT (seed 0) on the mesh's device (on meta for a CPU mesh: --dry-run), every block then the root
    sharded: fp32 masters offloaded to pinned host memory, bf16 parameters, fp32 reduction. AdamW over every
    parameter; ``IN_BACKWARD``: one AdamW per group, stepped inside backward (None returned)."""
    torch.manual_seed(0)
    with torch.device("meta" if mesh.device_type == "cpu" else mesh.device_type):
        model = GPT(config)
    mp_policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
    torch_mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch_offload = TorchCPUOffloadPolicy(pin_memory=True)
    for module in [*model.blocks, model]:
        if library == RIVAL:
            torch_fully_shard(module, mesh=mesh, mp_policy=torch_mp, offload_policy=torch_offload)
        else:
            fl.fully_shard(module, mesh, mp_policy=mp_policy, offload_policy=fl.CPUOffloadPolicy(pin_memory=True))
    if library == IN_BACKWARD:
        fl.step_in_backward(model, lambda params: torch.optim.AdamW(params, lr=LR))
        return model, None
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _pow2(nbytes: int) -> int:
    return 1 << (nbytes - 1).bit_length() if nbytes else 0


def shard_plan(model: GPT, world_size: int) -> dict[str, int]:
    """Rank 0's padded shards and their closed-form pinned bytes, from the global shapes: both libraries chunk dim 0,
    a shard padded to ceil(rows / world_size) rows. torch's allocator pins each shard, and each gradient shard,
    as one block rounded up to a power of two; fsdp2lite packs a group's shards into one exact buffer (each at 64
    bytes) and its gradients into another, both registered at their exact size ([Note: one host buffer per group]);
    stepping in backward, every group's gradients share one buffer, the largest group's ([Note: host gradient
    buffers])."""
    groups = [list(block.parameters()) for block in model.blocks]
    in_blocks = {id(p) for group in groups for p in group}
    groups.append([p for p in model.parameters() if id(p) not in in_blocks])  # the root's
    shards = [[-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) * p.element_size() for p in g] for g in groups]
    flat = [nbytes for group in shards for nbytes in group]  # (ceil(rows / ws), *rest) each
    return {
        "n_params": sum(p.numel() for p in model.parameters()), "shard_bytes": sum(flat),
        "torch_shards": sum(map(_pow2, flat)), "torch_grads": sum(map(_pow2, flat)),
        "fsdp2lite_shards": sum(-(-n // 64) * 64 for n in flat), "fsdp2lite_grads": sum(sum(g) for g in shards),
        "largest_group_grads": max(sum(g) for g in shards),
    }  # fmt: skip


def pinned_now(model: GPT, baseline: int | None) -> dict[str, Any]:
    """Pinned host bytes now: the allocator's above ``baseline``, plus fsdp2lite's buffers registered at their
    exact size (the allocator does not see those; buffers it pinned itself are in its count)."""
    allocator, key = allocator_pinned_bytes()
    by_pinning = {"registered": 0, "allocator": 0, "none": 0}
    if any(isinstance(module, fl.FSDPModule) for module in model.modules()):
        mine = fl.offload.host_memory(model)  # packed shards, own buffers and the gradient pool
        by_pinning = {"registered": mine.registered, "allocator": mine.pinned - mine.registered,
                      "none": mine.total - mine.pinned}  # fmt: skip
    held = None if allocator is None or baseline is None else allocator - baseline
    return {
        "allocator_bytes": held, "registered_bytes": by_pinning["registered"], "arena_bytes": by_pinning,
        "pinned_bytes": None if held is None else held + by_pinning["registered"], "stats_key": key,
    }  # fmt: skip


def measure_library(library: str, config: GPTConfig, batch: int, world_size: int, device: str) -> dict[str, Any]:
    """One library in this process (its own host allocator): sharded, then one step; pinned bytes after each."""
    baseline, _ = allocator_pinned_bytes()
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("shard",))
    model, optimizer = gpu_build(library, config, mesh)
    built, loss = pinned_now(model, baseline), None
    if device == "cuda":
        tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), device=device,
                               generator=torch.Generator(device=device).manual_seed(1))  # fmt: skip
        loss_tensor = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss_tensor.backward()  # IN_BACKWARD: each group stepped on the host here
        if optimizer is not None:
            optimizer.step()  # on the host
        torch.cuda.synchronize()  # every gradient's copy to the host has landed
        loss = loss_tensor.item()
    stepped = pinned_now(model, baseline)  # before zero_grad: the gradient buffers alive
    read = getattr(torch.cuda.memory, "host_memory_stats", dict)
    stats = {k: v for k, v in read().items() if "bytes" in k or k.startswith("num_host")}
    return {"plan": shard_plan(model, world_size), "built": built, "stepped": stepped, "loss": loss, "stats": stats}


def _gpu_entry(rank: int, out_file: str, library: str, config: GPTConfig, batch: int, world: int, dry: bool) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dry:
        torch.cuda.init()  # host_memory_stats() reads {} until CUDA is initialized
    # --dry-run's mesh is a CPU one on purpose (this process is this library's alone)
    warnings.filterwarnings("ignore", message=r"CPUOffloadPolicy\(pin_memory=True\) on a 'cpu' mesh")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        result = measure_library(library, config, batch, world, "cpu" if dry else "cuda")
    finally:
        dist.destroy_process_group()
    Path(out_file).write_text(json.dumps(result))


def closed_form(plan: dict[str, int]) -> dict[str, int]:
    """Each library's pinned bytes by ``shard_plan``'s arithmetic."""
    return {
        RIVAL: plan["torch_shards"] + plan["torch_grads"],
        REFERENCE: plan["fsdp2lite_shards"] + plan["fsdp2lite_grads"],
        IN_BACKWARD: plan["fsdp2lite_shards"] + plan["largest_group_grads"],
    }  # fmt: skip


def summarize_gpu(results: dict[str, dict[str, Any]], args: argparse.Namespace, config: GPTConfig) -> dict:
    rival = results[RIVAL]["stepped"]["pinned_bytes"]
    ratios = {
        name: None if (mine := row["stepped"]["pinned_bytes"]) is None or not rival else mine / rival
        for name, row in results.items() if name != RIVAL
    }  # fmt: skip
    ratio = min((value for value in ratios.values() if value is not None), default=None)
    plan = results[RIVAL]["plan"]
    closed = {name: value for name, value in closed_form(plan).items() if name in results}
    return {
        "model": asdict(config), "n_params": plan["n_params"], "batch_per_rank": args.batch,
        "world_size": args.world_size, "backend": "fake", "device": "cuda", "dry_run": args.dry_run,
        "precision": "fp32 masters offloaded (pin_memory=True), bf16 parameters, fp32 reduction, AdamW",
        "libraries": results, "pinned_ratios": ratios, "closed_form_pinned": closed,
        "closed_form_ratios": {name: closed[name] / closed[RIVAL] for name in closed if name != RIVAL},
        "target": {"what": f"pinned host bytes fsdp2lite / torch <= {PINNED_TARGET} (the better fsdp2lite run)",
                   "value": ratio, "ok": None if ratio is None else ratio <= PINNED_TARGET},
    }  # fmt: skip


GPU_COLUMNS = ("library", "shards MiB", "closed form MiB", "registered MiB", "allocator after shard MiB",
               "allocator after step MiB", "pinned MiB", "vs torch", "loss")  # fmt: skip


def gpu_rows(summary: dict[str, Any]) -> list[list[str]]:
    rival = summary["libraries"][RIVAL]["stepped"]["pinned_bytes"]
    rows = []
    for name, row in summary["libraries"].items():
        built, stepped = row["built"], row["stepped"]
        rows.append([
            name, _mib(row["plan"]["shard_bytes"], 1), _mib(summary["closed_form_pinned"][name], 1),
            _mib(stepped["registered_bytes"], 1), _mib(built["allocator_bytes"], 1),
            _mib(stepped["allocator_bytes"], 1), _mib(stepped["pinned_bytes"], 1),
            "-" if stepped["pinned_bytes"] is None or not rival else f"{stepped['pinned_bytes'] / rival:.3f}",
            "-" if row["loss"] is None else f"{row['loss']:.4f}",
        ])  # fmt: skip
    return rows


def gpu_notes(summary: dict[str, Any]) -> list[str]:
    target, plan = summary["target"], summary["libraries"][RIVAL]["plan"]
    verdict = "not measured" if target["ok"] is None else ("PASS" if target["ok"] else "FAIL")
    value = "-" if target["value"] is None else f"{target['value']:.3f}"
    closed = ", ".join(f"{name} {ratio:.3f}x" for name, ratio in summary["closed_form_ratios"].items())
    return [
        f"target {target['what']}: {verdict} ({value}); pinned: the allocator's after the step plus fsdp2lite's "
        f"registered buffers; closed form: {closed}",
        f"allocator: torch.cuda.memory.host_memory_stats(), read: {summary['libraries'][RIVAL]['stepped']['stats_key']}"
        "; above the process's start; blocks in use and cached, each a power of two; fsdp2lite's buffers by "
        f"pinning: {summary['libraries']['fsdp2lite']['stepped']['arena_bytes']}",
        "shards: rank 0's padded shards, exact and unpinned; closed form (shard_plan): torch a block per shard and per "
        f"gradient (shards {_mib(plan['torch_shards'], 1)} + grads {_mib(plan['torch_grads'], 1)} MiB), fsdp2lite "
        f"its packed shards and gradient buffers, each registered at its size ({_mib(plan['fsdp2lite_shards'], 1)} + "
        f"{_mib(plan['fsdp2lite_grads'], 1)} MiB; stepping in backward one gradient buffer, the largest group's, "
        f"{_mib(plan['largest_group_grads'], 1)} MiB); {summary['precision']}",
        f"{IN_BACKWARD}: fsdp2lite.step_in_backward, one AdamW per group stepped as its gradients land; torch would "
        "need its own hooks for that (not run: its allocator caches each freed gradient block for reuse)",
    ] + (["--dry-run: the GPT on meta, sharded on a CPU mesh: plan only, nothing pinned, no step"] if summary["dry_run"]
         else [])  # fmt: skip


def run_gpu(args: argparse.Namespace, config: GPTConfig, console: Console) -> tuple[dict[str, Any], str]:
    """The CUDA half: one fresh process per library, so that neither finds the other's cached pinned blocks."""
    results = {}
    for library in (REFERENCE, IN_BACKWARD, RIVAL):
        with console.status(f"{library}: rank 0 of {args.world_size} on the fake process group"):
            entry_args = (library, config, args.batch, args.world_size, args.dry_run)
            results[library] = spawn_and_read(_gpu_entry, 1, entry_args)
    summary = summarize_gpu(results, args, config)
    ranks = f"rank 0 of {args.world_size} (fake process group){', DRY RUN' if args.dry_run else ''}"
    return summary, report(console, title("CUDA offload pinned host memory", summary, ranks), GPU_COLUMNS,
                           gpu_rows(summary), gpu_notes(summary))  # fmt: skip


# ---- both ------------------------------------------------------------------------------------------------------
def report(console: Console, title: str, columns: tuple[str, ...], rows: list[list[str]], notes: list[str]) -> str:
    """Print the table and its notes; the same as markdown."""
    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for line in notes:
        console.print(f"  {line}", highlight=False, markup=False)
    bullets = "".join(f"- {line}\n" for line in notes)
    return f"{title}\n\n{markdown_table(columns, rows)}\n{bullets}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="which half (see the docstring)")
    parser.add_argument("--dry-run", action="store_true", help="--device cuda without CUDA: the plan on meta")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (cpu)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (cpu)")
    parser.add_argument("--nvme-path", default=None, help="directory of the NVMe files (cpu; default: a temp dir)")
    for flag, meaning in (("world-size", "ranks: gloo (cpu), fake (cuda)"), ("layers", "GPT blocks, a group each"),
                          ("d-model", "model width"), ("heads", "attention heads"), ("vocab", "vocabulary (tied)"),
                          ("seq-len", "tokens per sequence"), ("batch", "sequences per rank")):  # fmt: skip
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"{meaning}; default per --device: {DEFAULTS}")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true", help="print only, write no files")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    for flag in ("steps", "warmup", "layers", "d_model", "heads", "vocab", "seq_len", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2 (sharded across ranks), got {args.world_size}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.dry_run and args.device != "cuda":
        parser.error("--dry-run is for --device cuda (the CPU half runs as it is)")
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        parser.error(f"--nvme-path {args.nvme_path!r} is not an existing directory")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cuda" and not args.dry_run and not torch.cuda.is_available():
        why = "sees none (--dry-run builds the plan on meta without one; --device cpu is the CPU half)"
        raise SystemExit(f"bench_offload_memory.py --device cuda needs a CUDA device; torch {torch.__version__} {why}")
    started, start = datetime.datetime.now(), time.perf_counter()
    console = Console() if Console().is_terminal else Console(width=200)  # piped or logged: one line per row
    env, args.load = environment(started), os.getloadavg()[0]  # the code that runs and the machine's load, before
    config = GPTConfig(args.vocab, args.seq_len, args.d_model, args.heads, args.layers, tie_embeddings=True)
    summary, body = (run_cpu if args.device == "cpu" else run_gpu)(args, config, console)
    saving = not args.no_save and not args.dry_run
    stem = f"offload-memory-{args.device}-{started:%Y%m%d-%H%M%S}" if saving else None
    md = f"# bench_offload_memory on {args.device}\n\n{body}\n{environment_markdown(env)}"
    return finish_run(console, args.out_dir, stem, env, summary, md, start)


if __name__ == "__main__":
    main()
