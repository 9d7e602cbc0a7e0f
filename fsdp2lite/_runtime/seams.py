"""Typed seams: what runtime modules need of a group without importing ``group.py`` (which imports them).

A module that keeps state beside a group (ZeRO-1/2's resident storage, HFSDP's replica collectives, host
masters, the host arena, NVMe state) sees the group through ``GroupView``: its parameters, its mesh, its
``Comm`` and its trace. ``FSDPParamGroup`` satisfies it structurally; mypy checks every use.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from ..mesh import MeshInfo
from .comm import Comm
from .param import FSDPParam


class Refresher(Protocol):
    """Where a group's shards are rebuilt from before its all-gather (HFSDP's replica pieces, host masters)."""

    def refresh(self) -> None:
        """Bring the shards the all-gather reads up to date (before an unshard from the sharded state)."""
        ...

    def invalidate(self) -> None:
        """Rebuild every shard at the next refresh."""
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
