"""CPU offload at world size 1 prefetches like any other world size: the host-to-device copy of the next
group's shards is part of its unshard (issued ahead, on the all-gather copy-in stream on CUDA), not done at
the wait. torch's fully_shard special-cases one rank and copies synchronously at the wait there
(torchtitan#2749); fsdp2lite runs the same code path for every world size. The CPU test checks the schedule
through the trace; the gpu test checks the copy's stream and that it is non-blocking from pinned memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from _models import gpt_batch, gpt_loss, tiny_gpt

import fsdp2lite as fl


def shard(model: nn.Module, offload: fl.CPUOffloadPolicy, mesh: object = None) -> nn.Module:
    for block in model.blocks:
        fl.fully_shard(block, mesh, offload_policy=offload)
    fl.fully_shard(model, mesh, offload_policy=offload)
    return model


def scenario_prefetch_order(rank: int, ws: int) -> None:
    """Forward: blocks.1's all-gather (its copy-in from the host) is issued before blocks.0 computes;
    backward: blocks.0's before blocks.1's reduce-scatter is waited on and before its own wait."""
    model = shard(tiny_gpt(), fl.CPUOffloadPolicy(pin_memory=False))
    gpt_loss(model, gpt_batch(0, rank)).backward()
    with fl.record_trace(model) as trace:
        gpt_loss(model, gpt_batch(1, rank)).backward()
    names = [(e.name, e.group) for e in trace.events]
    forward = names.index(("forward", "blocks.0"))
    assert names.index(("all_gather_issue", "blocks.1")) < forward, names
    backward = names.index(("backward", "<root>"))
    issued = names.index(("all_gather_issue", "blocks.0"), backward)
    assert issued < names.index(("reduce_scatter_wait", "blocks.1"), backward), names
    assert issued < names.index(("all_gather_wait", "blocks.0"), backward), names


def test_offload_prefetch_at_world_size_one() -> None:
    spawn_checks(1, scenario_prefetch_order)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: streams and pinned host memory")
def test_host_to_device_copy_on_the_copy_in_stream() -> None:
    spawn_checks(1, _copies_on_side_stream)


def _copies_on_side_stream(rank: int, ws: int) -> None:
    torch.cuda.set_device(0)
    model = shard(tiny_gpt().cuda(), fl.CPUOffloadPolicy(), fl.init_mesh(device_type="cuda"))
    batch = tuple(t.cuda() for t in gpt_batch(0, rank))
    gpt_loss(model, batch).backward()
    seen: list[tuple[torch.cuda.Stream, bool, bool]] = []
    original = torch._foreach_copy_

    def recording(targets: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False) -> None:
        if targets and targets[0].is_cuda and not sources[0].is_cuda:
            seen.append((torch.cuda.current_stream(), non_blocking, all(s.is_pinned() for s in sources)))
        original(targets, sources, non_blocking=non_blocking)

    torch._foreach_copy_ = recording
    try:
        gpt_loss(model, batch).backward()
    finally:
        torch._foreach_copy_ = original
    copy_in = model._fsdp_state.root_context.comm.streams["all_gather_copy_in"]
    assert len(seen) >= 2 * len(list(model.blocks)), seen  # forward and backward unshards of every block
    for stream, non_blocking, pinned in seen:
        assert stream == copy_in and stream != torch.cuda.default_stream(), stream
        assert non_blocking and pinned
