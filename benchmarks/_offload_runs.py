"""bench_offload.py's runs, shared by its two halves (gloo ranks on CPU; one process on a fake process group, on CPU
or a GPU): the setups compared, how each is built, one timed step, steps interleaved across runs, one metered step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from _meters import count_ops  # benchmarks/ is sys.path[0] when run as a script
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.models import GPT, GPTConfig
from fsdp2lite.offload.host_step import fast_host_step, step_in_backward
from fsdp2lite.trace import summarize

LR = 1e-4
RIVAL = "torch"
Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens (batch, seq), targets (batch, seq))


@dataclass(frozen=True)
class Setup:
    """One way to shard and step the model."""

    name: str  # row label and JSON key
    library: str  # "fsdp2lite" or "torch"
    step: str  # "loop": AdamW as constructed (Placement.foreach); "fused": fast_host_step(AdamW); "in_backward":
    # step_in_backward with fast_host_step(AdamW) per group, host steps overlapping backward; "in_backward_serial":
    # the same with overlap=False, each step in backward's own thread

    @property
    def in_backward(self) -> bool:
        return self.step.startswith("in_backward")


SETUPS = (
    Setup("fsdp2lite + fast_host_step", "fsdp2lite", "fused"),
    Setup(RIVAL, "torch", "loop"),
    Setup("fsdp2lite + AdamW", "fsdp2lite", "loop"),
    Setup("torch + fast_host_step", "torch", "fused"),
    Setup("fsdp2lite + step_in_backward", "fsdp2lite", "in_backward"),
    Setup("fsdp2lite + step_in_backward, overlap off", "fsdp2lite", "in_backward_serial"),
)
MAIN = SETUPS[0].name  # the row the target is about


@dataclass(frozen=True)
class Placement:
    """Where the model is built and how it is offloaded, the same for every setup of one benchmark run."""

    device: str  # the mesh's device type: the model is built there, its shards offloaded to the host
    pin_memory: bool  # CPUOffloadPolicy(pin_memory=...), both libraries
    mixed_precision: bool  # bf16 parameters, fp32 reduction (MixedPrecisionPolicy, both libraries); else fp32
    foreach: bool | None  # AdamW(foreach=...) for the "loop" setups; None: as torch picks (the for-loop on CPU)


GLOO_CPU = Placement("cpu", pin_memory=False, mixed_precision=False, foreach=None)  # the gloo half


class Run(NamedTuple):
    model: GPT  # sharded as its setup says
    optimizers: list[torch.optim.Optimizer]  # one; step_in_backward: one per group, stepped inside backward
    step_after_backward: bool  # False: step_in_backward's hooks step
    losses: list[float]  # every step's, on this rank


def _shard(module: torch.nn.Module, library: str, mesh: DeviceMesh, placement: Placement) -> None:
    pin, mixed = placement.pin_memory, placement.mixed_precision
    if library == "fsdp2lite":
        mp = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32") if mixed else None
        fl.fully_shard(module, mesh, mp_policy=mp, offload_policy=fl.CPUOffloadPolicy(pin_memory=pin))
        return
    kwargs: dict[str, Any] = {"mesh": mesh, "offload_policy": TorchCPUOffloadPolicy(pin_memory=pin)}
    if mixed:
        kwargs["mp_policy"] = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch_fully_shard(module, **kwargs)


def build(setup: Setup, config: GPTConfig, mesh: DeviceMesh, placement: Placement = GLOO_CPU) -> Run:
    """The GPT (seed 0) built on ``placement.device``, every block then the root sharded with CPU offload; AdamW
    as ``setup.step`` says."""
    torch.manual_seed(0)
    with torch.device(placement.device):
        model = GPT(config)
    for module in [*model.blocks, model]:
        _shard(module, setup.library, mesh, placement)
    if setup.in_backward:
        adamw = lambda params: fast_host_step(torch.optim.AdamW(params, lr=LR))  # noqa: E731
        handle = step_in_backward(model, adamw, overlap=setup.step == "in_backward")
        return Run(model, handle.optimizers, False, [])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=placement.foreach)
    return Run(model, [fast_host_step(optimizer) if setup.step == "fused" else optimizer], True, [])


def make_batch(config: GPTConfig, batch: int, rank: int, device: str = "cpu") -> Batch:
    """Fixed per rank, the same for every run."""
    tokens = torch.randint(
        0, config.vocab_size, (batch, config.seq_len + 1), generator=torch.Generator().manual_seed(rank)
    ).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _nothing() -> None:
    return None


def train_step(run: Run, batch: Batch, finish: Callable[[], None] = _nothing) -> tuple[float, float]:
    """One step; (whole step, ``optimizer.step()``) in seconds, the second NaN when backward stepped. ``finish``
    runs before the whole step's clock stops (a device's synchronize: its queued work is the step's). The loss is
    kept."""
    start = time.perf_counter()
    loss = run.model.loss(*batch)
    loss.backward()
    step_start = time.perf_counter()
    if run.step_after_backward:
        (optimizer,) = run.optimizers
        optimizer.step()
    step_end = time.perf_counter()
    for optimizer in run.optimizers:
        optimizer.zero_grad()
    finish()
    end = time.perf_counter()
    run.losses.append(loss.item())
    return end - start, step_end - step_start if run.step_after_backward else float("nan")


def time_interleaved(
    runs: list[Run],
    batch: Batch,
    warmup: int,
    steps: int,
    before: Callable[[], None] = dist.barrier,
    finish: Callable[[], None] = _nothing,
) -> torch.Tensor:
    """Seconds (run, step, [whole, host step]) on this rank after ``warmup`` steps; step i of every run in turn.
    ``before`` runs before each step (gloo: a barrier, every rank starts together; a GPU: synchronize, nothing
    queued from earlier), ``finish`` inside it (``train_step``)."""
    times = torch.zeros(len(runs), steps, 2, dtype=torch.float64)
    for step in range(-warmup, steps):
        for index, run in enumerate(runs):
            before()
            measured = train_step(run, batch, finish)
            if step >= 0:
                times[index, step] = torch.tensor(measured, dtype=torch.float64)
    return times


class Metered(NamedTuple):
    """One metered step's numbers (``extra_step``)."""

    ops: dict[str, int] | None  # aten ops ``optimizer.step()`` dispatched, by name; None when backward steps
    grad_bytes: int  # local bytes of the gradients alive after backward
    host_step_s: float | None  # step_in_backward: its host steps' seconds (the trace's host_step spans)
    host_exposed_s: float | None  # of which backward's thread spent: stepping, or waiting for the host-step thread


def extra_step(run: Run, batch: Batch) -> Metered:
    """One more step, metered: the aten ops its ``optimizer.step()`` dispatches, by name, a DTensor op counted
    once (None when backward steps, its ops being among backward's); the bytes of gradients alive after backward
    (local shards: what the host holds between backward and the step); for step_in_backward, its host steps and
    the part of them backward's thread spent, read from a trace of the step (``fl.record_trace``)."""
    trace = fl.record_trace(run.model) if not run.step_after_backward else nullcontext(None)
    with trace as recorder:
        loss = run.model.loss(*batch)
        loss.backward()
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    grad_bytes = sum(g.to_local().nbytes if isinstance(g, DTensor) else g.nbytes for g in grads)
    ops = dict(count_ops(run.optimizers[0].step)) if run.step_after_backward else None
    for optimizer in run.optimizers:
        optimizer.zero_grad()
    run.losses.append(loss.item())
    if recorder is None:
        return Metered(ops, grad_bytes, None, None)
    rows = summarize(recorder.as_dicts())
    host, exposed = sum(row.host_step_ms for row in rows), sum(row.host_step_exposed_ms for row in rows)
    return Metered(ops, grad_bytes, host / 1e3, exposed / 1e3)


def rank0_metered(metered: list[Metered]) -> dict[str, dict[str, Any]]:
    """This rank's op counts and traced host steps per setup, keyed as the results are."""
    pairs = list(zip(SETUPS, metered, strict=True))
    return {
        "rank0_step_ops": {setup.name: m.ops for setup, m in pairs},
        "rank0_traced_host_s": {setup.name: [m.host_step_s, m.host_exposed_s] for setup, m in pairs},
    }


def group_flags(optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [
        {"params": len(g["params"]), "fused": g["fused"], "foreach": g["foreach"]}
        for optimizer in optimizers
        for g in optimizer.param_groups
    ]
