"""One training step on one CUDA device: fsdp2lite against torch's fully_shard, time and peak memory.

What: ``fsdp2lite.models.GPT`` (untied) is built twice from one seed on the GPU and sharded one group
per block, then the root: once with ``fsdp2lite.fully_shard``, once with torch's
``torch.distributed.fsdp.fully_shard``, same options. A step is forward, loss, backward, AdamW
(foreach) step, zero_grad, timed with ``torch.cuda.synchronize()`` on both sides; steps interleave
(fsdp2lite, torch, torch, fsdp2lite, ...) after warm-up. Per step it also records the peak memory
(``max_memory_allocated`` during the step minus ``memory_allocated`` before it). Each run is either
    real   NCCL, world size 1: real collectives, the same sharding code path as many ranks;
    fake   torch's fake process group, world size N: this GPU is rank 0 of an N-rank job, every shard
           has its real size, collectives return at once (compute plus each runtime's own work).
Reported per run: median step ms and the median of per-step ratios fsdp2lite / torch, median peak
memory and its ratio, tokens/s, first and last loss. Targets (issue 10): step time <= 1.0x torch at
fake world 8 and 64, peak memory <= 1.0x everywhere. ``--profile`` adds a torch.profiler table of
the host (CPU) time per phase (forward, backward, optimizer) and the top host ops, per library.

Why: the GPU is where users train; this is the side-by-side that shows whether the host keeps the
GPU fed and whether backward holds more than torch's.

How to run (a machine with CUDA; about 1 minute per run at the default sizes on an H100):
    python benchmarks/bench_gpu.py [--runs w1,w8,w64] [--dtypes bf16,fp32] [--steps 20] [--warmup 3]
                                   [--profile] [--out-dir benchmarks/results] [--no-save]
Presets (``--runs``), from issue 10:
    w1    real, world 1,  944M GPT: d 2048, 16 layers, seq 2048, batch 4
    w8    fake, world 8,  the same model
    w64   fake, world 64, 1.9B GPT: d 4096, 8 layers, seq 4096, batch 1
    tiny  fake, world 2,  d 256, 4 layers, seq 256, batch 2 (checks the script in seconds)
``bf16``: bf16 parameters, fp32 reduction; ``fp32``: no mixed precision. Prints a rich table per run
and, last, one JSON line; unless ``--no-save`` each run writes
``<out-dir>/gpu-<run>-<dtype>-<YYYYmmdd-HHMMSS>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _results import environment, environment_markdown, markdown_table, save_run
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2lite as fl
from fsdp2lite.models import GPT, GPTConfig

LIBRARIES = ("fsdp2lite", "torch")
MIB = 2**20


@dataclass(frozen=True)
class Run:
    """One preset: the process group, the model and the batch."""

    name: str
    mode: str  # "real" (NCCL) or "fake" (fake process group)
    world_size: int
    model: GPTConfig
    batch: int
    time_limit: float | None  # target for step time fsdp2lite / torch (None: reported only)


def _gpt(d_model: int, layers: int, seq_len: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=32768, seq_len=seq_len, d_model=d_model, n_heads=d_model // 128, n_layers=layers,
        tie_embeddings=False,
    )  # fmt: skip


RUNS: dict[str, Run] = {
    "w1": Run("w1", "real", 1, _gpt(2048, 16, 2048), batch=4, time_limit=None),
    "w8": Run("w8", "fake", 8, _gpt(2048, 16, 2048), batch=4, time_limit=1.0),
    "w64": Run("w64", "fake", 64, _gpt(4096, 8, 4096), batch=1, time_limit=1.0),
    "tiny": Run("tiny", "fake", 2, GPTConfig(1024, 256, 256, 2, 4, False), batch=2, time_limit=None),
}
DTYPES = ("bf16", "fp32")
MEMORY_LIMIT = 1.0


# ---- one process group per run ------------------------------------------------------------------
def init_group(run: Run) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    if run.mode == "real":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=run.world_size)


# ---- models and one step ------------------------------------------------------------------------
def build(library: str, run: Run, dtype: str, mesh: Any) -> tuple[GPT, torch.optim.Optimizer]:
    """The GPT (seed 0) on the GPU, sharded by ``library`` per block then the root."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(run.model)
    if library == "fsdp2lite":
        policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32") if dtype == "bf16" else None
        for block in model.blocks:
            fl.fully_shard(block, mesh, mp_policy=policy)
        fl.fully_shard(model, mesh, mp_policy=policy)
    else:
        kwargs: dict[str, Any] = {"mesh": mesh}
        if dtype == "bf16":
            kwargs["mp_policy"] = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, **kwargs)
        torch_fully_shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def make_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        with torch.profiler.record_function("phase: forward + loss"):
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        with torch.profiler.record_function("phase: backward"):
            loss.backward()
        with torch.profiler.record_function("phase: optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach()

    return step


@dataclass
class StepRecord:
    ms: float
    peak_bytes: int  # max allocated during the step minus allocated before it
    loss: torch.Tensor


def timed(step: Callable[[], torch.Tensor]) -> StepRecord:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start)
    return StepRecord(ms, torch.cuda.max_memory_allocated() - before, loss)


def measure_run(run: Run, dtype: str, warmup: int, steps: int, profile: bool) -> dict[str, Any]:
    init_group(run)
    try:
        mesh = init_device_mesh("cuda", (run.world_size,), mesh_dim_names=("shard",))
        built = {name: build(name, run, dtype, mesh) for name in LIBRARIES}
        gen = torch.Generator(device="cuda").manual_seed(1)
        tokens = torch.randint(
            0, run.model.vocab_size, (run.batch, run.model.seq_len + 1), device="cuda", generator=gen
        )
        step_fns = {name: make_step(model, opt, tokens) for name, (model, opt) in built.items()}
        for _ in range(warmup):
            for step in step_fns.values():
                step()
        records: dict[str, list[StepRecord]] = {name: [] for name in LIBRARIES}
        for index in range(steps):
            for name in LIBRARIES if index % 2 == 0 else reversed(LIBRARIES):
                records[name].append(timed(step_fns[name]))
        persistent = {name: _persistent_bytes(model, opt) for name, (model, opt) in built.items()}
        profiles = {name: host_profile(step) for name, step in step_fns.items()} if profile else {}
        n_params = sum(p.numel() for p in built["torch"][0].parameters())  # DTensors: global numel
    finally:
        dist.destroy_process_group()
    return summarize(run, dtype, warmup, steps, records, persistent, profiles, n_params)


def _persistent_bytes(model: GPT, optimizer: torch.optim.Optimizer) -> int:
    """This rank's sharded parameters and optimizer state on the GPU (what stays between steps)."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [t.to_local() if hasattr(t, "to_local") else t for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)


def host_profile(step: Callable[[], torch.Tensor], steps: int = 2) -> dict[str, Any]:
    """Host (CPU) time per phase and the top host ops over ``steps`` steps, from torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / steps for e in averages if e.key.startswith("phase: ")}
    table = averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    total_self_cpu = sum(e.self_cpu_time_total for e in averages) / 1e3 / steps
    return {"phase_host_ms": phases, "self_cpu_ms_per_step": total_self_cpu, "top_ops": table}


# ---- summaries ----------------------------------------------------------------------------------
def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over step indices of numerator[i] / denominator[i]: adjacent steps cancel drift."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def summarize(
    run: Run,
    dtype: str,
    warmup: int,
    steps: int,
    records: dict[str, list[StepRecord]],
    persistent: dict[str, int],
    profiles: dict[str, Any],
    n_params: int,
) -> dict[str, Any]:
    tokens = run.batch * run.model.seq_len
    libraries = {}
    for name, recs in records.items():
        ms = [r.ms for r in recs]
        libraries[name] = {
            "step_ms_median": statistics.median(ms),
            "step_ms": ms,
            "tokens_per_s": tokens / (statistics.median(ms) / 1e3),
            "peak_transient_mib_median": statistics.median(r.peak_bytes for r in recs) / MIB,
            "peak_transient_mib": [r.peak_bytes / MIB for r in recs],
            "persistent_mib": persistent[name] / MIB,
            "loss_first_last": [float(recs[0].loss), float(recs[-1].loss)],
        }
    ours, theirs = records["fsdp2lite"], records["torch"]
    time_ratio = median_ratio([r.ms for r in ours], [r.ms for r in theirs])
    mem_ratio = median_ratio([float(r.peak_bytes) for r in ours], [float(r.peak_bytes) for r in theirs])
    targets = [{"name": "peak memory fsdp2lite / torch", "value": mem_ratio, "limit": MEMORY_LIMIT}]
    if run.time_limit is not None:
        targets.append({"name": "step time fsdp2lite / torch", "value": time_ratio, "limit": run.time_limit})
    for target in targets:
        target["ok"] = target["value"] <= target["limit"]
    return {
        "run": run.name,
        "mode": run.mode,
        "world_size": run.world_size,
        "dtype": dtype,
        "model_config": dataclasses.asdict(run.model),
        "batch": run.batch,
        "n_params": n_params,
        "warmup": warmup,
        "steps": steps,
        "gpu": torch.cuda.get_device_name(),
        "libraries": libraries,
        "time_ratio": time_ratio,
        "mem_ratio": mem_ratio,
        "targets": targets,
        "profiles": profiles,
    }


COLUMNS = ("library", "step ms", "vs torch", "tokens/s", "peak MiB", "vs torch", "persistent MiB", "loss first/last")


def rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, lib in summary["libraries"].items():
        ours = name == "fsdp2lite"
        out.append([
            name, f"{lib['step_ms_median']:.1f}", f"{summary['time_ratio']:.3f}" if ours else "1.000",
            f"{lib['tokens_per_s']:.0f}", f"{lib['peak_transient_mib_median']:.1f}",
            f"{summary['mem_ratio']:.3f}" if ours else "1.000", f"{lib['persistent_mib']:.1f}",
            "{:.4f} / {:.4f}".format(*lib["loss_first_last"]),
        ])  # fmt: skip
    return out


def title(summary: dict[str, Any]) -> str:
    cfg = summary["model_config"]
    group = "NCCL" if summary["mode"] == "real" else "fake process group"
    return (
        f"{summary['run']}: {group}, world {summary['world_size']}, {summary['gpu']}; GPT "
        f"{summary['n_params'] / 1e6:.0f}M (d {cfg['d_model']}, {cfg['n_layers']} layers, seq {cfg['seq_len']}, "
        f"batch {summary['batch']}), {summary['dtype']}; {summary['steps']} steps after {summary['warmup']} warm-up"
    )


def notes(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"target {'PASS' if t['ok'] else 'FAIL'}: {t['name']} = {t['value']:.3f} (<= {t['limit']})"
        for t in summary["targets"]
    ]
    for name, prof in summary["profiles"].items():
        phases = ", ".join(f"{k.removeprefix('phase: ')} {v:.1f} ms" for k, v in prof["phase_host_ms"].items())
        lines.append(f"{name} host time per step: {phases}; self CPU total {prof['self_cpu_ms_per_step']:.1f} ms")
    return lines


def markdown(summary: dict[str, Any], env: dict[str, Any]) -> str:
    body = f"# bench_gpu: {title(summary)}\n\n" + markdown_table(COLUMNS, rows(summary)) + "\n"
    body += "".join(f"- {line}\n" for line in notes(summary))
    for name, prof in summary["profiles"].items():
        body += f"\n## torch.profiler, {name}, 2 steps, by self CPU time\n\n```\n{prof['top_ops']}\n```\n"
    return body + "\n" + environment_markdown(env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="w1,w8,w64", help=f"comma-separated presets: {', '.join(RUNS)}")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16 (bf16 params, fp32 reduce), fp32")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per library and run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="host time per phase and top host ops")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad_runs = [r for r in args.runs if r not in RUNS]
    if bad_runs or not args.runs:
        parser.error(f"--runs: unknown preset(s) {bad_runs or args.runs}; choose from {', '.join(RUNS)}")
    bad_dtypes = [d for d in args.dtypes if d not in DTYPES]
    if bad_dtypes or not args.dtypes:
        parser.error(f"--dtypes: unknown {bad_dtypes or args.dtypes}; choose from {', '.join(DTYPES)}")
    if args.steps < 2 or args.warmup < 1:
        parser.error(f"--steps ({args.steps}) must be >= 2 and --warmup ({args.warmup}) >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device (see benchmarks/bench_host.py for a CPU-only measure)")
    started = datetime.datetime.now()
    env = environment(started)
    console = Console() if Console().is_terminal else Console(width=180)
    summaries, files = [], []
    for name in args.runs:
        for dtype in args.dtypes:
            summary = measure_run(RUNS[name], dtype, args.warmup, args.steps, args.profile)
            table = Table(title=title(summary))
            for index, column in enumerate(COLUMNS):
                table.add_column(column, justify="left" if index == 0 else "right")
            for row in rows(summary):
                table.add_row(*row)
            console.print(table)
            for line in notes(summary):
                console.print(f"  {line}", highlight=False, markup=False)
            summaries.append(summary)
            if not args.no_save:
                stem = f"gpu-{name}-{dtype}-{started:%Y%m%d-%H%M%S}"
                files += save_run(args.out_dir, stem, {**env, **summary}, markdown(summary, env))
            torch.cuda.empty_cache()
    for path in files:
        console.print(f"wrote {path}", highlight=False)
    slim = [{k: v for k, v in s.items() if k != "profiles"} for s in summaries]
    print(json.dumps({**env, "files": files, "runs": slim}))


if __name__ == "__main__":
    main()
