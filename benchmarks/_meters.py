"""Meters for one training step, shared by the benchmarks: tracked peak memory and c10d collectives.

``tracked_peak(step, model, optimizer)`` runs ``step()`` under torch's ``MemTracker`` and returns the
bytes per category at the moment the tracked Total peaked; ``count_collectives(step)`` runs it under
``CollectiveCounter`` and returns calls and bytes per c10d op; ``count_ops(step)`` counts every aten op
dispatched (the host work a step asks of torch, independent of timing noise); ``time_ops(step, n)`` times it,
per op kind (where that host work goes).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class CommStats:
    """Collectives of one step, by c10d op name (e.g. ``c10d::_allgather_base_``)."""

    calls: Counter[str] = field(default_factory=Counter)
    nbytes: Counter[str] = field(default_factory=Counter)


def _tensor_bytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives and the bytes of each one's full-size buffer.

    Counted bytes per call (per rank, what the collective logically covers, not bytes on the wire):
        all-gather      the output (world_size x this rank's input),
        reduce-scatter  the input (world_size x this rank's output),
        all-reduce and anything else (broadcast, ...)  the tensors it works on in place.
    Worked example, 2 ranks, a 4-element fp32 gradient: reduce-scatter input [1,2,3,4] (16 bytes
    counted) -> output [a,b] on rank 0; all-gather of the 2-element shards -> 16 bytes counted.
    On a ring each rank sends (ws - 1) / ws of that for all-gather and reduce-scatter and
    2 (ws - 1) / ws for all-reduce. Functional collectives' ``wait_tensor`` is not a collective.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stats = CommStats()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = func._schema.name  # e.g. "c10d::_allgather_base_"
        if "c10d" in name and "wait" not in name:
            self.stats.calls[name] += 1
            self.stats.nbytes[name] += self._payload(name, args, result)
        return result

    @staticmethod
    def _payload(name: str, args: tuple[Any, ...], result: Any) -> int:
        functional = "functional" in name  # out-of-place: the output is the result
        if "allgather" in name or "all_gather" in name:
            return _tensor_bytes(result if functional else args[0])
        if "reduce_scatter" in name:
            return _tensor_bytes(args[0] if functional else args[1])
        return _tensor_bytes(args[0])


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches the dispatcher below Python, by name (``aten::copy_``, ...).

    Each is host work on any device (argument parsing, dispatch, a kernel launch on CUDA), so the
    count is a noise-free proxy for a step's host time: a per-parameter loop shows up as N ops."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.calls[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class OpTimer(TorchDispatchMode):
    """Host seconds spent below Python in each op kind, and its calls: where a step's host time goes, op by op
    (under ``FakeTensorMode``: the fake dispatch, its cache lookup or the miss that runs the meta kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[func._schema.name] += time.perf_counter() - start
        self.calls[func._schema.name] += 1
        return out


def time_ops(step: Callable[[], object], steps: int) -> dict[str, tuple[float, float]]:
    """Per op kind: (host ms per step, calls per step) over ``steps`` steps."""
    with OpTimer() as timer:
        for _ in range(steps):
            step()
    return {name: (1e3 * timer.seconds[name] / steps, timer.calls[name] / steps) for name in timer.calls}


def count_ops(step: Callable[[], object]) -> Counter[str]:
    with OpCounter() as counter:
        step()
    return counter.calls


def count_collectives(step: Callable[[], None]) -> CommStats:
    with CollectiveCounter() as counter:
        step()
    return counter.stats


def tracked_peak(step: Callable[[], None], *external: nn.Module | torch.optim.Optimizer) -> dict[str, int]:
    """Bytes by MemTracker category ("Parameter", ..., "Total") when ``step()``'s tracked Total peaked."""
    # An earlier tracker's reference cycles can hold freed tensors until the collector runs.
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        step()
    peak: Counter[str] = Counter()
    for device, device_snapshot in tracker.get_tracker_snapshot("peak").items():
        if torch.device(device).type == "meta":
            continue  # meta tensors take no memory (torch's fully_shard makes some too)
        # keys are "Total" and _MemRefType members whose values are the names: "Parameter", ...
        peak.update({str(getattr(category, "value", category)): nbytes for category, nbytes in device_snapshot.items()})
    return dict(peak)
