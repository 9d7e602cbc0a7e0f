"""Typed seams: what runtime modules need of a group without importing ``group.py`` (which imports them).

A module that keeps state beside a group (ZeRO-1/2's resident storage, HFSDP's replica collectives, host
masters, the host arena, NVMe state) sees the group through ``GroupView``: its parameters, its mesh, its
``Comm`` and its trace. ``FSDPParamGroup`` satisfies it structurally; mypy checks every use.

[Note: group storage]
Where a group's shards live is decided at ``fully_shard`` and never re-tested per call: ZeRO-3 is the
group with no storages; each other stage adds one ``GroupStorage`` (``_stages.apply_sharding``), which
the group calls at four fixed points and which never writes the group's state:

    before_gather   unshard, from the sharded state: refresh the shards (HFSDP's replica all-gather, host
                    masters' copy to the device); ZeRO-1/2: True when the kept storage is current (no all-gather)
    gathered        the group went UNSHARDED: ZeRO-1/2 records the shards' versions
    on_reset        reset_sharded_params: ZeRO-1/2 forgets, the others forget only if a shard was renewed
    invalidate      an explicit reshard (model.reshard()): nothing kept is trusted

Those that keep the unsharded storage (ZeRO-1/2) are asked last, after every refresh. The parameter half of
the same question (what each parameter registers) is its ``ShardStorage`` ([Note: shard storage], param.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from ..mesh import MeshInfo
from .comm import Comm
from .param import FSDPParam


class GroupStorage(Protocol):
    """Where a group's shards live beyond ZeRO-3's, called by the group at fixed points ([Note: group storage]):
    ZeRO-1/2's kept unsharded storage (``zero.Resident``), HFSDP's replica pieces (``replicas.ReplicaSync``),
    host masters (``host_masters.HostSync``). None of them writes the group's state."""

    keeps_unsharded: bool  # a reshard keeps the unsharded storage (unless freed explicitly)

    def before_gather(self) -> bool:
        """Before an all-gather from the sharded state: bring the shards it reads up to date; True when the kept
        unsharded storage already holds them (the group then skips the all-gather)."""
        ...

    def gathered(self) -> None:
        """The unsharded parameters now hold the current shards."""
        ...

    def on_reset(self, renewed: bool) -> None:
        """``reset_sharded_params`` ran (``renewed``: some parameter took in a new local tensor)."""
        ...

    def invalidate(self) -> None:
        """An explicit reshard (``model.reshard()``): nothing kept is trusted; everything is rebuilt at next use."""
        ...


class GroupView(Protocol):
    """The part of ``FSDPParamGroup`` its companions read."""

    name: str
    params: tuple[FSDPParam, ...]
    mesh_info: MeshInfo

    @property
    def comm(self) -> Comm: ...

    def trace(self, event: str) -> None: ...

    def trace_span(self, event: str) -> AbstractContextManager[None]: ...
