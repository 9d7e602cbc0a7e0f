"""torch.compile on blocks ([Note: compile]): ``block.compile()`` then ``fully_shard`` trains like DDP, with
no graph break, nothing recompiled after the first step, and as many graphs as torch's fully_shard.

2 gloo ranks, ``backend="aot_eager"`` (CPU, no code generation), graphs and breaks counted with
torch._dynamo's own counters.
"""

from __future__ import annotations

import copy

import torch
import torch._dynamo
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _models import gpt_batch, gpt_loss, tiny_gpt
from _parity import ATOL, RTOL, assert_params_match
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl

STEPS = 4


def compiled_and_sharded(model: nn.Module, library: str) -> CompileCounterWithBackend:
    """Compile each block, then shard blocks and root; returns the graph counter."""
    counter = CompileCounterWithBackend("aot_eager")
    if library == "torch":
        from torch.distributed.fsdp import fully_shard

        mesh = cpu_mesh()
        shard = lambda module: fully_shard(module, mesh=mesh)  # noqa: E731
    else:
        shard = fl.fully_shard
    for block in model.blocks:
        block.compile(backend=counter)
        shard(block)
    shard(model)
    return counter


def check_compiled_blocks(rank: int, ws: int) -> None:
    frames = {}
    for library in ("fsdp2lite", "torch"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = tiny_gpt()
        ddp = DDP(copy.deepcopy(model))
        counter = compiled_and_sharded(model, library)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ddp)]
        after_first = None
        for step in range(STEPS):
            batch = gpt_batch(step, rank)
            loss = gpt_loss(model, batch)
            loss.backward()
            ref_loss = gpt_loss(ddp, batch)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            assert_params_match(model, ddp.module, f"{library} step {step} grads", grads=True)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            assert_params_match(model, ddp.module, f"{library} step {step} params", grads=False)
            if step == 0:
                after_first = counter.frame_count
        breaks = dict(counters["graph_break"])
        assert not breaks, f"{library}: graph breaks {breaks}"
        assert counter.frame_count == after_first, (
            f"{library}: {after_first} graphs after step 1, {counter.frame_count} after {STEPS}"
        )
        assert not counters["recompiles"], f"{library}: recompiles {dict(counters['recompiles'])}"
        frames[library] = counter.frame_count
    assert frames["fsdp2lite"] == frames["torch"] >= 1, frames


def test_compiled_blocks() -> None:
    spawn_checks(2, check_compiled_blocks)
