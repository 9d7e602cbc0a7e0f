"""One training step of fsdp2lite against torch's fully_shard and DDP: time, peak memory, collectives.

What: a small GPT (``fsdp2lite.models.GPT``) is built three times from the same seed and wrapped as
    fsdp2lite  ``fsdp2lite.models.shard_gpt`` (``fully_shard`` per block, then the root),
    torch      torch's FSDP2 ``torch.distributed.fsdp.fully_shard``, per block then the root,
    ddp        ``torch.nn.parallel.DistributedDataParallel``,
and trained with AdamW in fp32 on the same batch per rank. One run of 2 gloo ranks on CPU (spawned
here, one thread each) measures, per model:
    1. step time: warm-up steps, then N steps interleaved step by step (step i of each model in
       turn, a barrier before each); a step's time is the max over ranks (all_reduce MAX);
       reported as the median, and as the median of per-step ratios against torch and DDP;
    2. peak memory of one extra step under torch's ``MemTracker``, by category (MiB), as the
       category breakdown at the moment the Total peaked;
    3. collectives of one extra step under a ``TorchDispatchMode`` that sees every c10d op: calls,
       and bytes of the collective's full-size buffer (see ``CollectiveCounter``).
A second, single process repeats the timing with torch's fake process group (world size 2, no
communication at all): compute plus runtime overhead, with communication taken out.

Why: the targets in benchmarks/README.md (step time and peak memory against torch's fully_shard,
collectives never more than torch's), measured in the same processes so the machine's drift cancels.

How to run (about 4-5 minutes on 2 CPU cores with the defaults):
    .venv/bin/python benchmarks/bench_step.py [--config gpt|params|both] [--steps N] [--warmup N]
                                              [--out-dir benchmarks/results] [--no-save]
                                              [--overlap-reduce-scatter auto|true|false]
                                              [--late-backward-prefetch auto|true|false]
The last two set fsdp2lite's root schedule (``auto``: the device's default); a run with a non-auto
value is a variant, named in its file names (``params-overlap_reduce_scatter=true-cpu-...``).
Prints a rich table per config and, last, one JSON line with every number. Unless --no-save, each
config writes ``<out-dir>/<config>-cpu-<YYYYmmdd-HHMMSS>.json`` (all numbers, machine, versions,
command line, timestamp) and a short ``.md`` next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _meters import count_collectives, tracked_peak  # benchmarks/ is sys.path[0] when run as a script
from _ranks import start_ranks
from _results import environment, environment_markdown, markdown_table, save_run
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

from fsdp2lite.config import ScheduleConfig
from fsdp2lite.models import GPT, GPTConfig, shard_gpt

WORLD_SIZE = 2
DEVICE = "cpu"  # gloo on CPU only: the file names and the tables say so
MODELS = ("fsdp2lite", "torch", "ddp")
MEM_CATEGORIES = ("Parameter", "Gradient", "Activation", "Temp", "Optstate", "Total")
RUNTIME_CATEGORIES = ("Parameter", "Gradient", "Temp")  # the runtime's own bytes (DESIGN.md section 5)
MIB = 2**20
MB = 10**6


@dataclass(frozen=True)
class BenchConfig:
    """One model shape and batch to benchmark."""

    name: str  # --config value and file name prefix
    model: GPTConfig  # the GPT every model is built from
    batch: int  # sequences per rank per step
    steps: int  # measured steps when --steps is not given
    about: str  # one line for the table title
    schedule: tuple[tuple[str, bool], ...] = ()  # fsdp2lite root settings, e.g. (("overlap_reduce_scatter", True),)


CONFIGS: dict[str, BenchConfig] = {
    "gpt": BenchConfig(
        "gpt",
        GPTConfig(vocab_size=8192, seq_len=256, d_model=512, n_heads=8, n_layers=4, tie_embeddings=True),
        batch=4,
        steps=8,  # ~11 s per step index for the three models on 2 cores: keeps the default run ~5 min
        about="compute-heavy GPT, 17M params, 1024 tokens per rank",
    ),
    "params": BenchConfig(
        "params",
        GPTConfig(vocab_size=1024, seq_len=64, d_model=1024, n_heads=8, n_layers=4, tie_embeddings=True),
        batch=1,
        steps=10,
        about="parameter-heavy GPT, 52M params, 64 tokens per rank: the runtime's buffers dominate",
    ),
}


@dataclass(frozen=True)
class Target:
    """A pass/fail line of benchmarks/README.md: ``ratio <= limit``."""

    name: str  # what is compared, e.g. "step time fsdp2lite / torch"
    key: str  # the entry of the config's "ratios" it reads
    limit: float


TARGETS: dict[str, tuple[Target, ...]] = {
    "gpt": (
        Target("step time fsdp2lite / torch", "step_fsdp2lite_vs_torch", 1.0),
        Target("peak memory (Total) fsdp2lite / torch", "peak_total_fsdp2lite_vs_torch", 1.0),
        Target("collectives per step fsdp2lite / torch", "collectives_fsdp2lite_vs_torch", 1.0),
    ),
    "params": (
        Target("peak memory (Total) fsdp2lite / torch", "peak_total_fsdp2lite_vs_torch", 0.9),
        Target("collectives per step fsdp2lite / torch", "collectives_fsdp2lite_vs_torch", 1.0),
    ),
}


@dataclass
class Run:
    """A model ready to train: the wrapped module and its optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer


# ---------------------------------------------------------------------------------------------
# Models, data, one step
# ---------------------------------------------------------------------------------------------


def build(kind: str, bench: BenchConfig) -> Run:
    """The same GPT (seed 0) wrapped as ``kind``, with AdamW over its (possibly sharded) parameters."""
    torch.manual_seed(0)
    model: nn.Module = GPT(bench.model)
    if kind == "fsdp2lite":
        shard_gpt(model)  # type: ignore[arg-type]
        ScheduleConfig.model_validate(dict(bench.schedule)).apply_to(model)
    elif kind == "torch":
        # a CPU mesh: without one, torch's fully_shard picks CUDA wherever it is present
        mesh = init_device_mesh(DEVICE, (dist.get_world_size(),), mesh_dim_names=("shard",))
        for block in model.blocks:  # type: ignore[union-attr]
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = DistributedDataParallel(model)
    else:
        raise ValueError(f"model kind {kind!r} is not one of {MODELS}")
    return Run(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def make_batch(bench: BenchConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (batch, seq_len) int64: fixed per rank, shared by the three models."""
    gen = torch.Generator().manual_seed(1000 + rank)
    cfg = bench.model
    data = torch.randint(0, cfg.vocab_size, (bench.batch, cfg.seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def train_step(run: Run, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Forward, backward, optimizer step, zero_grad."""
    tokens, targets = batch
    logits = run.model(tokens)  # (batch, seq, vocab); DDP only hooks forward, so no .loss()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    run.optimizer.step()
    run.optimizer.zero_grad()


# ---------------------------------------------------------------------------------------------
# The three measurements
# ---------------------------------------------------------------------------------------------


def time_interleaved(
    runs: dict[str, Run], batch: tuple[torch.Tensor, torch.Tensor], warmup: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per step and model, step i of every model in turn; each the max over ranks."""
    for _ in range(warmup):
        for run in runs.values():
            train_step(run, batch)
    times = torch.zeros(len(runs), steps, dtype=torch.float64)  # (model, step)
    for step in range(steps):
        for index, run in enumerate(runs.values()):
            dist.barrier()  # every rank starts the timed step together
            start = time.perf_counter()
            train_step(run, batch)
            times[index, step] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return {name: times[index].tolist() for index, name in enumerate(runs)}


# ---------------------------------------------------------------------------------------------
# Processes: 2 gloo ranks, and 1 process on the fake process group
# ---------------------------------------------------------------------------------------------


def measure_gloo(rank: int, bench: BenchConfig, warmup: int, steps: int) -> dict[str, Any]:
    """Everything the gloo run measures, as this rank saw it (times are already max over ranks)."""
    batch = make_batch(bench, rank)
    runs = {kind: build(kind, bench) for kind in MODELS}
    times = time_interleaved(runs, batch, warmup, steps)
    memory = {
        kind: tracked_peak(partial(train_step, run, batch), run.model, run.optimizer) for kind, run in runs.items()
    }
    comms = {kind: count_collectives(partial(train_step, run, batch)) for kind, run in runs.items()}
    n_params = sum(p.numel() for p in runs["ddp"].model.parameters())
    return {
        "n_params": n_params,
        "step_s": times,
        "peak_bytes": memory,
        "collectives": {kind: dict(stats.calls) for kind, stats in comms.items()},
        "collective_bytes": {kind: dict(stats.nbytes) for kind, stats in comms.items()},
    }


def measure_fake(bench: BenchConfig, warmup: int, steps: int) -> dict[str, Any]:
    """Step times on the fake process group; a model that fails to build or step is reported, not raised."""
    batch = make_batch(bench, rank=0)
    runs: dict[str, Run] = {}
    errors: dict[str, str] = {}
    for kind in MODELS:
        try:
            run = build(kind, bench)
            train_step(run, batch)  # the first step is where lazy init and most failures happen
            runs[kind] = run
        except Exception as exc:  # reported in the table and the JSON, the other models go on
            errors[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    times = time_interleaved(runs, batch, max(warmup - 1, 0), steps) if runs else {}
    return {"step_s": times, "errors": errors}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload))


def _gloo_entry(rank: int, out_file: str, init_file: str, bench: BenchConfig, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one thread each, no oversubscription
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        result = measure_gloo(rank, bench, warmup, steps)
        if rank == 0:
            _write_json(out_file, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fake_entry(_: int, out_file: str, bench: BenchConfig, warmup: int, steps: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)  # as one gloo rank
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        _write_json(out_file, measure_fake(bench, warmup, steps))
    finally:
        dist.destroy_process_group()


def _temp_path(prefix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.unlink(path)  # FileStore and the result writer want a path they create
    return path


def spawn_and_read(entry: Callable[..., None], nprocs: int, args: tuple[Any, ...]) -> dict[str, Any]:
    """Run ``entry(rank, out_file, *args)`` in ``nprocs`` new processes (``start_ranks``); rank 0's JSON result."""
    out_file = _temp_path("fsdp2lite_bench_out_")
    try:
        start_ranks(entry, nprocs, (out_file, *args))
        return json.loads(Path(out_file).read_text())
    finally:
        if os.path.exists(out_file):
            os.unlink(out_file)


def run_gloo(bench: BenchConfig, warmup: int, steps: int) -> dict[str, Any]:
    init_file = _temp_path("fsdp2lite_bench_pg_")
    try:
        return spawn_and_read(_gloo_entry, WORLD_SIZE, (init_file, bench, warmup, steps))
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def run_fake(bench: BenchConfig, warmup: int, steps: int) -> dict[str, Any]:
    """The fake-PG timing; a crash of the whole process becomes an error on every model."""
    try:
        return spawn_and_read(_fake_entry, 1, (bench, warmup, steps))
    except Exception as exc:  # reported, the gloo numbers still stand
        message = f"fake-PG process failed: {type(exc).__name__}: {traceback.format_exception_only(exc)[-1]}"
        return {"step_s": {}, "errors": {kind: message.strip()[:300] for kind in MODELS}}


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over step indices of numerator[i] / denominator[i]: adjacent steps cancel drift."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarize_model(kind: str, gloo: dict[str, Any], fake: dict[str, Any]) -> dict[str, Any]:
    """One model's row: milliseconds, MiB, collectives and MB per step."""
    times = gloo["step_s"][kind]
    fake_times = fake["step_s"].get(kind)
    peak = gloo["peak_bytes"][kind]
    calls = gloo["collectives"][kind]
    return {
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms": [1e3 * t for t in times],
        "step_ratio_vs_torch": median_ratio(times, gloo["step_s"]["torch"]),
        "peak_mib": {category: peak.get(category, 0) / MIB for category in MEM_CATEGORIES},
        "peak_mib_all_categories": {category: nbytes / MIB for category, nbytes in peak.items()},
        "peak_runtime_mib": sum(peak.get(category, 0) for category in RUNTIME_CATEGORIES) / MIB,
        "collectives_per_step": sum(calls.values()),
        "collectives_by_op": calls,
        "mb_per_step": sum(gloo["collective_bytes"][kind].values()) / MB,
        "fake_pg_step_ms_median": 1e3 * statistics.median(fake_times) if fake_times else None,
        "fake_pg_error": fake["errors"].get(kind),
    }


def summarize_ratios(models: dict[str, dict[str, Any]], gloo: dict[str, Any], fake: dict[str, Any]) -> dict[str, Any]:
    """fsdp2lite against torch (and DDP): per-step medians for time, plain ratios for the rest."""
    ours, theirs = models["fsdp2lite"], models["torch"]
    fake_steps = fake["step_s"]
    fake_ratio = None
    if "fsdp2lite" in fake_steps and "torch" in fake_steps:
        fake_ratio = median_ratio(fake_steps["fsdp2lite"], fake_steps["torch"])
    return {
        "step_fsdp2lite_vs_torch": ours["step_ratio_vs_torch"],
        "step_fsdp2lite_vs_ddp": median_ratio(gloo["step_s"]["fsdp2lite"], gloo["step_s"]["ddp"]),
        "peak_total_fsdp2lite_vs_torch": _ratio(ours["peak_mib"]["Total"], theirs["peak_mib"]["Total"]),
        "peak_runtime_fsdp2lite_vs_torch": _ratio(ours["peak_runtime_mib"], theirs["peak_runtime_mib"]),
        "collectives_fsdp2lite_vs_torch": _ratio(ours["collectives_per_step"], theirs["collectives_per_step"]),
        "mb_fsdp2lite_vs_torch": _ratio(ours["mb_per_step"], theirs["mb_per_step"]),
        "fake_pg_step_fsdp2lite_vs_torch": fake_ratio,
    }


def summarize(
    bench: BenchConfig, gloo: dict[str, Any], fake: dict[str, Any], warmup: int, steps: int
) -> dict[str, Any]:
    models = {kind: summarize_model(kind, gloo, fake) for kind in MODELS}
    ratios = summarize_ratios(models, gloo, fake)
    targets = [
        {
            "name": t.name,
            "value": ratios[t.key],
            "limit": t.limit,
            "ok": ratios[t.key] is not None and ratios[t.key] <= t.limit,
        }
        for t in TARGETS[bench.name]
    ]
    return {
        "config": bench.name,
        "about": bench.about,
        "fsdp2lite_schedule": dict(bench.schedule),  # empty: the device's defaults
        "model_config": dataclasses.asdict(bench.model),
        "batch_per_rank": bench.batch,
        "n_params": gloo["n_params"],
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "device": DEVICE,
        "warmup": warmup,
        "steps": steps,
        "models": models,
        "ratios": ratios,
        "targets": targets,
    }


# ---------------------------------------------------------------------------------------------
# Output: table, files, environment
# ---------------------------------------------------------------------------------------------

COLUMNS = (
    "model", "step ms", "vs torch", "peak MiB", "Param", "Grad", "Act", "Temp", "Opt",
    "coll/step", "MB/step", "fake-PG ms",
)  # fmt: skip


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for kind, m in summary["models"].items():
        fake = f"{m['fake_pg_step_ms_median']:.1f}" if m["fake_pg_step_ms_median"] is not None else "skipped"
        peak = m["peak_mib"]
        rows.append([
            kind, f"{m['step_ms_median']:.1f}", f"{m['step_ratio_vs_torch']:.3f}", f"{peak['Total']:.1f}",
            *(f"{peak[c]:.1f}" for c in MEM_CATEGORIES[:-1]),
            str(m["collectives_per_step"]), f"{m['mb_per_step']:.1f}", fake,
        ])  # fmt: skip
    return rows


def notes(summary: dict[str, Any]) -> list[str]:
    """Ratio and target lines printed under the table (and into the .md)."""
    r = summary["ratios"]

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        f"fsdp2lite/torch: step {fmt(r['step_fsdp2lite_vs_torch'])} (median of per-step ratios), "
        f"peak Total {fmt(r['peak_total_fsdp2lite_vs_torch'])}, runtime bytes (Param+Grad+Temp) "
        f"{fmt(r['peak_runtime_fsdp2lite_vs_torch'])}, collectives {fmt(r['collectives_fsdp2lite_vs_torch'])}, "
        f"MB {fmt(r['mb_fsdp2lite_vs_torch'])}, fake-PG step {fmt(r['fake_pg_step_fsdp2lite_vs_torch'])}",
        f"fsdp2lite/ddp: step {fmt(r['step_fsdp2lite_vs_ddp'])}",
    ]
    lines += [
        f"fake-PG skipped {kind}: {m['fake_pg_error']}" for kind, m in summary["models"].items() if m["fake_pg_error"]
    ]
    lines += [
        f"target {'PASS' if t['ok'] else 'FAIL'}: {t['name']} = {fmt(t['value'])} (<= {t['limit']})"
        for t in summary["targets"]
    ]
    return lines


def render(console: Console, summary: dict[str, Any]) -> None:
    schedule = ", ".join(f"{k}={v}" for k, v in summary["fsdp2lite_schedule"].items()) or "default schedule"
    table = Table(
        title=f"{summary['config']} (fsdp2lite: {schedule}): {summary['about']} "
        f"({summary['n_params'] / 1e6:.1f}M params, {summary['world_size']} gloo ranks, "
        f"{summary['steps']} steps after {summary['warmup']} warm-up)"
    )
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    console.print(table)
    for line in notes(summary):
        console.print(f"  {line}", highlight=False, markup=False)


def markdown(summary: dict[str, Any], env: dict[str, Any]) -> str:
    return (
        f"# bench_step: {summary['config']} on {summary['device']}\n\n"
        f"fsdp2lite schedule: {summary['fsdp2lite_schedule'] or 'the device defaults'}\n\n"
        f"{summary['about']}; {summary['n_params'] / 1e6:.1f}M params, batch {summary['batch_per_rank']} per rank, "
        f"{summary['world_size']} gloo ranks, {summary['steps']} measured steps after {summary['warmup']} warm-up.\n\n"
        + markdown_table(COLUMNS, table_rows(summary))
        + "\n"
        + "".join(f"- {line}\n" for line in notes(summary))
        + "\n"
        + environment_markdown(env)
    )


def save(out_dir: Path, summary: dict[str, Any], env: dict[str, Any], started: datetime.datetime) -> list[str]:
    variant = ",".join(f"{key}={str(value).lower()}" for key, value in summary["fsdp2lite_schedule"].items())
    stem = f"{summary['config']}{'-' + variant if variant else ''}-{DEVICE}-{started:%Y%m%d-%H%M%S}"
    return save_run(out_dir, stem, {**env, **summary}, markdown(summary, env))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("gpt", "params", "both"), default="both")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default: per config, 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps before the measured ones")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true", help="print only, write no files")
    for key in SCHEDULE_KEYS:
        parser.add_argument(
            f"--{key.replace('_', '-')}",
            choices=("auto", "true", "false"),
            default="auto",
            help=f"fsdp2lite's set_{key} on the root (auto: the device's default)",
        )
    args = parser.parse_args(argv)
    if args.warmup < 1 or (args.steps is not None and args.steps < 1):
        parser.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be >= 1")
    return args


SCHEDULE_KEYS = ("overlap_reduce_scatter", "late_backward_prefetch")


def schedule_from(args: argparse.Namespace) -> tuple[tuple[str, bool], ...]:
    return tuple((key, getattr(args, key) == "true") for key in SCHEDULE_KEYS if getattr(args, key) != "auto")


def bench_one(console: Console, bench: BenchConfig, warmup: int, steps: int) -> dict[str, Any]:
    with console.status(f"{bench.name}: {WORLD_SIZE} gloo ranks, {warmup} + {steps} interleaved steps per model"):
        gloo = run_gloo(bench, warmup, steps)
    with console.status(f"{bench.name}: fake process group, 1 process"):
        fake = run_fake(bench, warmup, steps)
    return summarize(bench, gloo, fake, warmup, steps)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now()
    start = time.perf_counter()
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or logged: keep the table on one line per row
    env = environment(started)
    names = ("gpt", "params") if args.config == "both" else (args.config,)
    summaries, files = {}, []
    for name in names:
        bench = dataclasses.replace(CONFIGS[name], schedule=schedule_from(args))
        summary = bench_one(console, bench, args.warmup, args.steps or bench.steps)
        render(console, summary)
        summaries[name] = summary
        if not args.no_save:
            files += save(args.out_dir, summary, env, started)
    wall_s = time.perf_counter() - start
    for path in files:
        console.print(f"wrote {path}", highlight=False)
    print(json.dumps({**env, "wall_s": round(wall_s, 1), "files": files, "configs": summaries}))


if __name__ == "__main__":
    main()
