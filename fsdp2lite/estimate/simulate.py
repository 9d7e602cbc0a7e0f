"""``estimate_memory(method="simulate")``: the real runtime on fake tensors and a fake process group.

[Note: local shards]
What one rank allocates is what the ops on its local tensors allocate: a DTensor op runs its local op
on the shard, and only that takes memory. To decide the output's placement, DTensor first propagates
shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``), and where that meets an op it has
no cached rule for (torch 2.11's foreach ops: AdamW's step) it builds fake tensors of the *global*
shape of every argument, under the ambient fake mode. torch 2.11's ``MemTracker`` counts those as
this rank's allocations (a foreach AdamW step at world 2 looked 4.5x the optimizer state; Llama-3-8B
at world 8 3.8x the measured peak); 2.13 does not. ``local_shard_tracker`` stops counting while DTensor
propagates, on every version, so the estimate counts local shards only.

[Note: qlora simulated]
qlora runs as it trains: each adapted base weight is the ``NF4Rows`` ``finetune.quantize_base`` makes (fake codes
and block scales of the weight's shape), sharded, all-gathered through its hooks into an ``NF4Weight`` and
dequantized at each matmul by fsdp2lite's own kernel, so the shards, the gathered groups and every
dequantization's temporaries are the runtime's own (eager: a CUDA target's compiled kernel makes no index, at
most 32 MiB less).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import FSDPConfig, Plan, apply_config, plan_config
from ..mesh import init_mesh
from .allocator import AllocatorPeak
from .common import (
    MemoryEstimate,
    default_config,
    fsdp_params,
    make_optimizer,
    materialized,
    offloaded_share,
    step_inputs,
    step_loss,
)
from .finetune import Finetune, planned_nf4
from .host import host_bytes, host_note, on_host_optimizer
from .plan_bytes import GroupBytes, group_bytes, nf4_paths, trained_bytes
from .reserved import AllocationRecorder, from_replay, streams_tagged

_SCHEDULE_SETTERS = (
    ("forward_prefetch_depth", "set_forward_prefetch_depth"),
    ("late_backward_prefetch", "set_late_backward_prefetch"),
    ("overlap_reduce_scatter", "set_overlap_reduce_scatter"),
)


def simulate_estimate(
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig | None,
    world_size: int,
    rank: int,
    inputs_fn: Callable[[], Any] | None,
    batch: int,
    seq: int | None,
    optimizer: str,
    device: str,
    finetune: Finetune | None = None,
) -> MemoryEstimate:
    """Measured on fake tensors (module docstring). ``model_fn`` builds the model ``finetune`` trains
    (``finetune.planned_factory``); qlora runs its base in bf16 and ``_planned`` then counts the adapted
    weights at NF4's size ([Note: qlora simulated])."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        fake = FakeTensorMode()
        with fake:
            model = materialized(model_fn())
        config = config or default_config(model)
        replicate, shard = config.mesh.resolve(world_size)
        plan = plan_config(model, config)
        nf4 = nf4_paths(model) if finetune is not None and finetune.kind == "qlora" else set()
        groups = group_bytes(plan, shard, nf4, pinned=device == "cuda")
        with fake:
            held_by_rows(model, nf4)  # [Note: qlora simulated]
        plan = plan_config(model, config)
        mesh = init_mesh(replicate=config.mesh.replicate, shard=config.mesh.shard, device_type="cpu")  # not fake
        with fake:
            apply_config(model, on_host_optimizer(config), mesh)  # NVMe: counted from the plan ([Note: host bytes])
            target_device_settings(model, config, device)
            opt = make_optimizer(optimizer, model, device)
            inputs, token_model = step_inputs(model, inputs_fn, batch, seq)
            phases = _phases(model, opt, inputs, token_model)
            for run in phases.values():
                run()  # warm-up: optimizer state exists from here on, as in a steady-state step
            estimate, replays = _measure(phases, model, opt, world_size, rank, device)
    finally:
        dist.destroy_process_group()
    trained = trained_bytes(plan, groups, replicate)
    estimate = _planned(estimate, plan, (groups, trained), finetune, optimizer)
    if replays is None:
        return estimate
    reserved = from_replay(estimate.peak_bytes, *replays)
    return replace(
        estimate, reserved_bytes=reserved.reserved_bytes, reserved_expandable_bytes=reserved.expandable_bytes
    )


def _planned(
    estimate: MemoryEstimate,
    plan: Plan,
    bytes_of: tuple[list[GroupBytes], list[int]],
    finetune: Finetune | None,
    optimizer: str,
) -> MemoryEstimate:
    """The measured estimate with what the plan knows better: the host side of CPU offload at the sizes pinning
    takes, NVMe's files and staging buffers included ([Note: host bytes]). ``bytes_of``: per group, its bytes
    and its trainable shards' bytes."""
    groups, trained = bytes_of
    host = host_bytes(plan, groups, trained, estimate.host_bytes, optimizer)
    notes = estimate.notes + ((host_note(host),) if host.pinned else ())
    if finetune is not None and finetune.adapters:
        notes = (*notes, f"{finetune.label()}: the frozen base has no gradients or optimizer state")
    return replace(
        estimate,
        host_bytes=host.pinned,
        host_exact_bytes=host.exact,
        nvme_bytes=host.nvme,
        host_bytes_step_in_backward=host.pinned_in_backward,
        notes=notes,
        finetune=finetune.kind if finetune is not None else "full",
    )


def held_by_rows(model: nn.Module, paths: set[str]) -> None:
    """Each weight at ``paths`` (qlora's adapted base weights) as the ``NF4Rows`` ``finetune.quantize_base``
    makes, on the model's (fake) device: [Note: qlora simulated]."""
    from ..finetune.nf4_rows import NF4Rows

    for path in paths:
        owner, _, name = path.rpartition(".")
        module = model.get_submodule(owner)
        parts = planned_nf4(module._parameters[name])  # type: ignore[arg-type]
        module._parameters[name] = nn.Parameter(NF4Rows(*parts), requires_grad=False)


def target_device_settings(model: nn.Module, config: FSDPConfig, device: str) -> None:
    """The target device's schedule defaults where the config says ``auto``, and its reduction: gloo's
    in-place all-reduce on ``cpu``, a native reduce-scatter on ``cuda``."""
    from .._runtime.collective import GlooInPlace, Native
    from .._runtime.root import schedule_defaults
    from ..module import FSDPModule

    defaults = schedule_defaults(on_cuda=device == "cuda")
    for key, setter in _SCHEDULE_SETTERS:
        if getattr(config.schedule, key) == "auto":
            getattr(model, setter)(getattr(defaults, key))
    for module in model.modules():
        if isinstance(module, FSDPModule) and module._fsdp_state.group is not None:
            module._fsdp_state.group.forms.set_collective(GlooInPlace() if device == "cpu" else Native())


def _phases(
    model: nn.Module, opt: torch.optim.Optimizer | None, inputs: tuple[Any, ...], token_model: bool
) -> dict[str, Callable[[], None]]:
    """One step as its three phases, in order: forward (with the loss), backward, optimizer."""
    losses: list[torch.Tensor] = []

    def forward() -> None:
        losses.append(step_loss(model, inputs, token_model))

    def backward() -> None:
        losses.pop().backward()

    def optimizer() -> None:
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            model.zero_grad()

    return {"forward": forward, "backward": backward, "optimizer": optimizer}


def _measure(
    phases: dict[str, Callable[[], None]],
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    world_size: int,
    rank: int,
    device: str,
) -> tuple[MemoryEstimate, tuple[AllocatorPeak, AllocatorPeak] | None]:
    """The measured step's estimate and, for CUDA, its allocations replayed through the caching
    allocator's model (default, expandable segments)."""
    from .tracker import local_shard_tracker  # torch's MemTracker: imported when a step is measured

    gc.collect()
    peak_after: dict[str, int] = {}  # the running peak after each phase: the first to reach the end's is it
    recorder = AllocationRecorder()
    with local_shard_tracker() as tracker, streams_tagged(recorder):
        tracker.recorder = recorder
        tracker.track_external(model, *([opt] if opt is not None else []))
        for name, run in phases.items():
            run()
            peak_after[name] = _total(tracker.get_tracker_snapshot("peak"))
        tracker.recorder = None
    snapshot = tracker.get_tracker_snapshot("peak")
    categories = {
        str(getattr(k, "value", k)): v
        for dev, snap in snapshot.items()
        if torch.device(dev).type != "meta"
        for k, v in snap.items()
    }
    total = categories.get("Total", 0)
    sharded = _sharded_param_bytes(model)
    parameter = categories.get("Parameter", 0)
    breakdown = {
        "params": min(sharded, parameter),
        "unsharded_params": max(0, parameter - sharded),
        "grads": categories.get("Gradient", 0),
        "optimizer": categories.get("Optstate", 0),
        "activations": categories.get("Activation", 0),
        "comm_buffers": sum(categories.get(k, 0) for k in ("Temp", "Buffer", "Other")),
    }
    phase = next(name for name, peak in peak_after.items() if peak >= total)
    group = _peak_group(tracker, model, total) if phase != "optimizer" else None
    host = _move_offloaded_to_host(model, breakdown)
    peak = sum(breakdown.values())
    replays = recorder.replay() if device == "cuda" else None  # the caching allocator is CUDA's
    estimate = MemoryEstimate(world_size, rank, peak, phase, group, breakdown, "simulate", device, host_bytes=host)
    return estimate, replays


def _move_offloaded_to_host(model: nn.Module, breakdown: dict[str, int]) -> int:
    """CPU offload: the offloaded groups' shards live on the host (not ``optimizer_only``'s), and so do their
    gradients and optimizer state (in the proportion of their shards); take them out of the device's
    breakdown. Returns the optimizer state moved (``_planned`` adds the shards and gradients at their pinned sizes)."""
    offloaded, share = offloaded_share(model)
    if not share:
        return 0
    moved = {"params": min(offloaded, breakdown["params"])}
    moved["grads"] = int(breakdown["grads"] * share)
    moved["optimizer"] = int(breakdown["optimizer"] * share)
    for key, value in moved.items():
        breakdown[key] -= value
    return moved["optimizer"]


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    return sum(snap.get("Total", 0) for dev, snap in snapshot.items() if torch.device(dev).type != "meta")


def _sharded_param_bytes(model: nn.Module) -> int:
    """What the shards (and parameters left unsharded) take on this rank: their storages, padding included."""
    from torch.distributed.tensor import DTensor

    storages = {id(p): p.padded_shard.untyped_storage() for p in fsdp_params(model)}
    shards = sum({s._cdata: s.nbytes() for s in storages.values()}.values())  # a group's host buffer counts once
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
    return shards + whole  # ignored parameters stay whole


def _peak_group(tracker: Any, model: nn.Module, total: int) -> str | None:
    """The innermost fsdp2lite group running at the peak (MemTracker keeps each module's own peak in
    forward and in backward: the peak is in the modules whose peak it is); None when the peak falls
    outside every group (the loss)."""
    from torch.distributed._tools.mem_tracker import _ModState

    from ..module import FSDPModule

    names = {id(m): name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    best: tuple[int, str] | None = None
    for module, stats in tracker.memory_tracking.items():
        name = names.get(id(module))
        if name is None:
            continue
        for state in (_ModState.PEAK_FW, _ModState.PEAK_BW):
            snaps = stats.snapshots.get(state) or []
            if any(dev_snap.get("Total") == total for snap in snaps for dev_snap in snap.values()):
                depth = name.count(".") + 1 if name else 0
                if best is None or depth > best[0]:
                    best = (depth, name)
    return None if best is None else best[1]
