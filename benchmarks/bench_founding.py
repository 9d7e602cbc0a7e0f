"""The founding job measured beside the planner: Llama-3-70B QLoRA (LoRA r 16 on the seven projections, batch 1,
the configs ``fsdp2lite estimate --budget`` writes) as rank 0 of torch's fake process group.

What: for each planner setting (reshard after forward, forward prefetch depth, activation checkpointing, CPU
offload), the peak bytes a real training step allocates, beside ``estimate_memory(method="analytic")``'s figure
for the same model and config (what ``estimate --budget`` prints for that row):
- on CPU (the default without a GPU): Llama-3-70B's true width at reduced depth (``--depths``, default 2 and 3
  decoder layers), real torchao NF4 bytes held by fsdp2lite's ``NF4Rows``, real peft adapters, counted through
  the CPU allocator ([Note: live allocator bytes] in _founding.py); the run stands for the GPU's (the CUDA
  target's schedule defaults and reduction, the dequantization's compiled kernel: ``FSDP2LITE_NF4_KERNEL``).
  Each depth beside the planner's figure for that depth, and the two extrapolated per layer to the whole
  model's 80 beside the planner's figure for it.
- on CUDA (``--device cuda``): the whole model, every shard its real size, with the caching allocator capped at
  ``--budget`` less the CUDA context measured here (a 24 GiB card): peak allocated and reserved, the
  forward's and backward's, and the microbatch time, beside the planner's.

Why: the planner's answer is the product's central promise; a GPU contradicted it once (issue 51). This is the
check that a memory claim is measured, not modelled.

How to run (CPU: about 25 minutes on 2 cores at the defaults; ``--seq 512`` about 8):
    .venv/bin/python benchmarks/bench_founding.py [--world 4] [--seq 2048] [--depths 2,3] [--rows chosen]
    python benchmarks/bench_founding.py --device cuda --world 4 --budget 24GiB   # on a GPU (scripts/gpu_checks.sh):
                                                    # the config estimate --budget writes for this GPU, measured
Writes ``results/founding-<device>-<YYYYmmdd-HHMMSS>.{json,md}``; ``--no-save`` prints only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _founding import StepMemory, build, fake_group, gib, llama_config, measure_job, per_layer
from _results import environment, environment_markdown, finish_run, markdown_table
from rich.console import Console

import fsdp2lite as fl
from fsdp2lite.cli.estimate_search import config_for_setting
from fsdp2lite.estimate import default_config

LLAMA_3_70B = {"hidden": 8192, "intermediate": 28672, "layers": 80, "heads": 64, "kv_heads": 8, "vocab": 128256}
BASE = {"finetune": "qlora", "mixed_precision": "bf16", "optimizer_state": "host", "nvme_path": None}
ROWS: dict[str, dict[str, Any]] = {  # the budget search's settings for qlora (estimate_search.SEARCH)
    "chosen": {"reshard_after_forward": True, "forward_prefetch_depth": 1, "activation_checkpointing": True},
    "prefetch0": {"reshard_after_forward": True, "forward_prefetch_depth": 0, "activation_checkpointing": True},
    "keep": {"reshard_after_forward": False, "forward_prefetch_depth": 1, "activation_checkpointing": True},
    "no-ckpt": {"reshard_after_forward": True, "forward_prefetch_depth": 1, "activation_checkpointing": False},
    "offload": {"reshard_after_forward": True, "forward_prefetch_depth": 1, "activation_checkpointing": True},
}
OFFLOADED = {"offload"}  # rows with every group's shards on the host


def settings(row: str) -> dict[str, Any]:
    offload = row in OFFLOADED
    return {**BASE, **ROWS[row], "offload": offload, "offload_groups": "all" if offload else None}


def job_config(hf_config: Any, row: str) -> fl.FSDPConfig:
    """The config ``estimate --budget --write-config`` writes for ``row`` on this model."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return config_for_setting(default_config(model), settings(row))


def planned(hf_config: Any, config: fl.FSDPConfig, world: int, seq: int) -> fl.MemoryEstimate:
    """The planner's figure for this model and config (the budget search's method)."""
    import transformers

    return fl.estimate_memory(
        lambda: transformers.AutoModelForCausalLM.from_config(hf_config), config, world_size=world, batch=1,
        seq=seq, finetune="qlora", method="analytic", device="cuda",
    )  # fmt: skip


def measure(
    hf_config: Any, config: fl.FSDPConfig, world: int, seq: int, device: torch.device
) -> tuple[StepMemory, int]:
    offloaded = config.offload.device == "cpu"
    with fake_group(world):
        return measure_job(
            lambda: build(hf_config, "qlora", config, world, device), seq, 1, hf_config.vocab_size, device,
            host_resident=offloaded and device.type == "cpu",
        )  # fmt: skip


def cpu_rows(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """Each row at each depth, measured and planned, and extrapolated to the whole model."""
    os.environ.setdefault("FSDP2LITE_NF4_KERNEL", "compiled")  # the GPU's dequantization: no temporaries
    shape = dict(LLAMA_3_70B)
    out = []
    for row in args.rows:
        measured: dict[int, float] = {}
        entry: dict[str, Any] = {"row": row, "settings": settings(row), "depths": {}}
        for depth in args.depths:
            hf_config = llama_config(**{**shape, "layers": depth})
            config = job_config(hf_config, row)
            started = time.perf_counter()
            memory, built = measure(hf_config, config, args.world, args.seq, torch.device("cpu"))
            estimate = planned(hf_config, config, args.world, args.seq)
            measured[depth] = memory.peak
            entry["depths"][depth] = {
                "measured_peak": memory.peak, "phase": memory.phase, "peaks": memory.peaks, "built": built,
                "planned_peak": estimate.peak_bytes, "planned_phase": estimate.phase, "planned_group": estimate.group,
                "ratio": round(estimate.peak_bytes / memory.peak, 4), "seconds": round(time.perf_counter() - started),
            }  # fmt: skip
            console.print(f"{row} depth {depth}: measured {gib(memory.peak)} GiB ({memory.phase}), planned "
                          f"{gib(estimate.peak_bytes)} GiB ({estimate.phase} {estimate.group})")  # fmt: skip
        whole = llama_config(**shape)
        estimate = planned(whole, job_config(whole, row), args.world, args.seq)
        extrapolated = per_layer(measured, shape["layers"])
        entry.update(
            extrapolated_peak=int(extrapolated), planned_peak=estimate.peak_bytes,
            planned_reserved=estimate.reserved_bytes, ratio=round(estimate.peak_bytes / extrapolated, 4),
        )  # fmt: skip
        out.append(entry)
    return out


def written_config(world: int, budget: int, out_dir: Path) -> fl.FSDPConfig:
    """The config ``fsdp2lite estimate --budget --write-config`` writes for the founding job on this GPU."""
    from fsdp2lite.cli import main as cli

    name = torch.cuda.get_device_name().lower()
    gpu = next((kind for kind in ("h200", "h100", "a100", "rtx4090") if kind.replace("rtx", "") in name), "h100")
    path = out_dir / f"founding-written-w{world}.yaml"
    argv = ["estimate", "--model", "llama-3-70b", "--world-size", str(world), "--budget", f"{budget}B"]
    code = cli([*argv, "--finetune", "qlora", "--gpu", gpu, "--write-config", str(path)])
    if code != 0:
        raise SystemExit(f"fsdp2lite estimate found nothing that fits {budget} bytes at world {world} (exit {code})")
    return fl.FSDPConfig.from_yaml(path)


def cuda_rows(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """The whole model on this GPU, capped at the budget less the context, each row beside the planner's
    (``written``: the config the budget search writes)."""
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()  # the driver's and libraries' share, not PyTorch's
    cap = args.budget - context
    torch.cuda.set_per_process_memory_fraction(cap / total)
    whole = llama_config(**LLAMA_3_70B)
    out = []
    for row in args.rows:
        config = written_config(args.world, args.budget, args.out_dir) if row == "written" else job_config(whole, row)
        estimate = planned(whole, config, args.world, args.seq)
        entry: dict[str, Any] = {"row": row, "context": context, "cap": cap}
        entry["settings"] = config.model_dump(mode="json") if row == "written" else settings(row)
        entry.update(planned_peak=estimate.peak_bytes, planned_reserved=estimate.reserved_bytes)
        started = time.perf_counter()
        try:
            memory, built = measure(whole, config, args.world, args.seq, torch.device("cuda"))
        except torch.OutOfMemoryError as exc:
            entry.update(fits=False, oom=str(exc)[:300], peak_allocated=torch.cuda.max_memory_allocated())
        else:
            entry.update(
                fits=True, built=built, peaks=memory.peaks, reserved=memory.reserved,
                peak_allocated=memory.peak, peak_reserved=max(memory.reserved.values()),
                ratio=round(estimate.peak_bytes / memory.peak, 4), step_s=memory.step_s,
            )  # fmt: skip
        entry["seconds"] = round(time.perf_counter() - started)
        console.print(f"{row}: {entry}")
        out.append(entry)
        torch.cuda.empty_cache()
    return out


def markdown(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    head = (
        f"# The founding job: Llama-3-70B QLoRA, rank 0 of {args.world}, batch 1 x seq {args.seq}, on {args.device}\n\n"
        + environment_markdown(env)
        + "\n"
    )
    if args.device == "cuda":
        columns = ("row", "fits", "peak allocated GiB", "peak reserved GiB", "planned GiB", "planned / measured")
        table = [
            [r["row"], str(r["fits"]), f"{gib(r['peak_allocated'])}", f"{gib(r.get('peak_reserved', 0))}",
             f"{gib(r['planned_peak'])}", str(r.get("ratio", "-"))]
            for r in rows
        ]  # fmt: skip
        return head + markdown_table(columns, table)
    columns = ("row", *(f"depth {d}: measured / planned GiB" for d in args.depths), "80 layers: extrapolated",
               "planned", "planned / extrapolated")  # fmt: skip
    table = []
    for r in rows:
        cells = [f"{gib(r['depths'][d]['measured_peak'])} / {gib(r['depths'][d]['planned_peak'])}" for d in args.depths]
        table.append([r["row"], *cells, f"{gib(r['extrapolated_peak'])}", f"{gib(r['planned_peak'])}", str(r["ratio"])])
    return head + markdown_table(columns, table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=4, help="ranks the job is sharded over (this is rank 0)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--depths", default="2,3", help="CPU: the decoder layers measured (two or more)")
    parser.add_argument(
        "--rows", default=None, help=f"settings: {', '.join(ROWS)}; CUDA also written (default: chosen,prefetch0 on "
        "CPU, written on CUDA)",
    )  # fmt: skip
    parser.add_argument("--budget", default="24GiB", help="CUDA: the card's memory (the cap is this less the context)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    args.depths = sorted({int(d) for d in args.depths.split(",")})
    args.rows = (args.rows or ("written" if args.device == "cuda" else "chosen,prefetch0")).split(",")
    unknown = [row for row in args.rows if row not in ROWS and not (row == "written" and args.device == "cuda")]
    if unknown or len(args.depths) < 2:
        parser.error(
            f"--rows {unknown} unknown (valid: {', '.join(ROWS)})" if unknown else "--depths needs two or more"
        )
    from fsdp2lite._units import parse_size

    args.budget = parse_size(args.budget)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    started, start = datetime.datetime.now(), time.perf_counter()
    torch.set_flush_denormal(True)  # the uninitialised bytes made small: no denormal slow paths on CPU
    rows = cuda_rows(args, console) if args.device == "cuda" else cpu_rows(args, console)
    env = environment(started)
    summary = {"world": args.world, "seq": args.seq, "depths": args.depths, "rows": rows, "device": args.device}
    stem = None if args.no_save else f"founding-{args.device}-{started:%Y%m%d-%H%M%S}"
    finish_run(console, args.out_dir, stem, env, summary, markdown(env, args, rows), start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
