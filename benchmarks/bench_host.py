"""Host (Python) time per training step: fsdp2lite against torch's fully_shard, with no compute at all.

What: the same GPT (``fsdp2lite.models.GPT``, 16 blocks by default, untied) is built twice from one seed
under ``FakeTensorMode`` and sharded one group per block, then the root, with bf16 parameters and fp32
gradient reduction: once with ``fsdp2lite.fully_shard``, once with torch's
``torch.distributed.fsdp.fully_shard``. The process is rank 0 of a world of ``--world-size`` ranks on
torch's fake process group (``FakeStore``, backend ``"fake"``), so every shard has its real size but no
collective moves data, and fake tensors run no kernels: what a step costs is the runtime's own host
work plus the (identical) dispatch of the model's ops. That is the time that, on a GPU, decides
whether the host keeps the GPU fed. Steps are forward, loss, backward, AdamW step, zero_grad,
interleaved (fsdp2lite, torch, torch, fsdp2lite, ...) after warm-up; reported: the median host ms per
step of each, the median of per-step ratios fsdp2lite / torch (the target is <= 0.9), and the aten ops
each library dispatches in one step (``_meters.OpCounter``: noise-free, the same on every machine).
A third model, the same GPT unsharded in fp32 with no FSDP at all, steps in the same interleaving: the floor
(``ratio_unsharded_vs_torch``), what the model's own forward, backward and AdamW cost here, so a ratio reads
against what any runtime could reach (issue 43: fsdp2lite 0.77, the floor 0.55).

Why: issue 10. On an H100 fsdp2lite spent about 2x torch's host time per step and left the GPU idle;
this measures the same gap on any machine, without a GPU.

How to run (about 1-2 minutes on 2 CPU cores with the defaults):
    .venv/bin/python benchmarks/bench_host.py [--world-size 8] [--layers 16] [--d-model 256]
        [--seq-len 256] [--batch 2] [--steps 12] [--warmup 3] [--device cpu|cuda]
        [--profile] [--op-times] [--bound] [--out-dir benchmarks/results] [--no-save]
``--device cuda`` (on a machine with CUDA) makes the fake tensors CUDA tensors, so fsdp2lite runs its
CUDA path (side streams, events) with nothing computed. ``--profile`` adds, per library, cProfile's
top functions by cumulative time over a few more steps; ``--op-times`` a table of the op kinds fsdp2lite
spends the most host time in beyond the unsharded floor's (ms and calls per step: where the rest of the gap
is); ``--bound`` times fsdp2lite's collectives alone, after the main timing, interleaved with torch's step and
the floor's: each group's all-gather as the runtime does it (``unshard()`` then ``reshard()``, in the order
one step issues them), which dispatches the ops the tests pin per unshard (``tests/test_copy_out_views.py``:
``empty``, ``slice``, ``cat``, the all-gather, ``view``, ``split_with_sizes_copy``) and nothing else, then
each of the step's reduce-scatters as the bare collective; the floor plus those over torch's step is the best
ratio a runtime keeping them could reach here. Prints a rich table and, last, one JSON line; unless
``--no-save``, writes ``<out-dir>/host-<device>-<YYYYmmdd-HHMMSS>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _meters import count_ops, time_ops
from _results import environment, environment_markdown, markdown_table, save_run
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2lite as fl
from fsdp2lite.models import GPT, GPTConfig

LIBRARIES = ("fsdp2lite", "torch")
FLOOR = "unsharded"  # the same model, fp32, no FSDP: what its own ops cost (not a rival)
COLLECTIVES = "collectives"  # fsdp2lite's collectives alone, as one step issues them (not a rival): --bound
# torch 2.13 renamed the flat reduce-scatter (the old name warns); torch 2.11-2.12 only have the old one.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
TARGET = 0.9  # fsdp2lite's host time per step at most 0.9x torch's (issue 10)


def build(
    library: str, cfg: GPTConfig, mesh: Any, device: str, wrap: str = "blocks"
) -> tuple[GPT, torch.optim.Optimizer]:
    """The GPT (seed 0) sharded by ``library``, bf16 params, fp32 reduce: per block, then the root
    (``wrap="blocks"``), or as torchtitan wraps a decoder (``"torchtitan"``: the token embedding alone, each
    block, the final norm with the head, then the root: a one-parameter group, [Note: copy-out by views])."""
    torch.manual_seed(0)
    with torch.device(device):  # built there; the steps run outside this mode (it taxes every op)
        model = GPT(cfg)
    units: list[Any] = [*model.blocks]
    if wrap == "torchtitan":
        units = [model.tok_emb, *model.blocks, [model.norm, model.head]]
    if library == "fsdp2lite":
        policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
        for unit in [*units, model]:
            fl.fully_shard(unit, mesh, mp_policy=policy)
    else:
        torch_policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in [*units, model]:
            torch_fully_shard(unit, mesh=mesh, mp_policy=torch_policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _unsharded(cfg: GPTConfig, device: str) -> tuple[GPT, torch.optim.Optimizer]:
    """The floor: the GPT (seed 0) as it is, fp32, no sharding and no casts, on fake tensors."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def step_fn(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


class ReduceScatters(TorchDispatchMode):
    """Records the buffers (shape, dtype) of every reduce-scatter dispatched while active, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[tuple[torch.Size, torch.Size, torch.dtype]] = []  # (output, input, dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func._schema.name == "c10d::_reduce_scatter_base_":
            self.buffers.append((args[0].shape, args[1].shape, args[0].dtype))
        return func(*args, **(kwargs or {}))


def collectives_path(model: GPT, step: Callable[[], None], device: str) -> tuple[Callable[[], None], dict[str, Any]]:
    """fsdp2lite's collectives alone, as one ``step`` issues them: each group's all-gather as the runtime does it
    (``unshard()`` then ``reshard()``: the ops the tests pin per unshard), in the order of the step's
    ``all_gather_issue`` events (``fl.record_trace``), then each reduce-scatter as the bare collective on buffers
    of the step's sizes, made once. Returns that step and what it replays."""
    with fl.record_trace(model) as recorder, ReduceScatters() as reduces:
        step()
    names = [event.group for event in recorder.events if event.name == "all_gather_issue"]
    modules = [model if name == "<root>" else model.get_submodule(name) for name in names]
    buffers = [
        (torch.empty(out, dtype=dtype, device=device), torch.empty(inp, dtype=dtype, device=device))
        for out, inp, dtype in reduces.buffers
    ]

    def collectives() -> None:
        for module in modules:
            module.unshard()
            module.reshard()
        for output, flat in buffers:
            reduce_scatter(output, flat)

    return collectives, {"all_gathers": names, "reduce_scatter_bytes": [flat.nbytes for _, flat in buffers]}


def time_interleaved(steps: dict[str, Callable[[], None]], warmup: int, count: int) -> dict[str, list[float]]:
    """Seconds per step of each library; the order alternates every step so drift hits both alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for index in range(count):
        for name in names if index % 2 == 0 else reversed(names):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def profile_table(step: Callable[[], None], steps: int, lines: int = 25) -> str:
    """cProfile's top functions by cumulative time over ``steps`` steps, as text."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build both models on fake tensors, time them interleaved, optionally profile."""
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads,
        n_layers=args.layers, tie_embeddings=False,
    )  # fmt: skip
    mesh = init_device_mesh(args.device, (args.world_size,), mesh_dim_names=("shard",))  # outside the fake mode
    with FakeTensorMode():  # no torch.device(...) context: its mode would tax every op of both libraries
        models = {name: build(name, cfg, mesh, args.device, args.wrap) for name in LIBRARIES}
        models[FLOOR] = _unsharded(cfg, args.device)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), device=args.device)
        steps = {name: step_fn(model, opt, tokens) for name, (model, opt) in models.items()}
        times = time_interleaved(steps, args.warmup, args.steps)
        floor = times.pop(FLOOR)
        path = measure_bound(models["fsdp2lite"][0], steps, args) if args.bound else None
        ops = {name: count_ops(steps[name]) for name in LIBRARIES}
        profiles = {name: profile_table(step, 3) for name, step in steps.items()} if args.profile else {}
        op_times = over_floor(time_ops(steps["fsdp2lite"], 3), time_ops(steps[FLOOR], 3)) if args.op_times else []
    n_params = _count_params(cfg)
    ratios = [a / b for a, b in zip(times["fsdp2lite"], times["torch"], strict=True)]
    return {
        "model_config": dataclasses.asdict(cfg),
        "n_params": n_params,
        "world_size": args.world_size,
        "wrap": args.wrap,
        "device": args.device,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "host_ms": {name: [1e3 * t for t in ts] for name, ts in times.items()},
        "host_ms_median": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
        "ratio_fsdp2lite_vs_torch": statistics.median(ratios),
        "unsharded_ms": [1e3 * t for t in floor],
        "ratio_unsharded_vs_torch": statistics.median(a / b for a, b in zip(floor, times["torch"], strict=True)),
        "ops_per_step": {name: sum(calls.values()) for name, calls in ops.items()},
        "ops_by_name": {name: dict(calls.most_common(15)) for name, calls in ops.items()},
        "target": {"limit": TARGET, "ok": statistics.median(ratios) <= TARGET},
        "profiles": profiles,
        "op_ms_over_floor": op_times,
        "bound": path,
    }


def measure_bound(model: GPT, steps: dict[str, Callable[[], None]], args: argparse.Namespace) -> dict[str, Any]:
    """``--bound``: fsdp2lite's collectives timed in a second interleaving, with torch's step and the floor's
    (inside the first, they moved fsdp2lite's own ratio: 0.81 where it is 0.75 alone). The floor plus them,
    step by step, over torch's step is the best ratio a runtime that keeps those ops could reach here."""
    collectives, replayed = collectives_path(model, steps["fsdp2lite"], args.device)
    times = time_interleaved({"torch": steps["torch"], FLOOR: steps[FLOOR], COLLECTIVES: collectives}, 1, args.steps)
    ratios = [(f + c) / t for f, c, t in zip(times[FLOOR], times[COLLECTIVES], times["torch"], strict=True)]
    return {
        **replayed,
        "collectives_ms": [1e3 * c for c in times[COLLECTIVES]],
        "torch_ms": [1e3 * t for t in times["torch"]],
        "unsharded_ms": [1e3 * f for f in times[FLOOR]],
        "ops_per_step": dict(count_ops(collectives)),
        "ratio_floor_plus_collectives_vs_torch": statistics.median(ratios),
    }


OP_COLUMNS = ("op", "fsdp2lite ms/step", "floor ms/step", "over the floor", "fsdp2lite calls", "floor calls")


def over_floor(ours: dict[str, tuple[float, float]], floor: dict[str, tuple[float, float]]) -> list[list[Any]]:
    """Every op kind of either step, with fsdp2lite's host time beyond the unsharded model's, largest first."""
    rows = []
    for name in set(ours) | set(floor):
        (ms, calls), (floor_ms, floor_calls) = ours.get(name, (0.0, 0.0)), floor.get(name, (0.0, 0.0))
        rows.append([name, round(ms, 2), round(floor_ms, 2), round(ms - floor_ms, 2), calls, floor_calls])
    return sorted(rows, key=lambda row: -row[3])


def _count_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


COLUMNS = ("library", "host ms/step (median)", "min", "max", "vs torch", "aten ops/step")


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for name in LIBRARIES:
        ms = result["host_ms"][name]
        ratio = f"{result['ratio_fsdp2lite_vs_torch']:.3f}" if name == "fsdp2lite" else "1.000"
        out.append([
            name, f"{result['host_ms_median'][name]:.1f}", f"{min(ms):.1f}", f"{max(ms):.1f}", ratio,
            str(result["ops_per_step"][name]),
        ])  # fmt: skip
    floor = result["unsharded_ms"]
    out.append([
        f"{FLOOR} (floor)", f"{statistics.median(floor):.1f}", f"{min(floor):.1f}", f"{max(floor):.1f}",
        f"{result['ratio_unsharded_vs_torch']:.3f}", "",
    ])  # fmt: skip
    if result["bound"] is not None:
        path = result["bound"]
        ms = path["collectives_ms"]
        out.append(
            [
                f"fsdp2lite's collectives alone: {collectives_in(path)}",
                f"{statistics.median(ms):.1f}",
                f"{min(ms):.1f}",
                f"{max(ms):.1f}",
                "",
                str(sum(path["ops_per_step"].values())),
            ]
        )
        out.append(
            ["floor + those collectives", "", "", "", f"{path['ratio_floor_plus_collectives_vs_torch']:.3f}", ""]
        )
    return out


def title(result: dict[str, Any]) -> str:
    cfg = result["model_config"]
    return (
        f"host time per step, FakeTensorMode on the fake process group: rank 0 of {result['world_size']}, "
        f"{result['device']}; GPT {result['n_params'] / 1e6:.0f}M params ({cfg['n_layers']} blocks, "
        f"d {cfg['d_model']}, seq {cfg['seq_len']}, batch {result['batch']}), bf16 params + fp32 reduce, AdamW; "
        f"{result['steps']} steps after {result['warmup']} warm-up"
    )


def verdict(result: dict[str, Any]) -> str:
    ok = "PASS" if result["target"]["ok"] else "FAIL"
    return (
        f"target {ok}: host time fsdp2lite / torch = {result['ratio_fsdp2lite_vs_torch']:.3f} "
        f"(median of per-step ratios; <= {TARGET})"
    )


def collectives_in(path: dict[str, Any]) -> str:
    return f"{len(path['all_gathers'])} all-gathers, {len(path['reduce_scatter_bytes'])} reduce-scatters"


def bound_line(result: dict[str, Any]) -> str:
    """What ``--bound`` found, in words ("" without it)."""
    path = result["bound"]
    if path is None:
        return ""
    ops = ", ".join(f"{name} {count}" for name, count in sorted(path["ops_per_step"].items()))
    return (
        f"bound: the floor plus fsdp2lite's {collectives_in(path)} alone (ops per step: {ops}) "
        f"= {path['ratio_floor_plus_collectives_vs_torch']:.3f} of torch's step (median of per-step ratios)"
    )


def markdown(result: dict[str, Any], env: dict[str, Any]) -> str:
    body = f"# bench_host\n\n{title(result)}\n\n" + markdown_table(COLUMNS, rows(result)) + f"\n- {verdict(result)}\n"
    if result["bound"] is not None:
        body += f"- {bound_line(result)}\n"
    for name, text in result["profiles"].items():
        body += f"\n## cProfile, {name} (3 steps)\n\n```\n{text.strip()}\n```\n"
    if result["op_ms_over_floor"]:
        body += "\n## Host time per op kind, fsdp2lite over the floor (3 steps; the top 15)\n\n"
        body += markdown_table(OP_COLUMNS, [[str(cell) for cell in row] for row in result["op_ms_over_floor"][:15]])
    return body + "\n" + environment_markdown(env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the simulated job (default 8)")
    parser.add_argument("--layers", type=int, default=16, help="GPT blocks, one group each (default 16)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per library")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device type of the fake tensors")
    parser.add_argument("--profile", action="store_true", help="add cProfile tables per library")
    parser.add_argument(
        "--op-times", action="store_true", help="add fsdp2lite's host ms per op kind against the floor's (3 steps)"
    )
    parser.add_argument(
        "--wrap", choices=("blocks", "torchtitan"), default="blocks",
        help="groups: per block then the root, or torchtitan's (the embedding alone, blocks, norm + head, root)",
    )  # fmt: skip
    parser.add_argument(
        "--bound",
        action="store_true",
        help="also time fsdp2lite's collectives alone: the floor plus them over torch bounds the ratio",
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    for name in ("world_size", "layers", "d_model", "heads", "seq_len", "vocab", "batch", "steps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a machine with CUDA")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now()
    env = environment(started)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        result = measure(args)
    finally:
        dist.destroy_process_group()
    console = Console() if Console().is_terminal else Console(width=160)
    table = Table(title=title(result))
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows(result):
        table.add_row(*row)
    console.print(table)
    console.print(f"  {verdict(result)}", highlight=False, markup=False)
    if result["bound"] is not None:
        console.print(f"  {bound_line(result)}", highlight=False, markup=False)
    for name, text in result["profiles"].items():
        console.print(f"\ncProfile, {name} (3 steps):\n{text}", highlight=False, markup=False)
    if result["op_ms_over_floor"]:
        ops = Table(title="host ms per op kind, fsdp2lite over the unsharded floor (3 steps; the top 15)")
        for index, column in enumerate(OP_COLUMNS):
            ops.add_column(column, justify="left" if index == 0 else "right")
        for row in result["op_ms_over_floor"][:15]:
            ops.add_row(*(str(cell) for cell in row))
        console.print(ops)
    files: list[str] = []
    if not args.no_save:
        stem = f"host-{args.device}-{started:%Y%m%d-%H%M%S}"
        files = save_run(args.out_dir, stem, {**env, **result}, markdown(result, env))
        for path in files:
            console.print(f"wrote {path}", highlight=False)
    print(json.dumps({**env, **{k: v for k, v in result.items() if k != "profiles"}, "files": files}))


if __name__ == "__main__":
    main()
