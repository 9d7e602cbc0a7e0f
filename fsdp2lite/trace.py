"""Recording what the runtime does: ``record_trace(model)``, Chrome trace export, and summaries.

    with fl.record_trace(model) as trace:
        loss = model(x).sum(); loss.backward()
    trace.save_chrome_trace("step.json")          # open in https://ui.perfetto.dev
    print(summarize(trace.as_dicts()))             # or: fsdp2lite trace summarize step.json

Exposed communication is time the compute side spent waiting on a collective (all-gather waits,
reduce-scatter waits including the HSDP all-reduce): what prefetching and overlap failed to hide. Host steps
inside backward (``step_in_backward``) are counted apart: their time, and the part of it backward's thread
spent (stepping in it, or waiting for the host-step thread), which is taken out of any wait it happened in.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ._runtime.states import Role
from ._runtime.trace import HOST_LANE, SPAN_EVENTS, TraceEvent, TraceRecorder

__all__ = [
    "HOST_LANE",
    "GroupSummary",
    "TraceEvent",
    "TraceRecorder",
    "load_events",
    "load_schedule",
    "record_trace",
    "summarize",
]


@contextmanager
def record_trace(model: nn.Module) -> Iterator[TraceRecorder]:
    """Record the schedule of ``model`` (a root FSDPModule) while the block runs."""
    from .module import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"record_trace needs a module fully_shard was applied to, got {type(model).__name__}")
    state = model._fsdp_state
    if state.role is Role.NESTED:
        raise ValueError(f"record_trace: {type(model).__name__} is not the root; pass the outermost FSDP module")
    rank = dist.get_rank() if dist.is_initialized() else 0
    recorder = TraceRecorder(rank)
    if state.root_context is not None:
        recorder.schedule = state.root_context.schedule_settings()  # else set at lazy init
    with _on_root_meters(state, "trace_recorder", "recorder", recorder):
        yield recorder


@contextmanager
def _on_root_meters(state: Any, state_attr: str, meters_attr: str, value: Any) -> Iterator[None]:
    """Hand ``value`` to the root's shared Meters for the block: kept on the root's state (lazy init hands
    it over, if still to come) and set on the live Meters; taken back after."""
    _hand_over(state, state_attr, meters_attr, value)
    try:
        yield
    finally:
        _hand_over(state, state_attr, meters_attr, None)


def _hand_over(state: Any, state_attr: str, meters_attr: str, value: Any) -> None:
    setattr(state, state_attr, value)
    context = state.root_context
    if context is not None and context.meters is not None:
        setattr(context.meters, meters_attr, value)  # the host engine reads the recorder there too


@dataclass(frozen=True)
class GroupSummary:
    """Per group: exposed communication (ms) and event counts."""

    group: str
    all_gather_wait_ms: float
    reduce_scatter_wait_ms: float
    all_gathers: int
    reduce_scatters: int
    host_step_ms: float = 0.0  # its steps inside backward (step_in_backward), on whichever thread
    host_step_exposed_ms: float = 0.0  # of which backward's thread spent: stepping itself, or waiting for them

    @property
    def exposed_ms(self) -> float:
        return self.all_gather_wait_ms + self.reduce_scatter_wait_ms


def _read_trace(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no 'traceEvents' list); write one with save_chrome_trace")
    return data


def load_schedule(path: str | Path) -> dict[str, Any]:
    """The schedule settings a trace was recorded under ({} for traces without them)."""
    schedule = _read_trace(Path(path)).get("otherData", {}).get("fsdp2lite_schedule", {})
    return schedule if isinstance(schedule, dict) else {}


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Events from a Chrome trace written by ``save_chrome_trace``; raises ValueError naming the file."""
    data = _read_trace(Path(path))
    events = []
    for entry in data["traceEvents"]:
        if isinstance(entry, dict) and entry.get("cat") == "fsdp2lite":
            events.append({
                "name": entry["name"], "group": entry["args"]["group"], "duration_s": entry.get("dur", 0) / 1e6,
                "start_s": entry.get("ts", 0) / 1e6, "lane": HOST_LANE if entry.get("tid") == HOST_LANE else "",
            })  # fmt: skip
    return events


def summarize(events: list[dict[str, Any]]) -> list[GroupSummary]:
    """Exposed communication per group, largest first; host steps inside backward apart (module docstring)."""
    waits: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    nested = _host_time_inside(events)
    for index, event in enumerate(events):
        if event["name"] in SPAN_EVENTS:
            waits[event["group"]][event["name"]] += (event["duration_s"] - nested.get(index, 0.0)) * 1e3
        if event["name"] == "host_step" and event.get("lane") == HOST_LANE:
            waits[event["group"]]["host_step_off_thread"] += event["duration_s"] * 1e3
        counts[event["group"]][event["name"]] += 1
    rows = [
        GroupSummary(
            group,
            waits[group]["all_gather_wait"],
            waits[group]["reduce_scatter_wait"],
            counts[group]["all_gather_issue"],
            counts[group]["reduce_scatter_issue"],
            waits[group]["host_step"],
            waits[group]["host_step"] - waits[group]["host_step_off_thread"] + waits[group]["host_step_wait"],
        )
        for group in counts
    ]
    return sorted(rows, key=lambda row: -row.exposed_ms)


def _host_time_inside(events: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds of host steps and waits for them that backward's thread spent inside each of its other spans, by
    event index: a step in backward's thread runs inside its group's reduce-scatter wait, and a wait for the
    host-step thread may too; that time is the host's, not communication's."""
    host = sorted(
        (e["start_s"], e["start_s"] + e["duration_s"])
        for e in events
        if e["name"] in ("host_step", "host_step_wait") and e.get("lane") != HOST_LANE and "start_s" in e
    )
    starts = [start for start, _ in host]
    inside: dict[int, float] = {}
    for index, event in enumerate(events):
        if event["name"] not in ("all_gather_wait", "reduce_scatter_wait") or not host or "start_s" not in event:
            continue
        begin, end = event["start_s"], event["start_s"] + event["duration_s"]
        seconds = 0.0
        for start, stop in host[bisect.bisect_left(starts, begin) :]:
            if start >= end:
                break
            seconds += stop - start if stop <= end else 0.0
        if seconds:
            inside[index] = seconds
    return inside


@contextmanager
def count_wire_bytes(model: nn.Module) -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends in ``model``'s collectives while the block runs, per kind:
    ``all_gather``, ``reduce_scatter`` (a native one), ``all_reduce`` (gloo's in-place reduction),
    ``all_to_all`` (``CommPolicy.reduce_scatter``), ``replica_all_reduce`` (HSDP; HFSDP's reduce-scatter across
    replicas on gloo, which runs it as an all-reduce), ``replica_reduce_scatter`` and ``replica_all_gather``
    (HFSDP: [Note: replica-sharded groups]). Counted where each
    collective is issued, from its buffer's size and group (a ring's share: (N-1)/N of an all-gather's
    output, 2(N-1)/N of an all-reduce's buffer), so the numbers are exact and free of timing.

        with fl.count_wire_bytes(model) as sent:
            loss = model(x).sum(); loss.backward()
        sent["all_gather"]
    """
    from .module import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"count_wire_bytes takes the root module fully_shard was applied to, got {type(model).__name__}"
        )
    counts: dict[str, int] = {}
    with _on_root_meters(model._fsdp_state, "wire_counts", "wire", counts):
        yield counts
