"""The memory tracker the planner counts with: torch's ``MemTracker`` ([Note: local shards] in ``simulate``).

It counts only what ops on local shards allocate (nothing while DTensor propagates shapes), hooks no frozen
parameter (torch's would hook every parameter's gradient, and a frozen one refuses), feeds an
``AllocationRecorder`` every storage it adds, frees or resizes, and at each op updates the peaks of the modules
running then only: torch's own walks every module it has seen, through weak references, at every op (most of a
traced step's time on a model of many modules; ``tests/test_estimate.py`` checks the peaks are torch's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import torch.nn as nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from .reserved import AllocationRecorder


class _NoHook:
    """A hook handle for a parameter that gets no hook (frozen)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class LocalShardTracker(MemTracker):
    """torch's ``MemTracker`` as the planner counts with it (the module docstring)."""

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


@contextmanager
def local_shard_tracker() -> Iterator[Any]:
    """torch's ``MemTracker``, entered, counting only what the ops on local shards allocate
    ([Note: local shards])."""
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
