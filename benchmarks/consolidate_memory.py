"""Peak memory of ``fsdp2lite consolidate`` against the checkpoint size and its largest tensor.

What: 2 gloo ranks (spawned here) save a DCP checkpoint of about 350 MiB of fp32 Shard(0) DTensors
(one 64 MiB tensor, 18 of 16 MiB, small biases, an int64 buffer, a non-tensor "step"). Then each of
these runs in a fresh subprocess, and its own peak resident memory (``ru_maxrss`` from ``os.wait4``)
is recorded:
    baseline             python -c "import fsdp2lite.checkpoint.consolidate"   (torch, DCP, rich imported)
    pt                   fsdp2lite consolidate CKPT OUT.pt
    safetensors          fsdp2lite consolidate CKPT OUT.safetensors
    pt --dtype bf16      fsdp2lite consolidate CKPT OUT.pt --dtype bf16
    torch                torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, OUT)
                         (torch's own converter: loads the whole state dict, then torch.save)
The pt and safetensors outputs are checked tensor by tensor against torch's.

Why: consolidate streams one tensor at a time, so its peak should be the baseline plus about the
largest tensor (plus one of its shards, plus its cast copy with --dtype), not the checkpoint size.
Target (printed PASS/FAIL, stored under "targets"; the exit status is 0 either way): each streaming
run's peak over the baseline <= the largest tensor + one shard of it + 16 MiB.

How to run (about a minute on 2 CPU cores; needs ~1.5 GB free in the temp directory):
    .venv/bin/python benchmarks/consolidate_memory.py [--out-dir benchmarks/results] [--no-save] [--keep]
Prints a rich table and, last, one JSON line with every number. Unless --no-save it writes
``<out-dir>/consolidate_memory-cpu-<YYYYmmdd-HHMMSS>.json`` and ``.md`` (numbers, machine, versions,
command, timestamp). The checkpoint and outputs live in a temporary directory, removed at the end
unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from _results import environment, environment_markdown, markdown_table, save_run  # benchmarks/ is sys.path[0]
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

WORLD_SIZE = 2
MIB = 2**20
# peak RSS, and its excess over the baseline run, in MiB and in largest tensors
COLUMNS = ("run", "peak MiB", "+base MiB", "+base/largest", "s", "out MiB", "check")
REPO = Path(__file__).resolve().parent.parent
# name -> shape: 64 MiB + 18 x 16 MiB + biases, fp32
SHAPES: dict[str, tuple[int, ...]] = {
    "embed.weight": (16384, 1024),
    **{f"layers.{i}.weight": (4096, 1024) for i in range(18)},
    **{f"layers.{i}.bias": (4096,) for i in range(18)},
}


class Run(NamedTuple):
    """One measured subprocess."""

    name: str
    command: list[str]
    peak_rss: int  # bytes, the child's ru_maxrss
    seconds: float
    output_bytes: int  # size of the file it wrote; 0 for the baseline


# ---- the checkpoint -----------------------------------------------------------------------------
def full_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def save_rank(rank: int, init_file: str, ckpt_dir: str) -> None:
    torch.set_num_threads(1)  # the two ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("shard",))
        model: dict[str, Any] = {
            name: distribute_tensor(full_tensor(name, shape), mesh, [Shard(0)]) for name, shape in SHAPES.items()
        }
        model["positions"] = distribute_tensor(torch.arange(4096, dtype=torch.int64), mesh, [Replicate()])
        dcp.save({"model": model, "step": 1000}, checkpoint_id=ckpt_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_checkpoint(ckpt_dir: Path) -> None:
    init_file = ckpt_dir.parent / "pg_init"  # FileStore rendezvous: no port to guess
    mp.spawn(save_rank, args=(str(init_file), str(ckpt_dir)), nprocs=WORLD_SIZE, join=True)
    init_file.unlink(missing_ok=True)


# ---- measuring ----------------------------------------------------------------------------------
def measure(name: str, command: list[str], output: Path | None) -> Run:
    """Run ``command`` to completion; its own peak RSS from ``wait4`` (RUSAGE_CHILDREN would be the max
    over every child so far, the checkpoint-saving ranks included)."""
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{log.read().decode(errors='replace')}")
    peak = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024  # Linux reports KiB
    return Run(name, command, peak, seconds, output.stat().st_size if output else 0)


def commands(ckpt: Path, work: Path) -> list[tuple[str, list[str], Path | None]]:
    python, cli = sys.executable, [sys.executable, "-m", "fsdp2lite", "consolidate", str(ckpt)]
    torch_code = (
        "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
    )
    return [
        ("baseline", [python, "-c", "import fsdp2lite.cli, fsdp2lite.checkpoint.consolidate"], None),
        ("pt", [*cli, str(work / "out.pt")], work / "out.pt"),
        ("safetensors", [*cli, str(work / "out.safetensors")], work / "out.safetensors"),
        ("pt --dtype bf16", [*cli, str(work / "bf16.pt"), "--dtype", "bf16"], work / "bf16.pt"),
        ("torch dcp_to_torch_save", [python, "-c", torch_code, str(ckpt), str(work / "torch.pt")], work / "torch.pt"),
    ]


def check_outputs(work: Path) -> dict[str, str]:
    """Every consolidated tensor equals torch's converter's (which keeps the "model." prefix), cast
    to bf16 for the --dtype run."""
    reference = torch.load(work / "torch.pt", weights_only=True, mmap=True)["model"]
    bf16_reference = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in reference.items()}
    results = {}
    loaded = {
        "pt": (torch.load(work / "out.pt", weights_only=True, mmap=True), reference),
        "pt --dtype bf16": (torch.load(work / "bf16.pt", weights_only=True, mmap=True), bf16_reference),
    }
    try:
        from safetensors.torch import load_file
    except ImportError:
        results["safetensors"] = "not checked (pip install safetensors)"
    else:
        loaded["safetensors"] = (load_file(str(work / "out.safetensors")), reference)
    for name, (tensors, expected) in loaded.items():
        same = tensors.keys() == expected.keys() and all(torch.equal(tensors[k], v) for k, v in expected.items())
        results[name] = "equal" if same else "DIFFERENT"
    return results


# ---- report -------------------------------------------------------------------------------------
def checkpoint_numbers(ckpt: Path) -> dict[str, int]:
    full = {name: torch.Size(shape).numel() * 4 for name, shape in SHAPES.items()}
    return {
        "files_bytes": sum(path.stat().st_size for path in ckpt.iterdir()),
        "tensor_bytes": sum(full.values()) + 4096 * 8,
        "largest_tensor_bytes": max(full.values()),
        "tensors": len(full) + 1,
    }


def report(console: Console, ckpt: dict[str, int], runs: list[Run], checks: dict[str, str]) -> list[list[str]]:
    baseline, largest = runs[0].peak_rss, ckpt["largest_tensor_bytes"]
    table = Table(
        title=f"consolidate: checkpoint {ckpt['files_bytes'] / MIB:,.1f} MiB, largest tensor {largest / MIB:.0f} MiB"
    )
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "check") else "right", no_wrap=True)
    rows = []
    for run in runs:
        over = run.peak_rss - baseline
        rows.append(
            [
                run.name,
                f"{run.peak_rss / MIB:,.1f}",
                "" if run is runs[0] else f"{over / MIB:,.1f}",
                "" if run is runs[0] else f"{over / largest:.2f}",
                f"{run.seconds:.1f}",
                f"{run.output_bytes / MIB:,.1f}" if run.output_bytes else "",
                checks.get(run.name, ""),
            ]
        )
        table.add_row(*rows[-1])
    console.print(table)
    return rows


def budget_targets(ckpt: dict[str, int], runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Streaming runs' peak over the baseline within one full tensor + one shard of it + 16 MiB slack
    (DCP reads a shard whole before copying it into the full tensor; the bf16 copy of the full tensor
    is made after that shard is freed, and is smaller than it)."""
    largest = ckpt["largest_tensor_bytes"]
    budget = largest + largest // WORLD_SIZE + 16 * MIB
    return {
        run.name: {
            "over_baseline_bytes": run.peak_rss - runs[0].peak_rss,
            "budget_bytes": budget,
            "pass": run.peak_rss - runs[0].peak_rss <= budget,
        }
        for run in runs
        if run.name in ("pt", "safetensors", "pt --dtype bf16")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoint and outputs")
    args = parser.parse_args()
    started = datetime.datetime.now()
    console = Console(width=max(Console().width, 110))  # the table's 7 columns stay whole in a log
    work = Path(tempfile.mkdtemp(prefix="fsdp2lite_consolidate_"))
    try:
        ckpt_dir = work / "ckpt"
        save_checkpoint(ckpt_dir)
        ckpt = checkpoint_numbers(ckpt_dir)
        runs = [measure(name, command, output) for name, command, output in commands(ckpt_dir, work)]
        checks = check_outputs(work)
    finally:
        if args.keep:
            console.print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = report(console, ckpt, runs, checks)
    targets = budget_targets(ckpt, runs)
    target_lines = [
        f"target {name}: +{t['over_baseline_bytes'] / MIB:.1f} MiB <= budget {t['budget_bytes'] / MIB:.1f} MiB "
        f"{'PASS' if t['pass'] else 'FAIL'}"
        for name, t in targets.items()
    ]
    for line in target_lines:
        console.print(line)
    record: dict[str, Any] = {
        **environment(started),
        "checkpoint": ckpt,
        "baseline_peak_rss_bytes": runs[0].peak_rss,
        "runs": [
            {
                **run._asdict(),
                "over_baseline_bytes": run.peak_rss - runs[0].peak_rss,
                "command": shlex.join(run.command),
            }
            for run in runs
        ],
        "checks": checks,
        "targets": targets,
        "wall_s": round((datetime.datetime.now() - started).total_seconds(), 1),
    }
    if not args.no_save:
        md = (
            f"# consolidate peak memory\n\ncheckpoint: {ckpt['files_bytes']:,} bytes on disk, "
            f"{ckpt['tensors']} tensors ({ckpt['tensor_bytes']:,} bytes), largest tensor "
            f"{ckpt['largest_tensor_bytes']:,} bytes; saved by {WORLD_SIZE} ranks, Shard(0)\n\n"
            + markdown_table(COLUMNS, rows)
            + "\n"
            + "".join(f"- {line}\n" for line in target_lines)
            + "\n"
            + environment_markdown(record)
        )
        stem = f"consolidate_memory-cpu-{started:%Y%m%d-%H%M%S}"
        record["files"] = save_run(args.out_dir, stem, record, md)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
