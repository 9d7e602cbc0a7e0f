"""Collectives per step, counted with torch's CommDebugMode: one all-gather and one gradient reduction
per group per use, never one per parameter, and never more than torch's own fully_shard.

A gradient reduction is a reduce-scatter, which on gloo both libraries run as one all-reduce:
torch's gloo backend turns ``reduce_scatter_tensor`` into clone + all-reduce, fsdp2lite issues the
all-reduce in place ([Note: gloo reduce-scatter] in fsdp2lite/_runtime/reduce.py). These tests
use 1D meshes, where no other all-reduce runs, so both count as "reduce"."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import spawn
from _models import TINY_GPT, gpt_batch, gpt_loss
from _parity import torch_shard
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2lite as fl
from fsdp2lite.models import GPT

N_BLOCKS = 3


def collective_kind(op_name: str) -> str:
    """The kind of a c10d op: all_gather, reduce (reduce-scatter, or the all-reduce gloo runs it as), other."""
    if "allgather" in op_name or "all_gather" in op_name:
        return "all_gather"
    if "reduce_scatter" in op_name or "allreduce" in op_name:
        return "reduce"
    return "other"


def counts(mode: CommDebugMode) -> dict[str, int]:
    """Collective counts by kind, from the c10d ops CommDebugMode saw."""
    out = {"all_gather": 0, "reduce": 0, "other": 0}
    for op, n in mode.get_comm_counts().items():
        out[collective_kind(str(op))] += n
    return out


def step_counts(model: nn.Module, step: int, rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """(forward counts, backward counts) for one training step."""
    with CommDebugMode() as fwd:
        loss = gpt_loss(model, gpt_batch(step, rank))
    with CommDebugMode() as bwd:
        loss.backward()
    return counts(fwd), counts(bwd)


def build(n_blocks: int = N_BLOCKS) -> GPT:
    torch.manual_seed(0)
    cfg = TINY_GPT.__class__(**{**TINY_GPT.__dict__, "n_layers": n_blocks})
    return GPT(cfg)


def shard_fl(model: GPT, **kwargs: object) -> GPT:
    for block in model.blocks:
        fl.fully_shard(block, **kwargs)  # type: ignore[arg-type]
    fl.fully_shard(model, **kwargs)  # type: ignore[arg-type]
    return model


def check_default_schedule(rank: int) -> None:
    n = N_BLOCKS
    model = shard_fl(build())
    for step in range(2):
        fwd, bwd = step_counts(model, step, rank)
        assert fwd == {"all_gather": n + 1, "reduce": 0, "other": 0}, (step, fwd)
        # the root keeps its parameters (reshard_after_forward resolves to False for it)
        assert bwd == {"all_gather": n, "reduce": n + 1, "other": 0}, (step, bwd)


def check_block_run_alone_first(rank: int) -> None:
    """A block run on its own first is its own root for a while; the model's root then takes over
    and the block goes back to resharding after forward (its default as a non-root)."""
    n = N_BLOCKS
    model = shard_fl(build())
    with torch.no_grad():
        model.blocks[0](torch.randn(2, TINY_GPT.seq_len, TINY_GPT.d_model))
    fwd, bwd = step_counts(model, 0, rank)
    assert fwd["all_gather"] == n + 1 and bwd["all_gather"] == n, (fwd, bwd)


def check_no_reshard(rank: int) -> None:
    model = shard_fl(build(), reshard_after_forward=False)
    fwd, bwd = step_counts(model, 0, rank)
    assert fwd["all_gather"] == N_BLOCKS + 1 and bwd["all_gather"] == 0, (fwd, bwd)
    assert bwd["reduce"] == N_BLOCKS + 1, bwd


def check_no_sync_and_frozen(rank: int) -> None:
    model = shard_fl(build())
    model.set_requires_gradient_sync(False)
    _, bwd = step_counts(model, 0, rank)
    assert bwd["reduce"] == 0, bwd
    model.set_requires_gradient_sync(True)
    _, bwd = step_counts(model, 1, rank)
    assert bwd["reduce"] == N_BLOCKS + 1, bwd

    frozen = build()
    frozen.blocks[1].requires_grad_(False)  # a whole group frozen: nothing to reduce there
    shard_fl(frozen)
    _, bwd = step_counts(frozen, 0, rank)
    assert bwd["reduce"] == N_BLOCKS, bwd


def check_inference(rank: int) -> None:
    model = shard_fl(build())
    with torch.no_grad(), CommDebugMode() as mode:
        gpt_loss(model, gpt_batch(0, rank))
    assert counts(mode) == {"all_gather": N_BLOCKS + 1, "reduce": 0, "other": 0}
    # nothing stays unsharded after an inference forward (no backward can need it)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def check_not_more_than_torch(rank: int) -> None:
    ours = shard_fl(build())
    theirs = torch_shard(build())
    for step in range(2):
        our_fwd, our_bwd = step_counts(ours, step, rank)
        their_fwd, their_bwd = step_counts(theirs, step, rank)
        for kind in ("all_gather", "reduce", "other"):
            assert our_fwd[kind] <= their_fwd[kind], (kind, our_fwd, their_fwd)
            assert our_bwd[kind] <= their_bwd[kind], (kind, our_bwd, their_bwd)
        assert sum(our_fwd.values()) + sum(our_bwd.values()) <= sum(their_fwd.values()) + sum(their_bwd.values())


def check_gloo_reduces_in_place(rank: int) -> None:
    """On gloo the reduction is one in-place all-reduce of the flat buffer; the sharded gradients are a
    copy of this rank's slot, so they do not keep the world-sized flat buffer alive."""
    from fsdp2lite._runtime.collective import reduces_in_place

    assert reduces_in_place(dist.group.WORLD, torch.device("cpu"))
    assert not reduces_in_place(dist.group.WORLD, torch.device("cuda"))  # CUDA tensors: NCCL's reduce-scatter
    model = shard_fl(build())
    with CommDebugMode() as bwd:
        gpt_loss(model, gpt_batch(0, rank)).backward()
    ops = {str(op) for op in bwd.get_comm_counts()}
    assert not any("reduce_scatter" in op for op in ops) and any("allreduce" in op for op in ops), ops
    for state in {id(m._fsdp_state): m._fsdp_state for m in model.modules() if isinstance(m, fl.FSDPModule)}.values():
        group_bytes = sum(p.padded_numel for p in state.group.params) * 4  # fp32: one rank's slots
        for param in state.group.params:
            storage = param.sharded_param.grad.to_local().untyped_storage()
            assert storage.nbytes() <= group_bytes, (param.fqn, storage.nbytes(), group_bytes)


def test_cpu_backend_parsing() -> None:
    from fsdp2lite._runtime.collective import cpu_backend

    assert cpu_backend("gloo") == "gloo"
    assert cpu_backend("cpu:gloo,cuda:nccl") == "gloo"
    assert cpu_backend("cuda:nccl,cpu:gloo") == "gloo"
    assert cpu_backend("nccl") == "nccl"
    assert cpu_backend("cuda:nccl") == "cuda:nccl"  # no CPU backend: never "gloo"
    assert cpu_backend("fake") == "fake"


def run(rank: int, ws: int) -> None:
    for check in (
        check_default_schedule,
        check_block_run_alone_first,
        check_no_reshard,
        check_no_sync_and_frozen,
        check_inference,
        check_not_more_than_torch,
        check_gloo_reduces_in_place,
    ):
        check(rank)
        dist.barrier()


def test_collective_counts() -> None:
    spawn(run, 2)
