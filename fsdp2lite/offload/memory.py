"""What CPU offload holds in host memory, read from the runtime: ``host_memory(model)``.

The planner predicts a rank's host memory (``fsdp2lite estimate``: ``host_bytes``, [Note: host bytes] in
``estimate/host.py``); this reads what the runtime really holds, so the two can be compared on a running job and
pinned memory checked against a machine's locked-memory limit (``ulimit -l``, ``fsdp2lite doctor``):
- ``shards``: the offloaded groups' packed host buffers, their host shards (``optimizer_only``: the masters) at
  64-byte offsets ([Note: one host buffer per group] in ``_runtime/host_arena.py``);
- ``own_buffers``: host shards kept in buffers of their own (hooked parameters such as NF4, HFSDP's chunks);
- ``gradients``: the root's pool of reduced-gradient host buffers ([Note: host gradient buffers] in
  ``_runtime/pinned.py``), filled by the first backward on a CUDA mesh (a CPU mesh reduces in place: none);
- ``pinned`` and ``registered``: how much of those is page-locked, and how much of that was registered with the
  driver at its exact size (the rest came from torch's pinned allocator, rounded up to a power of two).
The optimizer state is the optimizer's (``nvme_stats`` reports NVMe's staging slots); buffers are counted once
however many tensors view them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp2lite._runtime.host_arena import host_tensor
from fsdp2lite.host import HostEngine
from fsdp2lite.module import FSDPModule


@dataclass(frozen=True)
class HostMemory:
    """One rank's host memory under CPU offload, in bytes (module docstring)."""

    shards: int  # the groups' packed host buffers
    own_buffers: int  # host shards in buffers of their own (NF4, HFSDP)
    gradients: int  # the reduced-gradient pool
    pinned: int  # of the three, page-locked
    registered: int  # of ``pinned``, registered at its exact size
    offloaded_groups: int  # groups with host shards (or masters)

    @property
    def total(self) -> int:
        return self.shards + self.own_buffers + self.gradients


def host_memory(model: nn.Module) -> HostMemory:
    """What CPU offload holds in host memory for ``model`` (an ``fsdp2lite.FSDPModule`` or a module containing
    some) on this rank; all zeros without offload. Raises ``TypeError`` when no module of ``model`` is sharded."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise TypeError(f"host_memory takes a model sharded by fsdp2lite.fully_shard; {type(model).__name__} has none")
    groups = [m._fsdp_state.group for m in sharded if m._fsdp_state.group is not None]
    seen: dict[int, tuple[str, int, str]] = {}  # storage address -> (kind, bytes, pinning)
    offloaded = 0
    for group in groups:
        arena = group.host_arena
        if arena is not None:
            _count(seen, arena.buffer, "shards", arena.pinning)
        own = [t for p in group.params if host_tensor(p) is None and (t := _own_host_tensor(p)) is not None]
        for tensor in own:
            for inner in _plain_tensors(tensor):
                _count(seen, inner, "own_buffers", "allocator" if inner.is_pinned() else "none")
        offloaded += arena is not None or bool(own)
    if groups and isinstance(engine := groups[0].host, HostEngine):  # the root's, shared by every group
        for buffer in engine.grads.buffers:
            _count(seen, buffer.raw, "gradients", buffer.pinning)
    totals = {kind: sum(n for k, n, _ in seen.values() if k == kind) for kind in ("shards", "own_buffers", "gradients")}
    return HostMemory(
        **totals,
        pinned=sum(n for _, n, pinning in seen.values() if pinning != "none"),
        registered=sum(n for _, n, pinning in seen.values() if pinning == "registered"),
        offloaded_groups=offloaded,
    )


def _own_host_tensor(param: Any) -> torch.Tensor | None:
    """An offloaded parameter's host shard outside its group's packed buffer (hooked, HFSDP), or None."""
    if not param.home.on_host:  # host masters: their host tensors are in the group's buffer
        return None
    shard = param.padded_shard
    return shard if shard.device.type == "cpu" else None


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` itself, or a tensor subclass's inner plain tensors (``__tensor_flatten__``: NF4's codes and
    scales), recursively."""
    if type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _plain_tensors(getattr(tensor, name))]


def _count(seen: dict[int, tuple[str, int, str]], tensor: torch.Tensor, kind: str, pinning: str) -> None:
    storage = tensor.untyped_storage()
    seen.setdefault(storage.data_ptr(), (kind, storage.nbytes(), pinning))
