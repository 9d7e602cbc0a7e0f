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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
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
    from .._runtime.root import schedule_defaults
    from ..module import FSDPModule

    defaults = schedule_defaults(on_cuda=device == "cuda")
    for key, setter in _SCHEDULE_SETTERS:
        if getattr(config.schedule, key) == "auto":
            getattr(model, setter)(getattr(defaults, key))
    for module in model.modules():
        if isinstance(module, FSDPModule) and module._fsdp_state.group is not None:
            module._fsdp_state.group.choose_reduce(in_place=device == "cpu")


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


class _NoHook:
    """A hook handle for a parameter that gets no hook (frozen)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


@contextmanager
def local_shard_tracker() -> Iterator[Any]:
    """torch's ``MemTracker``, entered, counting only what the ops on local shards allocate
    ([Note: local shards])."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class LocalShardTracker(MemTracker):
        propagating: int = 0  # > 0 while DTensor propagates shapes: nothing allocated then is this rank's
        recorder: AllocationRecorder | None = None  # fed every storage the tracker adds, frees or resizes
        indexed: int = -1  # the modules ``by_fqn`` indexes (``_running_stats``)

        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):  # type: ignore[no-untyped-def]
            # torch's tracker hooks every parameter's gradient, and a frozen one (a fine-tuned base) refuses
            # hooks: mark those as hooked already, with handles that remove nothing
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):  # type: ignore[no-untyped-def]
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if self.recorder is None or winfo.device.type == "meta":
                return
            kind = u_type.name
            if kind == "ADD":
                self.recorder.added(winfo, winfo.mem_consumed)
            elif kind == "DEL":
                self.recorder.deleted(winfo)
            elif kind == "SIZE":
                self.recorder.resized(winfo, winfo.mem_consumed)

        def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
            # torch's, reading only the modules running now: torch's walks every module it has seen, through
            # weak references, at every op (most of a traced step's time on a model of many modules)
            curr_snap = self._curr_mem_snap
            for fqn in self._mod_tracker.parents:
                for mod_stats in self._running_stats(fqn):
                    if peak_state not in mod_stats.snapshots:
                        continue
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL]
                            mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
            for dev, dev_snap in curr_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL]:
                    self._peak_mem[dev] = dev_snap[_TOTAL]
                    self._peak_mem_snap[dev] = deepcopy(dev_snap)

        def _running_stats(self, fqn: str) -> list[Any]:
            """The stats of the modules named ``fqn``; the index is remade when a module is first seen."""
            if len(self.memory_tracking) != self.indexed:
                self.by_fqn: dict[str, list[Any]] = {}
                for stats in self.memory_tracking.values():
                    self.by_fqn.setdefault(stats.mod_fqn, []).append(stats)
                self.indexed = len(self.memory_tracking)
            return self.by_fqn.get(fqn, [])

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if self.propagating:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    tracker = LocalShardTracker()
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate_untracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.propagating += 1
        try:
            return propagate(self, *args, **kwargs)
        finally:
            tracker.propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate_untracked  # type: ignore[method-assign]
    try:
        with tracker:
            yield tracker
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]


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
