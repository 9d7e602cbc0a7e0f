"""What the CUDA caching allocator reserves for a step, next to what the step allocates.

A user's OOM comes from reserved memory (``torch.cuda.max_memory_reserved``), not from the tensors alive
at once (``max_memory_allocated``): freed blocks stay cached in their segments and serve only requests
that fit, and only on the stream that allocated them. Measured on an H100 (fsdp2lite, world 8, torch
2.11): reserved / allocated 1.26 for Llama-3-8B at 1x2048 and 1.06 for Llama-3.2-1B at 4x2048.

``simulate`` records every allocation and free of its measured step (``AllocationRecorder``, fed by the
memory tracker) with the stream the CUDA runtime would make it on: fsdp2lite allocates its side-stream
buffers inside ``Comm.on(name)`` (the all-gather output on ``all_gather_copy_in``), so the recorder tags
what is allocated in there with ``name``. Tensors alive before the step (parameters, optimizer state)
come first, as allocations in the order the tracker meets them. ``allocator.replay`` then runs them
through the model of the caching allocator, with and without ``expandable_segments``, and the estimate
reports ``reserved_bytes = peak_bytes x`` the replay's reserved / allocated ratio (the ratio, so NF4's and
offload's corrections to the peak carry over).

``analytic`` has no event list: it applies ``ANALYTIC_RATIO`` per the peak's phase (docs/estimate.md
"Reserved memory" shows where it comes from), a rough figure, said so in its notes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .allocator import AllocatorPeak, replay

ADVICE = (
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets freed blocks of one stream serve any later "
    "request of it (reserved {expandable} instead of {reserved})"
)
WORTH_ADVISING = 1.05  # expandable segments are advised where they save at least 5% of the reserved peak


@dataclass(frozen=True)
class Reserved:
    """The reserved peak predicted for a step, with and without expandable segments."""

    reserved_bytes: int
    expandable_bytes: int
    ratio: float  # reserved / allocated of the replay (or the analytic ratio)
    advice: str | None  # the allocator setting to use, when it helps


class AllocationRecorder:
    """Alloc and free events of tracked storages, in order, each tagged with the stream of the
    ``Comm.on`` block it happened in ("compute" outside every block)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, str]] = []
        self.stream = "compute"
        self._keys: dict[int, int] = {}  # id(tracker's storage record) -> event key
        self._next = 0

    def added(self, record: Any, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self._keys[id(record)] = key = self._next
        self._next += 1
        self.events.append(("alloc", key, nbytes, self.stream))

    def deleted(self, record: Any) -> None:
        key = self._keys.pop(id(record), None)
        if key is not None:
            self.events.append(("free", key, 0, self.stream))

    def resized(self, record: Any, nbytes: int) -> None:
        self.deleted(record)
        self.added(record, nbytes)

    def replay(self) -> tuple[AllocatorPeak, AllocatorPeak]:
        """(default allocator, expandable segments) over the recorded events."""
        return replay(self.events), replay(self.events, expandable_segments=True)


@contextmanager
def streams_tagged(recorder: AllocationRecorder) -> Iterator[None]:
    """While inside, allocations within fsdp2lite's ``Comm.on(name)`` blocks are tagged ``name``."""
    from .._runtime.comm import Comm

    original: Callable[..., Any] = Comm.on

    @contextmanager
    def on(self: Comm, name: str) -> Iterator[None]:
        outer, recorder.stream = recorder.stream, name
        try:
            with original(self, name):
                yield
        finally:
            recorder.stream = outer

    Comm.on = on  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Comm.on = original  # type: ignore[method-assign]


def from_replay(peak_bytes: int, default: AllocatorPeak, expandable: AllocatorPeak) -> Reserved:
    """The estimate's reserved figures from a replay of its step."""
    allocated = max(1, default.allocated_peak)
    ratio = default.reserved_peak / allocated
    reserved = int(peak_bytes * ratio)
    grown = int(peak_bytes * expandable.reserved_peak / allocated)
    return Reserved(reserved, grown, ratio, _advice(reserved, grown))


# analytic: reserved / allocated by the phase of the peak (see the module docstring)
ANALYTIC_RATIO = {"forward": 1.10, "backward": 1.15, "optimizer": 1.10}
ANALYTIC_EXPANDABLE = 1.02


def from_ratio(peak_bytes: int, phase: str) -> Reserved:
    """The analytic estimate's reserved figures: ``ANALYTIC_RATIO`` of its phase."""
    ratio = ANALYTIC_RATIO.get(phase, max(ANALYTIC_RATIO.values()))
    reserved, grown = int(peak_bytes * ratio), int(peak_bytes * ANALYTIC_EXPANDABLE)
    return Reserved(reserved, grown, ratio, _advice(reserved, grown))


def _advice(reserved: int, expandable: int) -> str | None:
    if reserved < expandable * WORTH_ADVISING:
        return None
    return ADVICE.format(reserved=_gib(reserved), expandable=_gib(expandable))


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
