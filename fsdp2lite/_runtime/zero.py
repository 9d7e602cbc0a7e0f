"""ZeRO-1/2 groups: unsharded parameters resident between steps, gathered again only when the shards changed.

[Note: resident groups]
A group under ``ShardingPolicy(shard="optimizer")`` runs as a ZeRO-3 group whose unsharded storage is never
freed: it keeps its parameters through forward and backward (``reshard_after_forward`` is False), and after
backward registers the sharded DTensors on the modules again (so ``model.parameters()``, the optimizer,
``clip_grad_norm_`` and checkpoints see shards with their reduce-scattered gradients, as under ZeRO-3) while
the unsharded values stay in place. The next ``unshard`` then skips the all-gather when the shards are the
ones it gathered: each shard's autograd version counters (the DTensor's and its local tensor's) are
recorded when its all-gather completes, and every in-place change through the parameter or its local tensor
(``optimizer.step()``, ``copy_``, ``load_state_dict``, a DCP load) bumps one of them, so the first forward
after a step all-gathers each group once and every other unshard is free.
Writes that bypass autograd's version counters (through ``.data``) are not seen: ``model.reshard()`` frees
the storage, so the next forward gathers anew. Per step: one all-gather and one reduce-scatter per group.

[Note: fused steps bump no version]
torch's fused optimizer kernels (``AdamW(fused=True)``, on CUDA and on CPU) write the parameters without
moving their version counters, so a resident group (and a replica-sharded or host-master one) would not see
such a step and would run the next forward on the old weights. A global optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``, registered once, when the first such group is
made) therefore moves the version counter of every fsdp2lite sharded parameter the stepped optimizer holds
that has a gradient (an optimizer leaves the others as they are): whatever the kernel, the step is seen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .identity import sharded_param_ids
from .seams import GroupView, ReducedGrads


def shard_versions(param: Any) -> tuple[int, int]:
    """A sharded parameter's version counters: the DTensor's (bumped by in-place ops through it, such as the
    optimizer's: DTensor runs them on its local tensor below autograd, which bumps only the outer counter)
    and its local tensor's (bumped by writes to it directly, such as a sharded weight load)."""
    return param.sharded_param._version, param.sharded_param._local_tensor._version


class ShardWatch:
    """Which of ``params``' registered shards changed since ``record()`` (their version counters moved),
    or all of them once ``stale`` is set: what HFSDP's and host masters' refreshes copy from."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.record()

    def due(self) -> list[Any]:
        if self.stale:
            return list(self.params)
        return [param for param in self.params if self.versions[id(param)] != shard_versions(param)]

    def record(self) -> None:
        """Every shard as it is now is the one refreshed from."""
        self.stale = False
        self.versions = {id(param): shard_versions(param) for param in self.params}


class ShardRefresher:
    """A group storage that rebuilds the shards the all-gather reads from where the optimizer stepped
    (HFSDP's ``ReplicaSync``, host masters' ``HostSync``), the shards in ``watch`` ([Note: group storage])."""

    keeps_unsharded = False
    watch: ShardWatch

    def refresh(self) -> None:
        """Rebuild the shards ``watch`` says are due (none: nothing)."""
        raise NotImplementedError

    def before_gather(self) -> bool:
        self.refresh()
        return False

    def gathered(self) -> None:
        return None

    def on_reset(self, renewed: bool) -> None:
        if renewed:
            self.invalidate()  # the shards the all-gather reads may hold old values

    def invalidate(self) -> None:
        """Rebuild every shard at the next refresh."""
        self.watch.stale = True

    def after_reduce(self, reduced: ReducedGrads, reads_now: bool) -> ReducedGrads:
        return reduced  # stored beside the shards

    def end_backward(self) -> None:
        return None


class Resident:
    """The freshness of a resident group's unsharded storage ([Note: resident groups])."""

    def __init__(self, group: GroupView) -> None:
        self.group = group
        self.versions: tuple[tuple[int, int], ...] | None = None  # the shards' versions when last gathered
        self.skipped = 0  # all-gathers skipped because the storage was fresh (tests and trace read it)

    def _current(self) -> tuple[tuple[int, int], ...]:
        return tuple(shard_versions(param) for param in self.group.params)

    keeps_unsharded = True  # [Note: group storage]

    def before_gather(self) -> bool:
        """Whether the kept unsharded storage holds the current shards (the group then registers it and skips
        its all-gather); False: gather."""
        if self.versions is None or self.versions != self._current():
            return False
        self.skipped += 1
        return True

    def on_reset(self, renewed: bool) -> None:
        self.invalidate()  # the sharded parameters may be new tensors

    def gathered(self) -> None:
        """The all-gather just completed holds the shards as they are now."""
        self.versions = self._current()

    def invalidate(self) -> None:
        """The storage no longer holds the shards' values (freed, or the sharded parameters were reset)."""
        self.versions = None

    def after_reduce(self, reduced: ReducedGrads, reads_now: bool) -> ReducedGrads:
        return reduced  # stored beside the shards

    def end_backward(self) -> None:
        return None


_watching: list[Any] = []  # the one hook handle, once registered


def watch_optimizer_steps() -> None:
    """Register, once per process, the optimizer step post-hook of [Note: fused steps bump no version]."""
    if not _watching:
        _watching.append(register_optimizer_step_post_hook(_mark_stepped))


def _mark_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Move the version counter of each fsdp2lite sharded parameter ``optimizer`` just stepped (those with a
    gradient), so a fused kernel's in-place writes are seen like any other ([Note: fused steps bump no version])."""
    ours = sharded_param_ids()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and id(param) in ours:
                torch.autograd.graph.increment_version(param)
