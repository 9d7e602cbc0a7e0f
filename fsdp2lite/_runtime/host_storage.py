"""The group storage of CPU offload: an offloaded group's host memory, owned in one place.

[Note: host storage]
A group whose shards live on the host (``CPUOffloadPolicy()``) has a ``HostShards`` among its storages
([Note: group storage] in seams.py), chosen with the others from its plan (``storages.group_storages``); a group
whose masters do (``optimizer_only=True``) has ``HostSync``, which holds one ([Note: host masters] in
host_masters.py). It owns what the host side costs the group:
- the group's one host buffer (``arena``: [Note: one host buffer per group] in host_arena.py), packed when the
  group is made and packed anew after ``reset_sharded_params`` renewed the host tensors (``on_reset``);
  pinned when the policy asked (``pin``).
The groups without host memory have no such storage, so nothing else in the group tests for offload.
"""

from __future__ import annotations

from .host_arena import HostArena, pack_host_shards
from .seams import GroupView


class HostShards:
    """An offloaded group's host buffer ([Note: host storage]); a ``GroupStorage`` that never skips an all-gather."""

    keeps_unsharded = False
    arena: HostArena | None  # None: nothing packed (no plain shard on the host, or still on meta)

    def __init__(self, group: GroupView, pin: bool) -> None:
        self.group, self.pin = group, pin
        self.arena = pack_host_shards(group, None, pin)

    def before_gather(self) -> bool:
        return False  # the all-gather reads the host shards (the host masters' copy is HostSync's)

    def gathered(self) -> None:
        return None

    def on_reset(self, renewed: bool) -> None:
        self.arena = pack_host_shards(self.group, self.arena, self.pin)  # renewed host tensors: packed anew

    def invalidate(self) -> None:
        return None
