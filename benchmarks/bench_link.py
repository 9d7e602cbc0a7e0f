"""Step time on an emulated link (issue 34): fsdp2lite's communication policies against torch's fully_shard.

What: one GPT built from one seed, sharded per block then the root, once per entry of ``POLICIES``:
torch's ``fully_shard`` (the rival) and fsdp2lite's default, int8 and fp8 all-gather, all-to-all and int8
reduce-scatter (``fl.CommPolicy``), all in bf16 with fp32 reduction. Every collective goes through the
link emulator (``_link.py``), which charges latency plus the ring's bytes over the link's bandwidth. Per
link (``none`` first: no charge, the fronted group's own speed) the models step interleaved after warm-up
(step i of each in turn, a barrier before each), and per link and policy it reports:
    step_ms        median step time (the slowest rank's)
    ratio          median of per-step ratios against torch's step at the same link (torch is 1.0)
    exposed_share  median of exposed communication / step: CPU, the time the training thread spent blocked
                   in a collective's wait (mean over ranks); CUDA, the step minus the same model's step at
                   ``none`` (the spin kernels' cost the compute did not hide)
and ``emulator_err``: an isolated all-gather and reduce-scatter of a block's size at each link, measured
against its charge (median of 3; the worst relative error over links and kinds; the issue's bound is 5%).
``--planner`` (CPU) adds ``estimate``'s step-time model for each link and policy: the exposed communication
``fsdp2lite.estimate.timing.step_time`` predicts, with this CPU's compute speed taken from the measured
compute-only step (the default policy at ``none``: step minus exposed), against the measured one.

Why: the quantized wire pays where the link is slow and costs encode/decode time where it is fast; this
shows where each policy pays, against torch, on the links of the planner's table.

Setups (``--device``):
    cpu   gloo, 4 ranks (spawned here, one thread each), a GPT of d 256, 4 layers, seq 128, batch 2 per rank
          (3.7M params, 256 tokens per rank), ``--time-scale`` 2000 (see below)
    cuda  torch's fake process group, this GPU as rank 0 of 8, bench_gpu's 944M GPT (d 2048, 16 layers,
          seq 2048, batch 1: 2048 tokens per GPU), time scale 1: the links at their real speed
Why the CPU setup: gloo itself moves 0.1-0.5 GB/s between 4 ranks on 2 cores, so the links' clocks run 2000x
slow (pcie4: 12.5 MB/s and 30 ms per collective; nvlink4: 185 MB/s and 20 ms), which keeps every charge
above gloo's own time (at 1000x, nvlink4's reduce-scatter was 14% under it); the charge, not gloo, is what
a step waits for. Blocks of 0.8M parameters keep pcie4 bandwidth-bound (a 1.6 MB bf16 all-gather against
the 375 KB one latency costs); with 256 tokens per rank a step computes ~0.3-0.6 s, so pcie4's ~2 s of
communication dominates the step (as on a PCIe GPU: about 9x the 944M GPT's compute there) and nvlink4's
~0.4 s, mostly latency, is of the compute's order. The CPU is ~10^4x slower than an H100 but its link only
2000x: a faithful ratio would take ~20 s a step; the CPU half shows the mechanism and the trend, the GPU
half the targets' numbers.

How to run:
    .venv/bin/python benchmarks/bench_link.py --device cpu --links pcie4,nvlink4 --json [--planner]   # ~4 min
    python benchmarks/bench_link.py --device cuda --links pcie4,eth100,nvlink4 --json                  # a GPU
Prints a rich table, then one JSON object last (``--json``: compact, on one line); unless ``--no-save``,
writes ``benchmarks/results/link-<device>-<YYYYmmdd-HHMMSS>.json`` and ``.md`` with machine, versions and
the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _link import LinkGroup, find_link, init_link_group
from _ranks import start_ranks
from _results import environment, environment_markdown, markdown_table, save_run
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2lite as fl
from fsdp2lite.models import GPT, GPTConfig

POLICIES: dict[str, fl.CommPolicy | None] = {  # "torch" is the rival; the others are fsdp2lite
    "torch": None,
    "default": None,
    "int8 all-gather": fl.CommPolicy(all_gather="int8"),
    "fp8 all-gather": fl.CommPolicy(all_gather="fp8"),
    "all-to-all": fl.CommPolicy(reduce_scatter="all_to_all"),
    "int8 reduce-scatter": fl.CommPolicy(reduce_scatter="int8"),
}
BF16 = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")


@dataclass(frozen=True)
class Setup:
    """One half of the benchmark: where it runs and what it trains."""

    device: str  # "cpu" (gloo ranks) or "cuda" (fake group, one process)
    world_size: int
    model: GPTConfig
    batch: int  # sequences per rank
    time_scale: float  # the link's clock runs this many times slow (_link.py)
    warmup: int
    steps: int


SETUPS: dict[str, Setup] = {
    "cpu": Setup("cpu", 4, GPTConfig(2048, 128, 256, 4, 4, True), batch=2, time_scale=2000.0, warmup=2, steps=6),
    "cuda": Setup("cuda", 8, GPTConfig(32768, 2048, 2048, 16, 16, False), batch=1, time_scale=1.0, warmup=3, steps=8),
}


# ---- models and one step --------------------------------------------------------------------------------
def build(name: str, setup: Setup, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The GPT (seed 0) on ``setup.device``, sharded per block then the root by torch or by fsdp2lite."""
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = GPT(setup.model)
    if name == "torch":
        policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        comm = POLICIES[name]
        for block in model.blocks:
            fl.fully_shard(block, mesh=mesh, mp_policy=BF16, comm_policy=comm)
        fl.fully_shard(model, mesh=mesh, mp_policy=BF16, comm_policy=comm)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> Callable[[], float]:
    def step() -> float:
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])  # type: ignore[operator]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach()) if tokens.device.type == "cpu" else 0.0  # CUDA: no host sync in the step

    return step


class Clock:
    """Barriers and timing of one step on this setup: gloo ranks (a side group the link never charges) or
    one CUDA process (synchronize before and after)."""

    def __init__(self, device: str, side: dist.ProcessGroup | None) -> None:
        self.device, self.side = device, side

    def start(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        else:
            dist.barrier(group=self.side)  # every rank starts the timed step together
        return time.perf_counter()

    def stop(self, started: float) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def max_over_ranks(self, values: torch.Tensor, mean: bool = False) -> torch.Tensor:
        if self.side is None:
            return values
        dist.all_reduce(values, op=dist.ReduceOp.SUM if mean else dist.ReduceOp.MAX, group=self.side)
        return values / dist.get_world_size() if mean else values


def time_link(
    steps: dict[str, Callable[[], float]], group: LinkGroup, clock: Clock, setup: Setup
) -> dict[str, dict[str, list[float]]]:
    """Warm-up, then ``setup.steps`` interleaved steps of every model: seconds, exposed seconds, losses."""
    for _ in range(setup.warmup):
        for step in steps.values():
            clock.start()
            step()
    times = torch.zeros(len(steps), setup.steps, dtype=torch.float64)  # (model, step)
    exposed = torch.zeros_like(times)
    losses = torch.zeros_like(times)
    for index in range(setup.steps):
        for model, step in enumerate(steps.values()):
            started = clock.start()
            before = group.exposed_s
            losses[model, index] = step()
            times[model, index] = clock.stop(started)
            exposed[model, index] = group.exposed_s - before
    times, exposed = clock.max_over_ranks(times), clock.max_over_ranks(exposed, mean=True)
    return {
        name: {"step_s": times[i].tolist(), "exposed_s": exposed[i].tolist(), "loss": losses[i].tolist()}
        for i, name in enumerate(steps)
    }


# ---- the emulator's self-check ----------------------------------------------------------------------------
def self_check(group: LinkGroup, clock: Clock, setup: Setup, repeats: int = 3) -> dict[str, Any]:
    """An isolated all-gather (a block's bf16 parameters) and reduce-scatter (its fp32 gradients), timed
    against their charge: {kind: {"charged_s", "measured_s", "err"}}."""
    with torch.device("meta"):  # sizes only
        block_params = sum(p.numel() for p in GPT(dataclasses.replace(setup.model, n_layers=1)).blocks.parameters())
    shard = -(-block_params // setup.world_size)
    world = setup.world_size
    gather_in = torch.ones(shard, dtype=torch.bfloat16, device=setup.device)
    gather_out = torch.empty(world * shard, dtype=torch.bfloat16, device=setup.device)
    scatter_in = torch.ones(world * shard, dtype=torch.float32, device=setup.device)
    scatter_out = torch.empty(shard, dtype=torch.float32, device=setup.device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    issue = {
        "all_gather": lambda: all_gather(gather_out, gather_in, group=group, async_op=True),
        "reduce_scatter": lambda: reduce_scatter(scatter_out, scatter_in, group=group, async_op=True),
    }
    result = {}
    for kind, collective in issue.items():
        measured = [_timed_alone(collective, clock) for _ in range(repeats)]
        charged = group.clock.charges[-1].seconds
        seconds = statistics.median(measured)
        result[kind] = {"charged_s": charged, "measured_s": seconds, "err": seconds / charged - 1}
    return result


def _timed_alone(collective: Callable[[], Any], clock: Clock) -> float:
    """Seconds from issue to the output's readiness, the link free: CPU, the host's wait; CUDA, events around
    the spin on the current stream (the fake group returns at once)."""
    if clock.device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        collective().wait()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = clock.start()  # every earlier charge was waited on: the link is free
    collective().wait()
    return clock.stop(started)


# ---- one process's whole measurement ----------------------------------------------------------------------
def measure(setup: Setup, links: list[str], group: LinkGroup, clock: Clock) -> dict[str, Any]:
    mesh = init_device_mesh(setup.device, (setup.world_size,), mesh_dim_names=("shard",))
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, setup.model.vocab_size, (setup.batch, setup.model.seq_len + 1), generator=gen)
    tokens = tokens.to(setup.device)
    steps = {name: make_step(*build(name, setup, mesh), tokens) for name in POLICIES}
    record: dict[str, Any] = {"links": {}, "emulator": {}}
    for link in ["none", *links]:
        group.set_link(None if link == "none" else link, setup.time_scale)
        record["links"][link] = time_link(steps, group, clock, setup)
        if link != "none":
            record["emulator"][link] = self_check(group, clock, setup)
    return record


def _cpu_entry(rank: int, out_file: str, init_file: str, setup: Setup, links: list[str]) -> None:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each
    group = init_link_group("gloo", None, rank=rank, world_size=setup.world_size, init_method=f"file://{init_file}")
    side = dist.new_group(backend="gloo")  # the benchmark's own barriers and reductions: never charged
    try:
        record = measure(setup, links, group, Clock("cpu", side))
        if rank == 0:
            Path(out_file).write_text(json.dumps(record))
        dist.barrier(group=side)
    finally:
        dist.destroy_process_group()


def run_cpu(setup: Setup, links: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out, init = os.path.join(tmp, "out.json"), os.path.join(tmp, "pg")
        start_ranks(_cpu_entry, setup.world_size, (out, init, setup, links))
        return json.loads(Path(out).read_text())


def run_cuda(setup: Setup, links: list[str]) -> dict[str, Any]:
    """This process as rank 0 of ``setup.world_size`` on the fake group, the charges spun on this GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_link --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    group = init_link_group("fake", None, rank=0, world_size=setup.world_size, store=FakeStore())
    try:
        return measure(setup, links, group, Clock("cuda", None))
    finally:
        dist.destroy_process_group()


# ---- summaries ---------------------------------------------------------------------------------------------
def summarize(record: dict[str, Any], device: str) -> dict[str, dict[str, dict[str, float]]]:
    """Per link and policy: step_ms, ratio (per-step median against torch), exposed_ms and exposed_share."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for link, runs in record["links"].items():
        rival = runs["torch"]["step_s"]
        out[link] = {}
        for policy, run in runs.items():
            steps = run["step_s"]
            step_s = statistics.median(steps)
            if device == "cuda":  # the spin kernels' cost the compute did not hide: the step beyond "none"
                exposed_s = max(0.0, step_s - statistics.median(record["links"]["none"][policy]["step_s"]))
                share = exposed_s / step_s
            else:
                exposed_s = statistics.median(run["exposed_s"])
                share = statistics.median(e / s for e, s in zip(run["exposed_s"], steps, strict=True))
            out[link][policy] = {
                "step_ms": 1e3 * step_s,
                "ratio": statistics.median(a / b for a, b in zip(steps, rival, strict=True)),
                "exposed_ms": 1e3 * exposed_s,
                "exposed_share": share,
            }
    return out


TARGETS = (("pcie4", "int8 all-gather", 0.75), ("nvlink4", "default", 1.0), ("nvlink4", "int8 all-gather", 1.03))


def targets(summary: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """The issue's step-time targets against torch (set for the GPU half; on CPU reported for reference)."""
    return [
        {"link": link, "policy": policy, "ratio": summary[link][policy]["ratio"], "limit": limit,
         "ok": summary[link][policy]["ratio"] <= limit, "binding": device == "cuda"}
        for link, policy, limit in TARGETS if policy in summary.get(link, {})
    ]  # fmt: skip


def emulator_err(record: dict[str, Any]) -> float:
    """The worst relative error of an isolated collective's time against its charge, over links and kinds."""
    errors = [abs(check["err"]) for link in record["emulator"].values() for check in link.values()]
    return max(errors) if errors else float("nan")


def planner(setup: Setup, summary: dict[str, Any], links: list[str]) -> dict[str, Any]:
    """``estimate``'s step-time model at each link and policy (the link's clock slowed by the time scale) against
    the measured exposed communication. This CPU's compute speed comes from the measured compute-only time:
    fsdp2lite's default step minus its exposed communication, at each link, since 4 ranks share 2 cores and a
    rank computes up to twice as fast while the others wait on a slow link."""
    from fsdp2lite.estimate.timing import Gpu, Link, attention_flops, comm_bytes, flops_per_token, step_time

    with torch.device("meta"):
        model = GPT(setup.model)
    params = float(sum(p.numel() for p in model.parameters()))
    tokens = setup.batch * setup.model.seq_len
    attention = attention_flops(setup.model.n_layers, setup.model.d_model, setup.model.seq_len)
    flops = tokens * flops_per_token(params, params, "full", False, attention)
    result: dict[str, Any] = {"flops_per_step": flops, "links": {}}
    for link in links:
        named, default = find_link(link), summary[link]["default"]
        compute_s = (default["step_ms"] - default["exposed_ms"]) / 1e3
        cpu = Gpu(flops / compute_s / 1e12, 1.0)  # TFLOP/s this rank reached, as a "GPU" at full use
        slowed = Link(named.gb_per_s / setup.time_scale, named.latency_us * setup.time_scale)
        result["links"][link] = {"compute_s": compute_s, "tflops": cpu.tflops}
        for policy, comm in POLICIES.items():
            wire = {} if comm is None else comm.model_dump(exclude_defaults=True)
            config = fl.FSDPConfig.model_validate(
                {"wrap": [{"match": {"class": "Block"}}], "communication": wire,
                 "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
            )  # fmt: skip
            sent = comm_bytes(fl.plan_config(model, config), shard=setup.world_size)
            predicted = step_time(
                params=params, tokens_per_gpu=tokens, world_size=setup.world_size, link=slowed, gpu=cpu,
                comm=sent, attention_flops_per_token=attention, schedule="cpu",
            )  # fmt: skip
            measured = summary[link][policy]["exposed_ms"] / 1e3
            result["links"][link][policy] = {
                "comm_s": predicted.comm_s, "predicted_exposed_s": predicted.exposed_comm_s,
                "measured_exposed_s": measured, "sent_per_rank": sent.sent_per_rank,
                "err": predicted.exposed_comm_s / measured - 1 if measured > 0 else None,
            }  # fmt: skip
    return result


def planner_err(plan: dict[str, Any]) -> float:
    """The worst |predicted / measured - 1| of the exposed communication over links and fsdp2lite's policies
    (torch's schedule is not the one the planner models)."""
    errors = [
        abs(entry["err"]) for link in plan["links"].values() for policy, entry in link.items()
        if isinstance(entry, dict) and policy != "torch" and entry["err"] is not None
    ]  # fmt: skip
    return max(errors, default=0.0)


# ---- output -------------------------------------------------------------------------------------------------
COLUMNS = ("link", "policy", "step ms", "vs torch", "exposed ms", "exposed share", "planner exposed ms")


def table_rows(summary: dict[str, Any], plan: dict[str, Any] | None) -> list[list[str]]:
    rows = []
    for link, policies in summary.items():
        for policy, m in policies.items():
            predicted = (plan or {}).get("links", {}).get(link, {}).get(policy)
            rows.append([
                link, policy, f"{m['step_ms']:.1f}", f"{m['ratio']:.3f}", f"{m['exposed_ms']:.1f}",
                f"{m['exposed_share']:.2f}", f"{1e3 * predicted['predicted_exposed_s']:.1f}" if predicted else "-",
            ])  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(SETUPS), default="cpu")
    parser.add_argument("--links", default="pcie4,nvlink4", help="comma-separated names of the planner's links")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per link (cpu 6, cuda 8)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per link (cpu 2, cuda 3)")
    parser.add_argument("--time-scale", type=float, default=None, help="the link's clock slowdown (cpu 2000)")
    parser.add_argument("--planner", action="store_true", help="cpu: estimate's model against the measurement")
    parser.add_argument("--json", action="store_true", help="print the final JSON object on one line")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-save", action="store_true", help="print only, write no files")
    args = parser.parse_args(argv)
    args.links = [name.strip() for name in args.links.split(",") if name.strip()]
    for name in args.links:
        if name == "none":
            parser.error("--links: 'none' (no charge) always runs first; list the links to emulate")
        try:
            find_link(name)
        except ValueError as exc:
            parser.error(f"--links: {exc}")
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 1):
        parser.error(f"--steps ({args.steps}) and --warmup ({args.warmup}) must be >= 1")
    if args.planner and args.device != "cpu":
        parser.error("--planner compares against the measured exposed communication on the CPU half only")
    return args


def setup_from(args: argparse.Namespace) -> Setup:
    setup = SETUPS[args.device]
    changes = {"steps": args.steps, "warmup": args.warmup, "time_scale": args.time_scale}
    return dataclasses.replace(setup, **{key: value for key, value in changes.items() if value is not None})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup = setup_from(args)
    started = datetime.datetime.now()
    env = environment(started)  # the code that runs: read before the runs
    console = Console(width=160)
    with console.status(f"{args.device}: {['none', *args.links]}, {len(POLICIES)} models, interleaved"):
        record = run_cuda(setup, args.links) if setup.device == "cuda" else run_cpu(setup, args.links)
    summary = summarize(record, setup.device)
    plan = planner(setup, summary, args.links) if args.planner else None
    table = Table(title=f"bench_link {setup.device}: {setup.world_size} ranks, time scale {setup.time_scale:g}")
    for column in COLUMNS:
        table.add_column(column)
    for row in table_rows(summary, plan):
        table.add_row(*row)
    console.print(table)
    result = {
        "setup": dataclasses.asdict(setup), "links": summary, "emulator_err": emulator_err(record),
        "emulator": record["emulator"], "planner": plan, "raw": record["links"], **env,
    }  # fmt: skip
    result["targets"] = targets(summary, setup.device)
    lines = [f"emulator_err {result['emulator_err']:.4f} (isolated all-gather and reduce-scatter, worst)"]
    if plan is not None:
        result["planner_err"] = planner_err(plan)
        lines.append(f"planner_err {result['planner_err']:.3f}: the planner's exposed communication against the "
                     "measured one, fsdp2lite's policies, worst over links (the issue's bound: 0.2)")  # fmt: skip
    lines += [
        f"target {'PASS' if t['ok'] else 'FAIL'}{'' if t['binding'] else ' (a GPU target; for reference)'}: "
        f"{t['link']} {t['policy']} {t['ratio']:.3f} <= {t['limit']}"
        for t in result["targets"]
    ]
    for line in lines:
        console.print(line, highlight=False, markup=False)
    if not args.no_save:
        stem = f"link-{setup.device}-{started:%Y%m%d-%H%M%S}"
        md = f"# bench_link ({setup.device})\n\n{markdown_table(COLUMNS, table_rows(summary, plan))}\n"
        md += "\n" + "".join(f"- {line}\n" for line in lines) + "\n" + environment_markdown(env)
        result["files"] = save_run(args.out_dir, stem, result, md)
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=1, default=str))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
