"""CPU offload's host step (issue 33): fsdp2lite's CPUOffloadPolicy with fast_host_step(AdamW) against torch's
fully_shard with torch's CPUOffloadPolicy and AdamW as torch picks it.

What: a GPT (``fsdp2lite.models.GPT``, by default vocab 8192, seq 64, d_model 512, 8 heads, 4 layers, tied
embeddings: 16.8M parameters; one sequence per rank, so that the forward and backward, which run on the same
cores here but on a GPU in an offloaded job, do not drown the host step) built from one seed per run, every
block its own group, then the root, trained with AdamW (lr 1e-4, fp32) on the same batch per rank (different
per rank), on gloo ranks on CPU (one spawn, one thread per rank). The sharded parameters, their gradients and
AdamW's state live on the host in every run:
    fsdp2lite + fast_host_step  ``fl.fully_shard(m, mesh, offload_policy=fl.CPUOffloadPolicy(pin_memory=False))``,
                                ``fast_host_step(AdamW)``: torch's fused CPU kernel, one call per step
    torch                       ``torch.distributed.fsdp.fully_shard(m, mesh=mesh, offload_policy=
                                CPUOffloadPolicy(pin_memory=False))``, ``AdamW`` as constructed: torch picks the
                                per-parameter for-loop for CPU tensors (foreach is for CUDA). The rival.
    fsdp2lite + AdamW           fsdp2lite with the rival's step: the runtime's share apart from the step's
    torch + fast_host_step      the rival's runtime with the fused step: the step's share apart from the runtime's
    fsdp2lite + step_in_backward  ``step_in_backward(model, lambda ps: fast_host_step(AdamW(ps)), overlap=True)``:
                                each group stepped inside backward as its reduced gradients land, its gradients
                                freed at once, on a host thread while backward goes on
    ... , overlap off           the same with ``overlap=False``: each step in backward's own thread
Per run and step, after warm-up, step i of every run in turn, a barrier before each, each time the slowest rank's:
the whole step (forward, loss, backward, ``optimizer.step()``, ``zero_grad()``) and the host step
(``optimizer.step()`` alone). Reported: medians, and medians of per-step ratios against torch (adjacent steps cancel
the machine's drift); the aten ops one ``optimizer.step()`` dispatches on rank 0 (counted, not timed: the for-loop's
per-parameter ops against the fused kernel's one); the bytes of gradient shards alive after backward (the largest
rank's: step_in_backward has stepped and freed them all); for step_in_backward, its host steps in that metered step and
the part of them backward's thread spent (stepping, or waiting for the host-step thread), from a trace of it (rank 0's,
``fl.record_trace``); every step's loss (mean over ranks) and its largest difference
from torch's (the fused and the for-loop step round differently: below 1e-6 on a loss near 9 at the start).

Fake-world half (``--device cuda``, or ``--fake-world`` on CPU: the same code without a GPU): one process, rank 0
of a fake process group of ``--world-size`` (default 8; ``torch.testing._internal.distributed.fake_pg``), the model
built on the device, every shard with its real size for that world offloaded to host memory: pinned on a GPU
(``fl.CPUOffloadPolicy(pin_memory=True)`` against torch's ``CPUOffloadPolicy(pin_memory=True)``), pageable on CPU;
bf16 parameters and fp32 reduction (``MixedPrecisionPolicy`` on both); the same six runs, the rival's AdamW with
``foreach=True``. On cuda the defaults are the H100 evidence run's GPT (gpu-2026-11-24, "340M (4 layers)": d 2048, 4
layers, 16 heads, vocab 32768, untied, seq 2048, batch 4). Per run and step, interleaved as above, with
``torch.cuda.synchronize()`` before each step and before its clock stops: the whole step and ``optimizer.step()``
(host work: both runtimes have the gradients on the host when backward returns); the ops and gradient bytes as
above, rank 0's. The fake group's collectives move no data, so the losses are garbage: not reported, not compared
([Note: bench_offload on a fake process group] in _offload_fake.py).

Why: issue 33's target, the host step at most 0.5x torch's, and what it does to the whole step, in one run; on a GPU,
what it does to a step whose forward and backward are off the host.
step_in_backward has no host step of its own to time (its steps are inside backward): its step time says what it
costs, its gradient bytes what it saves.

How to run (about 40 s on a 2-core machine with the defaults; the GPU half about 1 minute on an H100):
    .venv/bin/python benchmarks/bench_offload.py [--steps 10] [--warmup 2] [--world-size 2] [--layers 4]
        [--d-model 512] [--heads 8] [--vocab 8192] [--seq-len 64] [--batch 1]
        [--out-dir benchmarks/results] [--no-save]
    python benchmarks/bench_offload.py --device cuda [--steps 10] [--world-size 8] [...]   # a CUDA machine
    .venv/bin/python benchmarks/bench_offload.py --fake-world [--world-size 8] [...]      # its code path on CPU
Prints a rich table and, last, one JSON line; unless --no-save, writes ``<out-dir>/offload-cpu-<YYYYmmdd-HHMMSS>``
``.json`` (every number, machine, versions, command line) and ``.md`` (fake world: ``offload-<device>-fake<N>-...``).
Do not launch it with torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _offload_fake import measure_fake  # benchmarks/ is sys.path[0] when run as a script
from _offload_runs import LR, MAIN, RIVAL, SETUPS, Setup, build, extra_step, group_flags, rank0_metered
from _offload_runs import Run as Run  # bench_offload_memory.py imports these three from here
from _offload_runs import make_batch as make_batch
from _offload_runs import time_interleaved as time_interleaved
from _results import environment, environment_markdown, finish_run, gpt_title, markdown_table
from bench_step import median_ratio, spawn_and_read
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh

from fsdp2lite._spawn import exit_rank_process
from fsdp2lite.models import GPT, GPTConfig

TARGET = 0.5  # issue 33: host step fsdp2lite + fast_host_step / torch
MIB = 2**20
DEFAULTS = {  # per --device: the model, sequences per rank, world size; cuda: the H100 evidence run's 340M GPT
    "cpu": {"layers": 4, "d_model": 512, "heads": 8, "vocab": 8192, "seq_len": 64, "batch": 1, "tie": True},
    "cuda": {"layers": 4, "d_model": 2048, "heads": 16, "vocab": 32768, "seq_len": 2048, "batch": 4, "tie": False},
}


def measure_rank(
    rank: int, world_size: int, config: GPTConfig, batch_size: int, warmup: int, steps: int
) -> dict[str, Any]:
    """Every run built, timed interleaved, then one metered step each; times and bytes max, losses mean over the
    ranks."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    batch = make_batch(config, batch_size, rank)
    runs = [build(setup, config, mesh) for setup in SETUPS]
    times = time_interleaved(runs, batch, warmup, steps)
    metered = [extra_step(run, batch) for run in runs]
    largest_grads = torch.tensor([m.grad_bytes for m in metered], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    dist.all_reduce(largest_grads, op=dist.ReduceOp.MAX)  # the largest rank's
    losses = torch.tensor([run.losses for run in runs], dtype=torch.float64)  # (run, step)
    dist.all_reduce(losses)
    return {
        "n_params": sum(p.numel() for p in GPT(config).parameters()),
        "step_s": {s.name: times[i, :, 0].tolist() for i, s in enumerate(SETUPS)},
        "host_step_s": {s.name: times[i, :, 1].tolist() for i, s in enumerate(SETUPS)},
        "losses": {s.name: (losses[i] / world_size).tolist() for i, s in enumerate(SETUPS)},
        **rank0_metered(metered),
        "grad_bytes_after_backward": {s.name: largest_grads[i].item() for i, s in enumerate(SETUPS)},
        "param_groups": {s.name: group_flags(run.optimizers) for s, run in zip(SETUPS, runs)},
    }


def _rank_entry(
    rank: int, out_file: str, init_file: str, world_size: int, config: GPTConfig, batch: int, warmup: int, steps: int
) -> None:
    torch.set_num_threads(1)  # ranks share the cores: one thread each
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result = measure_rank(rank, world_size, config, batch, warmup, steps)
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))
    dist.barrier()  # rank 0's file is written before any rank leaves
    dist.destroy_process_group()
    exit_rank_process()  # no interpreter finalization after gloo ([Note: rank exit] in fsdp2lite/_spawn.py)


def run_ranks(world_size: int, config: GPTConfig, batch: int, warmup: int, steps: int) -> dict[str, Any]:
    """One spawn of ``world_size`` gloo ranks (rendezvous through a temporary file); rank 0's reduced result."""
    with tempfile.TemporaryDirectory() as tmp:
        args = (str(Path(tmp) / "pg"), world_size, config, batch, warmup, steps)
        return spawn_and_read(_rank_entry, world_size, args)


def summarize_row(setup: Setup, result: dict[str, Any]) -> dict[str, Any]:
    """One run's numbers (ms, MiB) and its time ratios against torch (medians of per-step ratios). Host-step fields
    are None for step_in_backward (its steps are inside backward)."""
    whole, host = result["step_s"][setup.name], result["host_step_s"][setup.name]
    losses = result["losses"][setup.name] if result["losses"] else None  # None: fake collectives, garbage values
    rival = result["losses"][RIVAL] if result["losses"] else None
    ops = result["rank0_step_ops"][setup.name]
    after = not setup.in_backward
    return {
        "library": setup.library, "step": setup.step, "param_groups": result["param_groups"][setup.name],
        "step_ms_median": 1e3 * statistics.median(whole), "step_ms": [1e3 * t for t in whole],
        "step_vs_torch": median_ratio(whole, result["step_s"][RIVAL]),
        "host_step_ms_median": 1e3 * statistics.median(host) if after else None,
        "host_step_ms": [1e3 * t for t in host] if after else None,
        "host_step_vs_torch": median_ratio(host, result["host_step_s"][RIVAL]) if after else None,
        "host_share_of_step": statistics.median(h / w for h, w in zip(host, whole, strict=True)) if after else None,
        "rank0_ops_per_host_step": sum(ops.values()) if ops else None,
        "rank0_fused_adamw_calls": ops.get("aten::_fused_adamw_", 0) if ops else None,
        "grads_mib_after_backward": result["grad_bytes_after_backward"][setup.name] / MIB,
        **_traced(result["rank0_traced_host_s"][setup.name]),
        "losses": losses, "max_loss_diff_vs_torch": _max_diff(losses, rival),
    }  # fmt: skip


def _traced(seconds: list[float | None]) -> dict[str, float | None]:
    """step_in_backward's metered step, from its trace (rank 0): host steps, and the part backward's thread spent."""
    host, exposed = seconds
    return {
        "traced_host_step_ms": None if host is None else 1e3 * host,
        "traced_host_exposed_ms": None if exposed is None else 1e3 * exposed,
    }


def _max_diff(losses: list[float] | None, rival: list[float] | None) -> float | None:
    if losses is None or rival is None:
        return None
    return max(abs(a - b) for a, b in zip(losses, rival, strict=True))


def summarize(result: dict[str, Any], args: argparse.Namespace, config: GPTConfig, load: float) -> dict[str, Any]:
    rows = {setup.name: summarize_row(setup, result) for setup in SETUPS}
    host_ratio, step_ratio = rows[MAIN]["host_step_vs_torch"], rows[MAIN]["step_vs_torch"]
    return {
        "model": asdict(config), "n_params": result["n_params"], "batch_per_rank": args.batch,
        "world_size": args.world_size, "backend": "fake" if args.fake_world else "gloo", "device": args.device,
        "optimizer": f"AdamW lr {LR}, fp32" + ("; the loop rows foreach=True" if args.fake_world else ""),
        **(_fake_fields(result, args) if args.fake_world else {}),
        "warmup": args.warmup, "steps": args.steps, "load_average_at_start": load,  # well above 0: a shared machine
        "runs": rows, "host_step_ratio": host_ratio, "step_ratio": step_ratio,
        "target": {"what": f"host step {MAIN} / {RIVAL} <= {TARGET}", "value": host_ratio, "ok": host_ratio <= TARGET},
    }  # fmt: skip


def _fake_fields(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """What only the fake-world half has ([Note: bench_offload on a fake process group] in _offload_fake.py)."""
    return {
        "precision": "bf16 parameters, fp32 reduction, fp32 masters and AdamW state on the host",
        "pin_memory": args.device == "cuda", "losses_reported": False,  # fake collectives: garbage values
        **{key: result[key] for key in ("gpu", "host_threads", "denormals_flushed")},
    }  # fmt: skip


COLUMNS = (
    "run", "step ms", "vs torch", "host step ms", "vs torch", "host share", "ops/step", "grads MiB", "last loss",
    "max dloss",
)  # fmt: skip


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    return [
        [
            name, _fmt(row["step_ms_median"], 1), _fmt(row["step_vs_torch"], 3), _fmt(row["host_step_ms_median"], 2),
            _fmt(row["host_step_vs_torch"], 3), _fmt(row["host_share_of_step"], 3),
            "-" if row["rank0_ops_per_host_step"] is None else str(row["rank0_ops_per_host_step"]),
            _fmt(row["grads_mib_after_backward"], 2), _fmt(row["losses"][-1] if row["losses"] else None, 6),
            "-" if row["max_loss_diff_vs_torch"] is None else f"{row['max_loss_diff_vs_torch']:.1e}",
        ]
        for name, row in summary["runs"].items()
    ]  # fmt: skip


def _ranks(summary: dict[str, Any]) -> str:
    if summary["backend"] == "gloo":
        return f"{summary['world_size']} gloo ranks"
    where = summary["gpu"] or "CPU"
    return f"rank 0 of a fake group of {summary['world_size']} on {where}, {summary['precision']}"


def title(summary: dict[str, Any]) -> str:
    return (
        f"CPU offload host step: {gpt_title(summary)}, {_ranks(summary)}, {summary['steps']} steps after "
        f"{summary['warmup']} warm-up"
    )


def notes(summary: dict[str, Any]) -> list[str]:
    target = summary["target"]
    groups = "; ".join(f"{name}: {row['param_groups']}" for name, row in summary["runs"].items())
    return [
        f"host step {MAIN} / {RIVAL}: {summary['host_step_ratio']:.3f}x; whole step: {summary['step_ratio']:.3f}x "
        "(medians of per-step ratios)",
        f"target {target['what']}: {'PASS' if target['ok'] else 'FAIL'} ({target['value']:.3f})",
        "host share: optimizer.step() / whole step (median); ops/step: aten ops one optimizer.step() dispatches on "
        "rank 0 (a DTensor op counts once); grads MiB: gradient shards alive after backward, the largest rank's; "
        "max dloss: largest |loss - torch's loss| over the steps; step_in_backward steps inside backward, so its "
        "host step is part of its step time",
        *_traced_notes(summary),
        f"param groups (params, fused, foreach): {groups}",
        f"load average at start {summary['load_average_at_start']:.2f}",
    ] + (fake_notes(summary) if summary["backend"] == "fake" else [])


def _traced_notes(summary: dict[str, Any]) -> list[str]:
    traced = [
        f"{name}: {row['traced_host_step_ms']:.2f} ms, backward's thread spent {row['traced_host_exposed_ms']:.2f}"
        for name, row in summary["runs"].items()
        if row["traced_host_step_ms"] is not None
    ]
    return ["host steps inside backward (one metered step, traced, rank 0): " + "; ".join(traced)] if traced else []


def fake_notes(summary: dict[str, Any]) -> list[str]:
    sync = "torch.cuda.synchronize() before each step and before its clock stops; " if summary["gpu"] else ""
    return [
        f"fake process group: its collectives move no data, so the losses are garbage and not reported (nor "
        f"compared); times and bytes are rank 0's of {summary['world_size']}, communication left out; {sync}"
        f"host threads {summary['host_threads']}, denormals flushed: {summary['denormals_flushed']}",
    ]


def render(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=title(summary))
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    console.print(table)
    for line in notes(summary):
        console.print(f"  {line}", highlight=False, markup=False)


def markdown(summary: dict[str, Any], env: dict[str, Any]) -> str:
    bullets = "".join(f"- {line}\n" for line in notes(summary))
    return (
        f"# bench_offload on {summary['device']}\n\n{title(summary)}; {summary['optimizer']}; parameters, gradients "
        "and optimizer state on the host in every run. Times are the slowest rank's (fake group: rank 0's); ratios "
        f"are medians of per-step ratios against torch.\n\n{markdown_table(COLUMNS, table_rows(summary))}\n{bullets}\n"
        f"{environment_markdown(env)}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=tuple(DEFAULTS), default="cpu", help="cuda: the fake-world half on a GPU")
    parser.add_argument("--fake-world", action="store_true", help="one process, rank 0 of a fake group (cuda: always)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (lazy init, state allocation)")
    parser.add_argument("--world-size", type=int, help="gloo ranks, one thread each (default 2); fake world (8)")
    parser.add_argument("--layers", type=int, help="GPT blocks, each its own group (default 4)")
    parser.add_argument("--d-model", type=int, help="model width (default cpu 512, cuda 2048)")
    parser.add_argument("--heads", type=int, help="attention heads, d-model a multiple (default cpu 8, cuda 16)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default cpu 8192, tied; cuda 32768, untied)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default cpu 64, cuda 2048)")
    parser.add_argument("--batch", type=int, help="sequences per rank per step (default cpu 1, cuda 4)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true", help="print only, write no files")
    args = parser.parse_args(argv)
    args.fake_world = args.fake_world or args.device == "cuda"
    for flag, value in {**DEFAULTS[args.device], "world_size": 8 if args.fake_world else 2}.items():
        if getattr(args, flag, None) is None:
            setattr(args, flag, value)
    for flag in ("steps", "warmup", "layers", "d_model", "heads", "vocab", "seq_len", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2 (sharded across ranks), got {args.world_size}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    return args


def measure(args: argparse.Namespace, config: GPTConfig, console: Console) -> dict[str, Any]:
    """The gloo half (a spawn of ranks) or the fake-world half (this process)."""
    what = f"{len(SETUPS)} runs, {args.warmup} + {args.steps} steps"
    if not args.fake_world:
        with console.status(f"{args.world_size} gloo ranks, {what}"):
            return run_ranks(args.world_size, config, args.batch, args.warmup, args.steps)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_offload.py --device cuda needs a CUDA device (--fake-world runs it on CPU)")
    with console.status(f"rank 0 of a fake group of {args.world_size} on {args.device}, {what}"):
        return measure_fake(args.device, args.world_size, config, args.batch, args.warmup, args.steps)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started, start = datetime.datetime.now(), time.perf_counter()
    console = Console() if Console().is_terminal else Console(width=200)  # piped or logged: one line per row
    env, load = environment(started), os.getloadavg()[0]  # the code that runs and the machine's load, before the run
    config = GPTConfig(args.vocab, args.seq_len, args.d_model, args.heads, args.layers, tie_embeddings=args.tie)
    result = measure(args, config, console)
    summary = summarize(result, args, config, load)
    render(console, summary)
    fake = f"-fake{args.world_size}" if args.fake_world else ""
    stem = None if args.no_save else f"offload-{args.device}{fake}-{started:%Y%m%d-%H%M%S}"
    return finish_run(console, args.out_dir, stem, env, summary, markdown(summary, env), start)


if __name__ == "__main__":
    main()
