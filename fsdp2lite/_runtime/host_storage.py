"""The group storage of CPU offload: an offloaded group's host memory, owned in one place.

[Note: host storage]
A group whose shards live on the host (``CPUOffloadPolicy()``) has a ``HostShards`` among its storages
([Note: group storage] in seams.py), chosen with the others from its plan (``storages.group_storages``); a group
whose masters do (``optimizer_only=True``) has ``HostSync``, which holds one ([Note: host masters] in
host_masters.py). It owns what the host side costs the group:
- the group's one host buffer (``arena``: [Note: one host buffer per group] in host_arena.py), packed when the
  group is made and packed anew after ``reset_sharded_params`` renewed the host tensors (``on_reset``);
  pinned when the policy asked (``pin``);
- the reduced gradients' copy to the host (``after_reduce``): from a device, one copy of the group's whole
  reduced output into a buffer of the host engine's pool ([Note: host gradient buffers] in
  fsdp2lite/host/grad_pool.py), pinned when asked; non-blocking when the buffer is pinned and nothing reads
  the copy at once, and then an event recorded after it on the compute stream, handed to the host engine (a
  host step waits on it) and kept (``copy_event``);
- the step's one host wait (``end_backward``): the end of the last backward synchronizes on the last such
  event, since ``optimizer.step()`` reads the host gradients. On a CPU mesh the gradients are on the host
  already: no copy, no event.
The groups without host memory have no such storage, so nothing else in the group tests for offload.
"""

from __future__ import annotations

import torch

from .host_arena import HostArena, pack_host_shards
from .seams import GroupView, ReducedGrads


class HostShards:
    """An offloaded group's host buffer ([Note: host storage]); a ``GroupStorage`` that never skips an all-gather."""

    keeps_unsharded = False
    arena: HostArena | None  # None: nothing packed (no plain shard on the host, or still on meta)
    copy_event: torch.cuda.Event | None  # the last asynchronous gradient copy to the host, until end_backward

    def __init__(self, group: GroupView, pin: bool) -> None:
        self.group, self.pin = group, pin
        self.arena = pack_host_shards(group, None, pin)
        self.copy_event = None

    def before_gather(self) -> bool:
        return False  # the all-gather reads the host shards (the host masters' copy is HostSync's)

    def gathered(self) -> None:
        return None

    def on_reset(self, renewed: bool) -> None:
        self.arena = pack_host_shards(self.group, self.arena, self.pin)  # renewed host tensors: packed anew

    def invalidate(self) -> None:
        return None

    def after_reduce(self, reduced: ReducedGrads, reads_now: bool) -> ReducedGrads:
        """The reduced gradients copied to a host buffer of the engine's pool ([Note: host storage])."""
        flat = reduced.flat
        if flat.device.type == "cpu":
            return reduced  # a CPU mesh: already on the host
        buffer = self.group.host.grad_buffer(flat.numel(), flat.dtype, self.pin)  # [Note: host gradient buffers]
        # async only when nothing reads the host copy at once (torch's blocks there too)
        asynchronous = buffer.is_pinned() and not reads_now
        flat = buffer.copy_(flat, non_blocking=asynchronous)
        if not asynchronous:
            return ReducedGrads(flat, None)
        self.copy_event = torch.cuda.Event()
        self.copy_event.record()  # after the copy on the compute stream: waited at the end of backward
        return ReducedGrads(flat, self.copy_event)

    def end_backward(self) -> None:
        if self.copy_event is not None:
            self.copy_event.synchronize()  # the one host wait of a step: optimizer.step() reads the host grads
            self.copy_event = None
