"""The schedule: prefetch order in forward and backward, overlap of reduce-scatters, explicit
prefetch lists, prefetch depth, delay injection (races show up as wrong numbers), trace export."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _collectives import delayed_collectives
from _dist import spawn
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import train_and_compare

import fsdp2lite as fl
from fsdp2lite.cli import main as cli_main

N_BLOCKS = 3
FORWARD_ORDER = ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def sharded_mlp() -> UnevenMLP:
    torch.manual_seed(0)
    model = UnevenMLP(n_blocks=N_BLOCKS)
    for block in model.blocks:
        fl.fully_shard(block)
    fl.fully_shard(model)
    mlp_loss(model, mlp_batch(0, dist.get_rank())).backward()  # first step records the order
    return model


def traced_step(model: nn.Module, step: int = 1) -> list[tuple[str, str]]:
    with fl.record_trace(model) as trace:
        mlp_loss(model, mlp_batch(step, dist.get_rank())).backward()
    return [(event.name, event.group) for event in trace.events]


def position(events: list[tuple[str, str]], name: str, group: str, after: int = 0) -> int:
    for i, event in enumerate(events[after:], start=after):
        if event == (name, group):
            return i
    raise AssertionError(f"no {name} for {group} after position {after}: {events}")


BACKWARD_PAIRS = [("blocks.2", "blocks.1"), ("blocks.1", "blocks.0")]  # (current, previous in forward)


def check_forward_order(events: list[tuple[str, str]]) -> None:
    # forward: the next group's all-gather is issued before the current group computes
    for current, following in zip(FORWARD_ORDER, FORWARD_ORDER[1:]):
        assert position(events, "all_gather_issue", following) < position(events, "forward", current), events
    # depth 1: not two ahead
    assert position(events, "all_gather_issue", "blocks.2") > position(events, "forward", "blocks.0")


def check_default_order(rank: int, ws: int) -> None:
    """CPU defaults: late backward prefetch, reduce-scatters waited at once."""
    events = traced_step(sharded_mlp())
    check_forward_order(events)
    backward_start = position(events, "backward", "<root>")
    # backward, in reverse: the previous group's all-gather is issued right after the current group's
    # reduce-scatter (not while its gradients are still whole) and before that reduce-scatter is waited
    for current, previous in BACKWARD_PAIRS:
        issued = position(events, "reduce_scatter_issue", current, after=backward_start)
        prefetched = position(events, "all_gather_issue", previous, after=backward_start)
        waited = position(events, "reduce_scatter_wait", current, after=backward_start)
        assert issued < prefetched < waited < position(events, "backward", previous, after=backward_start), events
    for group in FORWARD_ORDER:  # every group reshards and reduces once
        assert events.count(("reduce_scatter_issue", group)) == 1, group


def check_early_prefetch_and_overlap(rank: int, ws: int) -> None:
    """The CUDA defaults, on CPU: backward prefetch at pre-backward, reduce-scatters pipelined."""
    model = sharded_mlp()
    model.set_late_backward_prefetch(False)
    model.set_overlap_reduce_scatter(True)
    events = traced_step(model)
    check_forward_order(events)
    backward_start = position(events, "backward", "<root>")
    # the previous group's all-gather is issued before the current group computes its backward, and
    # the current reduce-scatter is waited only after the previous group's backward started (overlap)
    for current, previous in BACKWARD_PAIRS:
        prefetched = position(events, "all_gather_issue", previous, after=backward_start)
        assert prefetched < position(events, "backward", current, after=backward_start), events
        waited = position(events, "reduce_scatter_wait", current, after=backward_start)
        assert position(events, "backward", previous, after=backward_start) < waited, events
    for group in FORWARD_ORDER:
        assert events.count(("reduce_scatter_issue", group)) == 1, group


def check_reduce_scatter_waited_at_once_by_default_on_cpu(rank: int, ws: int) -> None:
    events = traced_step(sharded_mlp())
    for group in FORWARD_ORDER:
        issue = position(events, "reduce_scatter_issue", group)
        # waited before anything else happens in backward (only the late prefetch's issue may come between)
        following = [event for event in events[issue + 1 :] if event[0] != "all_gather_issue"]
        assert following[0] == ("reduce_scatter_wait", group), events


def check_explicit_prefetch(rank: int, ws: int) -> None:
    model = sharded_mlp()
    model.set_modules_to_forward_prefetch([model.blocks[0], model.blocks[1]])
    model.blocks[2].set_modules_to_backward_prefetch([model.blocks[1], model.blocks[0]])
    events = traced_step(model)
    root_forward = position(events, "forward", "<root>")
    assert position(events, "all_gather_issue", "blocks.1") < root_forward, events
    # backward targets are issued at the prefetch point: late (CPU default) after blocks.2's reduce-scatter
    backward_start = position(events, "backward", "<root>")
    issued = position(events, "reduce_scatter_issue", "blocks.2", after=backward_start)
    b1 = position(events, "backward", "blocks.1", after=backward_start)
    assert issued < position(events, "all_gather_issue", "blocks.0", after=backward_start) < b1, events
    # early: before blocks.2 computes its backward
    model.set_late_backward_prefetch(False)
    events = traced_step(model, step=2)
    backward_start = position(events, "backward", "<root>")
    b2 = position(events, "backward", "blocks.2", after=backward_start)
    assert position(events, "all_gather_issue", "blocks.0", after=backward_start) < b2, events


def check_prefetch_depth(rank: int, ws: int) -> None:
    model = sharded_mlp()
    model.set_forward_prefetch_depth(0)
    events = traced_step(model)
    for group in FORWARD_ORDER[1:]:  # issued in its own pre-forward, right before its wait
        issue = position(events, "all_gather_issue", group)
        assert events[issue + 1] == ("all_gather_wait", group), events
    model.set_forward_prefetch_depth(2)
    events = traced_step(model, step=2)
    assert position(events, "all_gather_issue", "blocks.1") < position(events, "forward", "<root>"), events


def check_delay_injection(rank: int, ws: int) -> None:
    # rank-dependent delays: ranks reach each collective at different times, and outputs arrive late
    with delayed_collectives(0.002 * (rank + 1)):
        for reshard, late in ((True, True), (False, True), (True, False)):
            torch.manual_seed(0)
            shard = _shard_blocks(reshard, overlap=True, late=late)
            label = f"delayed reshard={reshard} late_prefetch={late}"
            train_and_compare(UnevenMLP(n_blocks=N_BLOCKS), shard, mlp_batch, mlp_loss, rank, steps=3, label=label)
        torch.manual_seed(0)
        train_and_compare(
            UnevenMLP(n_blocks=N_BLOCKS),
            _shard_blocks(None),
            mlp_batch,
            mlp_loss,
            rank,
            steps=2,
            microbatches=2,
            label="delayed accumulation",
        )


def _shard_blocks(reshard: bool | None, overlap: bool = False, late: bool = True) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, reshard_after_forward=reshard)
        fl.fully_shard(model, reshard_after_forward=reshard)
        model.set_overlap_reduce_scatter(overlap)
        model.set_late_backward_prefetch(late)

    return shard


def check_trace_export(rank: int, ws: int, out_dir: str) -> None:
    model = sharded_mlp()
    with fl.record_trace(model) as trace:
        mlp_loss(model, mlp_batch(1, rank)).backward()
    path = trace.save_chrome_trace(Path(out_dir) / f"trace-rank{rank}.json")
    rows = {row.group: row for row in fl.trace.summarize(fl.trace.load_events(path))}
    assert set(rows) == set(FORWARD_ORDER)
    assert rows["blocks.0"].all_gathers == 2 and rows["<root>"].all_gathers == 1  # the root is kept for backward
    assert all(row.reduce_scatters == 1 and row.exposed_ms >= 0 for row in rows.values())
    # the settings the order was recorded under travel with the trace
    cpu_defaults = {"forward_prefetch_depth": 1, "late_backward_prefetch": True, "overlap_reduce_scatter": False}
    assert fl.trace.load_schedule(path) == {**cpu_defaults, "device": "cpu"}
    # tracing is off outside the block: nothing more is recorded
    count = len(trace.events)
    mlp_loss(model, mlp_batch(2, rank)).backward()
    assert len(trace.events) == count
    # recording from before the first forward: the settings are taken at lazy init
    torch.manual_seed(0)
    fresh = UnevenMLP(n_blocks=N_BLOCKS)
    for block in fresh.blocks:
        fl.fully_shard(block)
    fl.fully_shard(fresh)
    fresh.set_late_backward_prefetch(False)
    with fl.record_trace(fresh) as first:
        mlp_loss(fresh, mlp_batch(0, rank)).backward()
    assert first.schedule == {**cpu_defaults, "late_backward_prefetch": False, "device": "cpu"}


def run(rank: int, ws: int, out_dir: str) -> None:
    for check in (
        check_default_order,
        check_early_prefetch_and_overlap,
        check_reduce_scatter_waited_at_once_by_default_on_cpu,
        check_explicit_prefetch,
        check_prefetch_depth,
        check_delay_injection,
    ):
        check(rank, ws)
        dist.barrier()
    check_trace_export(rank, ws, out_dir)


def test_schedule_on_two_ranks(tmp_path: Path, capsys: Any) -> None:
    spawn(run, 2, str(tmp_path))
    assert cli_main(["trace", "summarize", str(tmp_path / "trace-rank0.json")]) == 0
    out = capsys.readouterr().out
    assert "blocks.2" in out and "exposed communication" in out
    settings = "forward_prefetch_depth=1, late_backward_prefetch=true, overlap_reduce_scatter=false, device=cpu"
    assert f"schedule: {settings}" in " ".join(out.split())


def test_trace_summarize_bad_file(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli_main(["trace", "summarize", str(bad)]) == 1
    assert "not JSON" in capsys.readouterr().err
    bad.write_text('{"events": []}')
    assert cli_main(["trace", "summarize", str(bad)]) == 1
    assert "not a Chrome trace" in capsys.readouterr().err


def test_trace_summarize_counts_host_steps_apart(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    """``step_in_backward``'s host steps in a trace: a step in backward's thread, nested in its group's
    reduce-scatter wait, is the host's time, not communication's; a step on the host-step thread is exposed only
    where backward's thread waited for it (``host_step_wait``), itself taken out of the wait it happened in. The
    same numbers from the recorder's events and from the saved Chrome trace; the CLI prints the two columns."""
    from fsdp2lite.trace import HOST_LANE, TraceEvent, TraceRecorder, load_events, summarize

    recorder = TraceRecorder()
    recorder.events = [
        TraceEvent("reduce_scatter_wait", "b", "POST_BACKWARD", 1.0, 0.5),
        TraceEvent("host_step", "b", "POST_BACKWARD", 1.125, 0.25),  # stepped in backward's thread, inside the wait
        TraceEvent("reduce_scatter_issue", "b", "POST_BACKWARD", 0.9, 0.0),
        TraceEvent("host_step", "a", "POST_BACKWARD", 2.0, 0.375, HOST_LANE),  # on the host-step thread
        TraceEvent("reduce_scatter_wait", "c", "POST_BACKWARD", 2.25, 0.25),
        TraceEvent("host_step_wait", "a", "POST_BACKWARD", 2.3125, 0.0625),  # c's reduction waited for a's step
    ]
    path = recorder.save_chrome_trace(tmp_path / "host.json")
    for events in (recorder.as_dicts(), load_events(path)):
        rows = {row.group: row for row in summarize(events)}
        assert rows["b"].reduce_scatter_wait_ms == pytest.approx(250.0)
        assert (rows["b"].host_step_ms, rows["b"].host_step_exposed_ms) == (pytest.approx(250.0), pytest.approx(250.0))
        assert (rows["a"].host_step_ms, rows["a"].host_step_exposed_ms) == (pytest.approx(375.0), pytest.approx(62.5))
        assert rows["c"].reduce_scatter_wait_ms == pytest.approx(187.5) and rows["c"].host_step_ms == 0
    assert [e["lane"] for e in load_events(path)] == ["", "", "", HOST_LANE, "", ""]
    monkeypatch.setenv("COLUMNS", "200")  # the table unwrapped
    assert cli_main(["trace", "summarize", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    a_row = "│ a │ 0.000 │ 0.000 │ 0.000 │ 0 │ 0 │ 375.000 │ 62.500 │"  # its two host columns last
    assert "host step exposed ms" in out and a_row in out
    assert "host steps inside backward: 625.000 ms, of which backward's thread spent 312.500 ms" in out
