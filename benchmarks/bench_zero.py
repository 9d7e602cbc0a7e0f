"""ZeRO stages side by side (issue 32): fsdp2lite's sharding strategies against torch's fully_shard.

What: an MLP stack (``--layers`` blocks ``x + Linear(4h, h)(GELU(Linear(h, 4h)(LayerNorm(x))))``, each its own
group, then the root with a 64-way head; AdamW, fp32) built from one seed per strategy, trained on the same batch
per rank, on 4 gloo ranks on CPU (one spawn). fsdp2lite, all through ``fully_shard(m, mesh, sharding=...)``:
ZeRO-3 (1-D mesh of 4, ``ShardingPolicy()``), ZeRO-1/2 (1-D, ``shard="optimizer"``), HSDP (2-D mesh, replicate 2
x shard 2, ``ShardingPolicy()``), HFSDP (2-D, ``replicate="optimizer"``); torch's own ``fully_shard``, the
rivals: torch ZeRO-3 (1-D), torch HSDP (2-D), torch raf=False (1-D, ``reshard_after_forward=False``, torch's
nearest to ZeRO-2). A strategy fsdp2lite refuses with a ValueError saying "not built" (HFSDP until it exists) is
reported as not available in this build; once the policy is accepted, its row is measured with no change here.
Per strategy and rank (the max over ranks): step time (all strategies' steps interleaved after warm-up, a barrier
before each, each step's time the slowest rank's; the median, and the median of per-step ratios against ZeRO-3
and the torch twin); peak (MemTracker's tracked Total over one extra step, ``_meters.tracked_peak``); params
(what the model keeps between steps, ``resident_bytes``); grads (local bytes of the gradients after backward);
optim (local bytes of ``optimizer.state``); bytes sent in one step (a ring's share of each c10d collective, per
mesh axis, ``WireCounter``; ``fl.count_wire_bytes`` counts fsdp2lite's too, as a check); every step's loss
(mean over ranks): equal across strategies, up to reduction order.

Why: what each stage costs and saves at equal losses, on one model, in the same processes.

How to run (about a minute on an idle 2-core machine with the defaults):
    .venv/bin/python benchmarks/bench_zero.py [--steps 6] [--warmup 2] [--hidden 384] [--layers 4] [--batch 32]
                                              [--out-dir benchmarks/results] [--no-save]
Prints a rich table and, last, one JSON line; unless --no-save, writes ``<out-dir>/zero-cpu-<YYYYmmdd-HHMMSS>``
``.json`` (every number, machine, versions, command line) and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from _meters import tracked_peak  # benchmarks/ is sys.path[0] when run as a script
from _results import environment, environment_markdown, finish_run, markdown_table
from bench_step import median_ratio, spawn_and_read
from rich.console import Console
from rich.table import Table
from torch._C._distributed_c10d import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp2lite as fl
from fsdp2lite._spawn import exit_rank_process

WORLD_SIZE = 4
MESH_2D = (2, 2)  # (replicate, shard)
DEVICE = "cpu"
CLASSES = 64  # the head's outputs
MIB, MB = 2**20, 10**6
REFERENCE = "ZeRO-3"  # every row's ratios are against it, and against the row's torch twin
UNAVAILABLE = "not available in this build"
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs (batch, hidden), labels (batch,))


@dataclass(frozen=True)
class Strategy:
    """One way to shard the model."""

    name: str  # row label and JSON key
    library: str  # "fsdp2lite" or "torch"
    mesh: str  # "1d" (shard 4) or "2d" (replicate 2, shard 2)
    sharding: dict[str, str] = field(default_factory=dict)  # fsdp2lite: ShardingPolicy's fields
    reshard_after_forward: bool | None = None  # torch only; None: torch's default (True, the root False)
    twin: str | None = None  # the torch strategy this one is compared with


STRATEGIES = (
    Strategy("ZeRO-3", "fsdp2lite", "1d", twin="torch ZeRO-3"),
    Strategy("ZeRO-1/2", "fsdp2lite", "1d", {"shard": "optimizer"}, twin="torch raf=False"),
    Strategy("HSDP", "fsdp2lite", "2d", twin="torch HSDP"),
    Strategy("HFSDP", "fsdp2lite", "2d", {"replicate": "optimizer"}),
    Strategy("torch ZeRO-3", "torch", "1d"),
    Strategy("torch HSDP", "torch", "2d"),
    Strategy("torch raf=False", "torch", "1d", reshard_after_forward=False),
)


@dataclass(frozen=True)
class Shape:
    """The model and batch every strategy trains."""

    hidden: int  # width h of the residual stream (blocks are h -> 4h -> h)
    layers: int  # blocks, each its own fully_shard group
    batch: int  # rows per rank per step


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))  # (batch, hidden)


class MLPStack(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(shape.hidden) for _ in range(shape.layers))
        self.norm, self.head = nn.LayerNorm(shape.hidden), nn.Linear(shape.hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (batch, CLASSES)


class Run(NamedTuple):
    model: nn.Module  # sharded as its strategy says
    optimizer: torch.optim.Optimizer
    losses: list[float]  # every step's, on this rank


def build(strategy: Strategy, shape: Shape, meshes: dict[str, DeviceMesh]) -> Run:
    """The model (seed 0) sharded as ``strategy``: every block, then the root. fsdp2lite's refusals raise."""
    torch.manual_seed(0)
    model = MLPStack(shape)
    mesh = meshes[strategy.mesh]
    if strategy.library == "fsdp2lite":
        policy = fl.ShardingPolicy(**strategy.sharding)  # type: ignore[arg-type]
        for module in [*model.blocks, model]:
            fl.fully_shard(module, mesh, sharding=policy)
    else:
        for module in [*model.blocks, model]:
            torch_fully_shard(module, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward)
    return Run(model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])


def make_batch(shape: Shape, rank: int) -> Batch:
    """Fixed per rank, the same for every strategy."""
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(shape.batch, shape.hidden, generator=gen)
    return inputs, torch.randint(0, CLASSES, (shape.batch,), generator=gen)


def train_step(run: Run, batch: Batch, after_backward: Callable[[], None] | None = None) -> None:
    """Forward, cross-entropy, backward, ``after_backward()``, optimizer step, zero_grad; the loss kept."""
    loss = nn.functional.cross_entropy(run.model(batch[0]), batch[1])
    loss.backward()
    if after_backward is not None:
        after_backward()
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.losses.append(loss.item())


def prepare_all(shape: Shape, meshes: dict[str, DeviceMesh], batch: Batch) -> tuple[dict[str, Run], dict[str, str]]:
    """Every strategy built and stepped once (its lazy init): (runs, why each missing one is missing). A
    ValueError saying "not built" makes the strategy missing; every rank refuses alike, before any collective."""
    runs: dict[str, Run] = {}
    unavailable: dict[str, str] = {}
    for strategy in STRATEGIES:
        try:
            run = build(strategy, shape, meshes)
            train_step(run, batch)
        except ValueError as exc:  # pydantic's ValidationError is one too
            if "not built" not in str(exc):
                raise
            reason = " ".join(str(exc).split()).split(" [type=")[0]  # pydantic's error code and link: noise here
            unavailable[strategy.name] = f"{type(exc).__name__}: {reason}"[:400]
            continue
        runs[strategy.name] = run
    return runs, unavailable


def local_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree``, of a DTensor its local tensor's."""
    leaves, _ = tree_flatten(tree)
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in leaves if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _process_group(func: Any, args: tuple[Any, ...]) -> ProcessGroup:
    """The process group a c10d op runs over: the first of its arguments that is one."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(arg)
            except RuntimeError:  # another bound object (a ReduceOp)
                continue
    raise RuntimeError(f"{func._schema.name}: expected a ProcessGroup among its arguments, found none")


class WireCounter(TorchDispatchMode):
    """Bytes this rank sends per c10d collective, as a ring sends them, keyed ``"all_gather over shard(2)"``
    (``axes``: group name -> mesh axis). Worked example, 4 ranks, a 16-byte shard each: an all-gather's output is
    64 bytes, each rank sends the other 3 ranks' share around the ring, 48; a reduce-scatter of a 64-byte input
    sends 48; an all-reduce of 64 bytes is both, 96 (``fl.count_wire_bytes``'s arithmetic). Waits, barriers: 0."""

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__()
        self.axes = axes
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = func._schema.name  # e.g. "c10d::_allgather_base_"
        if name.startswith("c10d::") and "wait" not in name and "barrier" not in name:
            group = _process_group(func, args)
            kind, sent = self._ring_share(name, args, group.size())
            key = f"{kind} over {self.axes.get(group.group_name, 'group')}({group.size()})"
            self.sent[key] += sent
            self.calls[key] += 1
        return result

    @staticmethod
    def _ring_share(name: str, args: tuple[Any, ...], size: int) -> tuple[str, int]:
        if "allgather" in name:
            return "all_gather", local_bytes(args[0]) * (size - 1) // size  # args[0]: the output
        if "reduce_scatter" in name:
            return "reduce_scatter", local_bytes(args[1]) * (size - 1) // size  # args[1]: the input
        if "allreduce" in name:
            return "all_reduce", 2 * (local_bytes(args[0]) * (size - 1) // size)
        if "alltoall" in name:
            return "all_to_all", local_bytes(args[1]) * (size - 1) // size
        return name.removeprefix("c10d::"), local_bytes(args[0])


def resident_bytes(root: object) -> int:
    """Bytes of the distinct CPU storages reachable from ``root`` through ``gc``'s referents (not through classes,
    modules or functions: their globals reach everything). From a model between steps: its parameters as it keeps
    them, with their padding, any buffer its runtime keeps, and the mesh's few bytes of rank layout."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        kind = type(obj)  # not isinstance(): a deprecated module attribute warns when its __class__ is read
        if id(obj) in seen or issubclass(kind, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if issubclass(kind, torch.Tensor) and not issubclass(kind, DTensor) and obj.device.type == "cpu":  # type: ignore[attr-defined]
            storage = obj.untyped_storage()  # type: ignore[attr-defined]
            storages[storage.data_ptr()] = storage.nbytes()  # 0 once freed (resized to nothing)
        stack.extend(gc.get_referents(obj))  # a DTensor's hold its local tensor
    return sum(storages.values())


def time_interleaved(runs: dict[str, Run], batch: Batch, warmup: int, steps: int) -> torch.Tensor:
    """Seconds (run, step) on this rank, after ``warmup`` steps; step i of every run in turn."""
    times = torch.zeros(len(runs), steps, dtype=torch.float64)
    for step in range(-warmup, steps):
        for index, run in enumerate(runs.values()):
            dist.barrier()  # every rank starts the step together
            start = time.perf_counter()
            train_step(run, batch)
            if step >= 0:
                times[index, step] = time.perf_counter() - start
    return times


def count_sent(run: Run, batch: Batch, library: str, axes: dict[str, str]) -> dict[str, Any]:
    """One step under ``WireCounter`` (and ``fl.count_wire_bytes`` for fsdp2lite), and its gradient bytes."""
    seen: dict[str, int] = {}

    def after_backward() -> None:
        seen["grads"] = local_bytes([p.grad for group in run.optimizer.param_groups for p in group["params"]])

    own_counter = fl.count_wire_bytes(run.model) if library == "fsdp2lite" else nullcontext(None)
    with WireCounter(axes) as counter, own_counter as own:
        train_step(run, batch, after_backward)
    own_count = dict(own) if own is not None else None
    return {"sent": dict(counter.sent), "calls": dict(counter.calls), "own_count": own_count, "grads": seen["grads"]}


METRICS = ("peak", "params", "grads", "optim", "sent", "calls")  # per run, max over ranks


def measure_rank(rank: int, shape: Shape, warmup: int, steps: int) -> dict[str, Any]:
    """Every measurement as this rank saw it, reduced over the ranks (times and metrics max, losses mean)."""
    meshes = {
        "1d": init_device_mesh(DEVICE, (WORLD_SIZE,), mesh_dim_names=("shard",)),
        "2d": init_device_mesh(DEVICE, MESH_2D, mesh_dim_names=("replicate", "shard")),
    }
    batch = make_batch(shape, rank)
    runs, unavailable = prepare_all(shape, meshes, batch)
    times = time_interleaved(runs, batch, warmup - 1, steps)  # prepare_all took the first warm-up step
    axes = {
        str(mesh.get_group(axis).group_name): axis for mesh in meshes.values() for axis in mesh.mesh_dim_names or ()
    }
    library = {s.name: s.library for s in STRATEGIES}
    kept, peaks, sent = {}, {}, {}
    for name, run in runs.items():
        kept[name] = (resident_bytes(run.model), local_bytes(list(run.optimizer.state.values())))  # between steps
        peaks[name] = tracked_peak(partial(train_step, run, batch), run.model, run.optimizer)
        sent[name] = count_sent(run, batch, library[name], axes)
    metrics = torch.tensor(
        [[peaks[n]["Total"], kept[n][0], sent[n]["grads"], kept[n][1], sum(sent[n]["sent"].values()),
          sum(sent[n]["calls"].values())] for n in runs],
        dtype=torch.float64,
    )  # fmt: skip  # (run, METRICS)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    dist.all_reduce(metrics, op=dist.ReduceOp.MAX)  # per-rank bytes: the largest rank's
    losses = torch.tensor([run.losses for run in runs.values()], dtype=torch.float64)  # (run, step)
    dist.all_reduce(losses)
    return {
        "n_params": sum(p.numel() for p in MLPStack(shape).parameters()),
        "unavailable": unavailable,
        "step_s": {name: times[i].tolist() for i, name in enumerate(runs)},
        "losses": {name: (losses[i] / WORLD_SIZE).tolist() for i, name in enumerate(runs)},
        "metrics": {name: dict(zip(METRICS, metrics[i].tolist())) for i, name in enumerate(runs)},
        "rank0": {name: {"peak_bytes": peaks[name], **sent[name]} for name in runs},
    }


def _rank_entry(rank: int, out_file: str, init_file: str, shape: Shape, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)  # 4 ranks on a few cores: one thread each
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    result = measure_rank(rank, shape, warmup, steps)
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))
    dist.barrier()  # rank 0's file is written before any rank leaves
    dist.destroy_process_group()
    exit_rank_process()  # no interpreter finalization after gloo ([Note: rank exit] in fsdp2lite/_spawn.py)


def run_ranks(shape: Shape, warmup: int, steps: int) -> dict[str, Any]:
    """One spawn of 4 gloo ranks (rendezvous through a temporary file); rank 0's reduced result."""
    with tempfile.TemporaryDirectory() as tmp:
        return spawn_and_read(_rank_entry, WORLD_SIZE, (str(Path(tmp) / "pg"), shape, warmup, steps))


def summarize_row(strategy: Strategy, result: dict[str, Any]) -> dict[str, Any]:
    """One strategy's numbers (MiB for memory, MB for bytes sent) and its ratios against fsdp2lite ZeRO-3
    and its torch twin: step time as the median of per-step ratios, peak memory as a plain ratio."""
    row = {"library": strategy.library, "mesh": strategy.mesh, "sharding": strategy.sharding,
           "reshard_after_forward": strategy.reshard_after_forward, "twin": strategy.twin}  # fmt: skip
    if strategy.name in result["unavailable"]:
        return {**row, "available": False, "reason": result["unavailable"][strategy.name]}
    times, metrics, rank0 = result["step_s"], result["metrics"], result["rank0"][strategy.name]
    losses, reference = result["losses"][strategy.name], result["losses"][REFERENCE]
    name, mine, twin = strategy.name, metrics[strategy.name], strategy.twin
    return {
        **row, "available": True,
        "step_ms_median": 1e3 * statistics.median(times[name]), "step_ms": [1e3 * t for t in times[name]],
        "step_vs_zero3": median_ratio(times[name], times[REFERENCE]),
        "step_vs_twin": median_ratio(times[name], times[twin]) if twin else None,
        "peak_mib": mine["peak"] / MIB, "peak_vs_zero3": mine["peak"] / metrics[REFERENCE]["peak"],
        "peak_vs_twin": mine["peak"] / metrics[twin]["peak"] if twin else None,
        **{f"{key}_mib": mine[key] / MIB for key in ("params", "grads", "optim")},
        "sent_mb": mine["sent"] / MB, "collectives": int(mine["calls"]),
        "rank0_sent_mb_by_kind": {kind: sent / MB for kind, sent in sorted(rank0["sent"].items())},
        "rank0_own_count_mb": sum(rank0["own_count"].values()) / MB if rank0["own_count"] is not None else None,
        "rank0_peak_mib_by_category": {category: b / MIB for category, b in rank0["peak_bytes"].items()},
        "losses": losses, "max_loss_diff_vs_zero3": max(abs(a - b) for a, b in zip(losses, reference, strict=True)),
    }  # fmt: skip


def summarize(result: dict[str, Any], shape: Shape, warmup: int, steps: int, load: float) -> dict[str, Any]:
    return {
        "shape": asdict(shape), "n_params": result["n_params"], "full_model_mib": result["n_params"] * 4 / MIB,
        "world_size": WORLD_SIZE, "mesh_2d": MESH_2D, "backend": "gloo", "device": DEVICE, "warmup": warmup,
        "steps": steps, "load_average_at_start": load,  # well above 0: the machine was shared
        "strategies": {s.name: summarize_row(s, result) for s in STRATEGIES},
    }  # fmt: skip


COLUMNS = (
    "strategy", "mesh", "step ms", "vs ZeRO-3", "vs twin", "peak MiB", "peak vs ZeRO-3", "peak vs twin",
    "params MiB", "grads MiB", "optim MiB", "MB sent", "colls", "last loss", "max dloss vs ZeRO-3",
)  # fmt: skip


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, row in summary["strategies"].items():
        mesh = "4" if row["mesh"] == "1d" else "x".join(map(str, MESH_2D))
        if not row["available"]:
            rows.append([name, mesh, UNAVAILABLE, *["-"] * (len(COLUMNS) - 3)])
            continue
        rows.append([
            name, mesh, _fmt(row["step_ms_median"], 1), _fmt(row["step_vs_zero3"]), _fmt(row["step_vs_twin"]),
            _fmt(row["peak_mib"], 2), _fmt(row["peak_vs_zero3"]), _fmt(row["peak_vs_twin"]),
            _fmt(row["params_mib"], 2), _fmt(row["grads_mib"], 2), _fmt(row["optim_mib"], 2),
            _fmt(row["sent_mb"], 2), str(row["collectives"]), f"{row['losses'][-1]:.6f}",
            f"{row['max_loss_diff_vs_zero3']:.1e}",
        ])  # fmt: skip
    return rows


def notes(summary: dict[str, Any]) -> list[str]:
    """The lines under the table: twins, sizes, bytes sent by kind (with fsdp2lite's own count), missing rows."""
    strategies = summary["strategies"]
    twins = ", ".join(f"{name} <-> {row['twin']}" for name, row in strategies.items() if row["twin"])
    lines = [
        f"twins: {twins}; torch raf=False is torch's fully_shard(reshard_after_forward=False), its nearest to ZeRO-2",
        f"full model {summary['n_params'] / 1e6:.2f}M params, {summary['full_model_mib']:.2f} MiB in fp32; per-rank "
        f"numbers are the max over the {summary['world_size']} ranks; load average at start "
        f"{summary['load_average_at_start']:.2f}",
    ]
    for name, row in strategies.items():
        if not row["available"]:
            lines.append(f"{name}: {UNAVAILABLE} ({row['reason']})")
            continue
        by_kind = row["rank0_sent_mb_by_kind"]
        line = f"{name} sends (rank 0, MB): " + ", ".join(f"{kind} {mb:.2f}" for kind, mb in by_kind.items())
        if row["rank0_own_count_mb"] is not None:
            same = abs(sum(by_kind.values()) - row["rank0_own_count_mb"]) < 1e-6
            line += f"; fl.count_wire_bytes {'agrees' if same else 'DISAGREES'}: {row['rank0_own_count_mb']:.2f}"
        lines.append(line)
    return lines


def title(summary: dict[str, Any]) -> str:
    shape = summary["shape"]
    return (
        f"ZeRO stages: MLP stack h={shape['hidden']} x {shape['layers']} blocks ({summary['n_params'] / 1e6:.2f}M "
        f"params), batch {shape['batch']} per rank, {summary['world_size']} gloo ranks, 2-D meshes "
        f"{MESH_2D[0]}x{MESH_2D[1]} (replicate, shard), {summary['steps']} steps after {summary['warmup']} warm-up"
    )


def render(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=title(summary))
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index < 2 else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    console.print(table)
    for line in notes(summary):
        console.print(f"  {line}", highlight=False, markup=False)


def markdown(summary: dict[str, Any], env: dict[str, Any]) -> str:
    bullets = "".join(f"- {line}\n" for line in notes(summary))
    return (
        f"# bench_zero on {summary['device']}\n\n{title(summary)}; AdamW fp32, every block its own group, then "
        "the root. Step time ratios are medians of per-step ratios; peak is MemTracker's Total over one step; "
        "params what the model keeps between steps; MB sent a ring's share of each collective.\n\n"
        f"{markdown_table(COLUMNS, table_rows(summary))}\n{bullets}\n{environment_markdown(env)}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per strategy")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (the first builds lazily)")
    parser.add_argument("--hidden", type=int, default=384, help="width of the residual stream")
    parser.add_argument("--layers", type=int, default=4, help="blocks, each its own fully_shard group")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true", help="print only, write no files")
    args = parser.parse_args(argv)
    for flag in ("steps", "warmup", "hidden", "layers", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started, start = datetime.datetime.now(), time.perf_counter()
    console = Console() if Console().is_terminal else Console(width=200)  # piped or logged: one line per row
    env, load = environment(started), os.getloadavg()[0]  # the code that runs and the machine's load, before the run
    shape = Shape(args.hidden, args.layers, args.batch)
    with console.status(f"{WORLD_SIZE} gloo ranks, {len(STRATEGIES)} strategies, {args.warmup} + {args.steps} steps"):
        result = run_ranks(shape, args.warmup, args.steps)
    summary = summarize(result, shape, args.warmup, args.steps, load)
    render(console, summary)
    stem = None if args.no_save else f"zero-{DEVICE}-{started:%Y%m%d-%H%M%S}"
    return finish_run(console, args.out_dir, stem, env, summary, markdown(summary, env), start)


if __name__ == "__main__":
    main()
