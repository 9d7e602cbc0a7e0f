"""Typed seams: what runtime modules need of a group without importing ``group.py`` (which imports them).

A module that keeps state beside a group (ZeRO-1/2's resident storage, HFSDP's replica collectives, host
masters, CPU offload's host shards, NVMe state) sees the group through ``GroupView``: its parameters, its mesh, its
``Comm``, its ``Meters`` and its trace. ``FSDPParamGroup`` satisfies it structurally; mypy checks every use. The
runtime in turn sees the host engine, which lives outside it, through ``HostSide`` ([Note: the host engine]).

[Note: group storage]
Where a group's shards live is decided at ``fully_shard`` and never re-tested per call: ZeRO-3 is the
group with no storages; each other stage adds one ``GroupStorage`` (chosen by ``storages.group_storages`` in the
group's constructor, from its plan), which the group calls at six fixed points and which never writes the
group's state:

    before_gather   unshard, from the sharded state: refresh the shards (HFSDP's replica all-gather, host
                    masters' copy to the device); ZeRO-1/2: True when the kept storage is current (no all-gather)
    gathered        the group went UNSHARDED: ZeRO-1/2 records the shards' versions
    on_reset        reset_sharded_params: ZeRO-1/2 forgets, the others forget only if a shard was renewed; host
                    shards and masters pack renewed host tensors into a new host buffer ([Note: host storage])
    invalidate      an explicit reshard (model.reshard()): nothing kept is trusted
    after_reduce    a reduction's result is final (divided, the all-reduce hook run, cast to the parameters'
                    dtype): where the gradients are stored from now; host shards and masters copy them to the
                    host and keep the copy's event ([Note: host storage])
    end_backward    the end of the last backward: what a storage moved is ready for the optimizer (host
                    shards and masters: the step's one host wait, on the last copy's event)

Those that keep the unsharded storage (ZeRO-1/2) are asked last, after every refresh. The parameter half of
the same question (what each parameter registers) is its ``ShardStorage`` ([Note: shard storage], param.py).

[Note: the host engine]
What runs on the host beside the runtime (the pinned pool reduced gradients land in under CPU offload, the
worker thread of ``step_in_backward``'s host steps, optimizer state on NVMe) is not the runtime's: it lives in
``fsdp2lite/host/``, which imports the runtime, never the reverse. The runtime calls it through ``HostSide`` at
six points: once when a group is made, the others in the post-backward path or at the ends of a pass:

    keep_state_in_files  a group planned with ``optimizer="nvme"`` is made: its parameters' optimizer state lives
                     in files between steps ([Note: optimizer state on NVMe] in host/nvme.py)

    wait_for         before an all-gather reads a group's shards, and before a reduction adds into its
                     gradients: a host step still stepping them must finish first
    grad_buffer      a reduction copies an offloaded group's gradients to the host: the buffer they land in
    run_grad_hooks   the gradients are in ``.grad``: the parameters' post-accumulate-grad hooks run (an
                     optimizer stepping in backward), in backward's thread or on the engine's worker
    end_backward     the end of every backward: every host step has finished
    abandon          an exception mid-step: wait for the steps in flight, their errors become warnings

Each group holds one from construction (``fully_shard`` makes it); the root's lazy init hands its own to every
group of the tree (one pool, one worker per root, or per ``share_comm_ctx`` set of roots), as it does ``Comm``,
and hands it the root's ``Meters`` once (``measure_with``): the engine reads the trace recorder there, so tracing
is switched on and off in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn

from ..mesh import MeshInfo
from ..policies import CommPolicy, ShardingPolicy
from .comm import Comm
from .param import FSDPParam
from .trace import Meters


class ReducedGrads(NamedTuple):
    """A group's reduced gradients where they are stored: ``(numel,)`` (in the parameters' dtype where they share
    one), and the event that marks the end of their copy there (None: usable at once)."""

    flat: torch.Tensor
    copy_event: torch.cuda.Event | None


class GroupStorage(Protocol):
    """Where a group's shards live beyond ZeRO-3's, called by the group at fixed points ([Note: group storage]):
    ZeRO-1/2's kept unsharded storage (``zero.Resident``), HFSDP's replica pieces (``replicas.ReplicaSync``),
    host masters (``host_masters.HostSync``), CPU offload's host shards (``host_storage.HostShards``). None of
    them writes the group's state."""

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

    def after_reduce(self, reduced: ReducedGrads, reads_now: bool) -> ReducedGrads:
        """The group's reduced gradients are final: where they are stored from now (``reads_now``: the host reads
        them at once, to add into kept gradients or cast them one by one, so a copy must have landed)."""
        ...

    def end_backward(self) -> None:
        """The end of the last backward: the gradients this storage moved are where the optimizer reads them."""
        ...


class GroupView(Protocol):
    """The part of ``FSDPParamGroup`` its companions read."""

    name: str
    params: tuple[FSDPParam, ...]
    mesh_info: MeshInfo

    @property
    def comm(self) -> Comm: ...

    meters: Meters  # the root's, after lazy init: what the companions' collectives send is counted there
    host: HostSide  # the host engine, the root's after lazy init: offloaded gradients land in its pool

    def trace(self, event: str) -> None: ...

    def trace_span(self, event: str) -> AbstractContextManager[None]: ...


class HostSide(Protocol):
    """What the runtime asks of the host engine (``fsdp2lite.host.HostEngine``): [Note: the host engine]."""

    def keep_state_in_files(self, group: GroupView) -> None:
        """Keep the optimizer state of ``group``'s parameters in files under their policy's ``nvme_path`` between
        steps ([Note: optimizer state on NVMe]); called once, by the group's constructor."""
        ...

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Return once no host step in flight reads or writes these sharded parameters or their gradients."""
        ...

    def grad_buffer(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A ``(numel,)`` host tensor of ``dtype`` (pinned when ``pin``) for a group's reduced gradients, held by
        nothing else until the gradients viewing it are dropped."""
        ...

    def run_grad_hooks(
        self, params: list[torch.Tensor], copy_event: torch.cuda.Event | None, group: str, device: torch.device
    ) -> None:
        """Run the post-accumulate-grad hooks of group ``group``'s sharded ``params`` (their reduced gradients are
        in ``.grad``; on the host once ``copy_event`` completes); ``device``: the mesh's."""
        ...

    def end_backward(self) -> None:
        """The end of a backward: return once every host step submitted has finished (raise the first error)."""
        ...

    def abandon(self) -> None:
        """An exception mid-step: wait for the steps in flight; an error of theirs becomes a warning."""
        ...

    def measure_with(self, meters: Meters) -> None:
        """Record host steps and the waits for them with ``meters``' trace recorder, whenever it has one (the root's
        Meters, handed over once at lazy init)."""
        ...


class PlannedSettings(Protocol):
    """The runtime's view of a planned group's settings (``_plan.GroupSettings``, checked by the plan)."""

    @property
    def comm(self) -> CommPolicy | None: ...

    @property
    def sharding(self) -> ShardingPolicy | None: ...

    @property
    def reshard_as_built(self) -> bool | int | None: ...


class PlannedGroup(Protocol):
    """The runtime's view of a planned, checked group (``_plan.GroupSpec``): what ``FSDPParamGroup`` is made from
    ([Note: one plan]). The runtime never imports the plan; ``GroupSpec`` satisfies this structurally."""

    @property
    def modules(self) -> tuple[nn.Module, ...]: ...

    @property
    def settings(self) -> PlannedSettings: ...


@dataclass(frozen=True)
class GroupContext:
    """What a new group is given beside its plan and parameters: its mesh, and a host engine of its own until the
    root's lazy init hands it the root's ([Note: the host engine])."""

    mesh_info: MeshInfo
    host: HostSide
