"""The schedule recorder: what the runtime did, in order, with times. Off by default and free when off
(every call site checks ``meters.recorder is not None``).

Events, per group (``name`` of the event):
    all_gather_issue      instant   an all-gather was started (own unshard or a prefetch)
    all_gather_wait       span      the compute side waited for that all-gather: exposed communication
    forward / backward    instant   the group's compute is about to start (after its prefetches)
    reshard               instant   unsharded parameters freed
    reduce_scatter_issue  instant   gradients handed to the reduce-scatter
    reduce_scatter_wait   span      waited for the reduce-scatter (and, HSDP, its all-reduce)
    host_step             span      the group's step inside backward (``step_in_backward``): on the host-step
                                    thread, drawn in a lane of its own ("host steps"), or in backward's thread
    host_step_wait        span      backward's thread waited for host steps in flight (the group is the last one
                                    waited for): the host step's exposed part ([Note: host steps off backward's
                                    thread] in fsdp2lite/host/steps.py)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPAN_EVENTS = ("all_gather_wait", "reduce_scatter_wait", "host_step", "host_step_wait")
HOST_LANE = "host steps"  # the Chrome trace lane of the host-step thread's events


@dataclass(frozen=True)
class TraceEvent:
    name: str
    group: str  # module path of the group; "<root>" for the root
    state: str  # the group's TrainingState when it happened
    start_s: float  # seconds since the recorder started
    duration_s: float  # 0 for instants
    lane: str = ""  # the Chrome trace lane ("tid") when not the group's: HOST_LANE for the host-step thread


class Meters:
    """What a root measures while asked to, free when not: the trace recorder (``fl.record_trace``) and the bytes
    each collective kind sent (``fl.count_wire_bytes``). One per root, shared by its groups like ``Comm``, which
    carries the collectives and measures nothing."""

    recorder: TraceRecorder | None  # None: tracing off, and free
    wire: dict[str, int] | None  # while set: bytes this rank sent, per collective kind

    def __init__(self) -> None:
        self.recorder = None
        self.wire = None

    def count(self, kind: str, sent: int) -> None:
        """Record ``sent`` bytes leaving this rank in a ``kind`` collective (free when not counting)."""
        if self.wire is not None:
            self.wire[kind] = self.wire.get(kind, 0) + sent


class TraceRecorder:
    """Collects ``TraceEvent``s; exports Chrome trace JSON (Perfetto opens it)."""

    events: list[TraceEvent]
    rank: int
    schedule: dict[str, Any]  # the root's schedule settings and device when recording started ({} until known)

    def __init__(self, rank: int = 0) -> None:
        self.events = []
        self.rank = rank
        self.schedule = {}
        self._t0 = time.perf_counter()

    def instant(self, name: str, group: str, state: str) -> None:
        self.events.append(TraceEvent(name, group, state, time.perf_counter() - self._t0, 0.0))

    @contextmanager
    def span(self, name: str, group: str, state: str, lane: str = "") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.events.append(TraceEvent(name, group, state, start - self._t0, end - start, lane=lane))

    def names(self, group: str | None = None) -> list[str]:
        """Event names in order, optionally of one group: handy for asserting a schedule."""
        return [e.name for e in self.events if group is None or e.group == group]

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event format: spans as complete events ("X"), the rest as instants ("i")."""
        trace = []
        for event in self.events:
            entry: dict[str, Any] = {
                "name": event.name,
                "cat": "fsdp2lite",
                "ts": event.start_s * 1e6,
                "pid": self.rank,
                "tid": event.lane or event.group,
                "args": {"group": event.group, "state": event.state},
            }
            if event.name in SPAN_EVENTS:
                entry.update(ph="X", dur=event.duration_s * 1e6)
            else:
                entry.update(ph="i", s="t")
            trace.append(entry)
        other = {"fsdp2lite_events": len(trace), "fsdp2lite_schedule": self.schedule}
        return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": other}

    def save_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(event) for event in self.events]
