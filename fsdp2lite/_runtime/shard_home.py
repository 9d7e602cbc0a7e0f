"""Where a parameter's padded shard lives: on its device, or on the host under ``CPUOffloadPolicy``.

[Note: shard home]
Whether a parameter is offloaded is decided once, where its storage is chosen (``storages.param_storage``):
its ``ShardStorage`` is given a home, ``DeviceHome`` or ``HostHome``, and every place that used to ask "is
it offloaded?" asks the home instead, which answers without a branch:

    padded          a zeroed padded shard for a new local tensor: on the local tensor's device, or on the
                    host (pinned by itself only where it stays outside its group's host buffer, HFSDP's
                    chunks: [Note: one host buffer per group] in host_arena.py, [Note: pinning fails])
    hooked          a hooked parameter's shard (a tensor subclass): as made, or moved to the host by the
                    subclass's own ``cpu()`` and ``pin_memory()`` ([Note: offloaded hooked parameters])
    gather_source   what a hooked parameter's pre-all-gather hook is called on: the shard, or its copy on
                    the compute device
    compute_device  where the parameter is computed on: its shard's device, or the mesh's

``on_host`` remains for what is a fact about the whole group rather than a parameter: a byte all-gather
runs its copy-in on the copy-in stream when the shards first cross to the device, and the group's host
storage ([Note: host storage] in host_storage.py) is made for host shards. The home never changes after
``fully_shard``; a renewed shard (``to_empty``, ``module.to``, an assigning load) is made by the same home.
"""

from __future__ import annotations

import torch

from .extension import AllGatherExtension
from .pinned import host_buffer


class DeviceHome:
    """A shard on the device its parameter is on (ZeRO-3, HSDP, HFSDP, and host masters' device shards)."""

    on_host = False  # the shards cross to the compute device at every all-gather
    grads_on_host = False  # the reduced gradients are stored on the host
    pin = False  # host memory pinned (host homes on a CUDA mesh that asked)

    def padded(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, alone: bool) -> torch.Tensor:
        """A zeroed padded shard for a local tensor on ``device`` (``alone``: pinned by itself if on the host)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def hooked(self, padded: torch.Tensor) -> torch.Tensor:
        """A hooked parameter's padded shard, made by its subclass, where it lives."""
        return padded

    def gather_source(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """What a hooked parameter's pre-all-gather hook is called on, for compute ``device``."""
        return shard

    def compute_device(self, mesh_device: torch.device, shard: torch.Tensor) -> torch.device:
        """Where the parameter is computed on (its unsharded storage, its unsharded gradient)."""
        return shard.device


class HostHome(DeviceHome):
    """A shard on the host (``CPUOffloadPolicy()``): pinned when ``pin`` (a CUDA mesh that asked), the
    all-gather's copy-in crossing to the mesh's device ([Note: shard home])."""

    on_host = True
    grads_on_host = True

    def __init__(self, pin: bool) -> None:
        self.pin = pin

    def padded(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, alone: bool) -> torch.Tensor:
        if device.type == "meta":
            return torch.zeros(shape, dtype=dtype, device=device)  # materialized (and then moved) by to_empty
        if self.pin and alone:  # [Note: pinning fails]
            return host_buffer(shape, dtype, pin=True, zero=True)
        return torch.zeros(shape, dtype=dtype)  # packed into its group's host buffer, pinned there

    def hooked(self, padded: torch.Tensor) -> torch.Tensor:
        return AllGatherExtension.to_host(padded, self.pin)  # [Note: offloaded hooked parameters]

    def gather_source(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        return AllGatherExtension.to_device(shard, device)  # [Note: offloaded hooked parameters]

    def compute_device(self, mesh_device: torch.device, shard: torch.Tensor) -> torch.device:
        return mesh_device


DEVICE = DeviceHome()  # stateless: one for every parameter on its device
