"""Scale by simulation: one process acts as one rank of a 1024-rank world (torch's fake process group).

The collectives move no data, so values are not checked; what is checked is everything that depends
on the world size: shard shapes and padding (most ranks hold 0 or 1 rows here), the DTensor metadata,
the number of collectives, and that a full training step runs through every code path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _models import TINY_GPT, gpt_batch, gpt_loss
from test_comm_counts import counts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp2lite as fl
from fsdp2lite.models import GPT

WORLD = 1024


@pytest.fixture(params=[0, 61, 1000])
def fake_rank(request: pytest.FixtureRequest) -> Iterator[int]:
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=WORLD)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def test_shapes_and_collectives_at_1024_ranks(fake_rank: int) -> None:
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    full = {name: p.shape for name, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fl.fully_shard(block, mesh)
    fl.fully_shard(model, mesh)
    for name, param in model.named_parameters():
        dim0 = full[name][0]
        rows = -(-dim0 // WORLD)  # ceil: 1 for every parameter here
        expected = max(0, min(rows, dim0 - fake_rank * rows))
        assert param.shape == full[name] and param.placements == (Shard(0),), name
        assert param.to_local().shape == (expected, *full[name][1:]), name
    for _ in range(2):
        with CommDebugMode() as fwd:
            loss = gpt_loss(model, gpt_batch(0, fake_rank))
        with CommDebugMode() as bwd:
            loss.backward()
        n = TINY_GPT.n_layers
        assert counts(fwd)["all_gather"] == n + 1 and counts(bwd) == {"all_gather": n, "reduce": n + 1, "other": 0}
        # not gloo: the native reduce-scatter, not the in-place all-reduce ([Note: gloo reduce-scatter])
        assert not any("allreduce" in str(op) for op in bwd.get_comm_counts()), bwd.get_comm_counts()
        for name, param in model.named_parameters():
            assert param.grad is not None and param.grad.to_local().shape == param.to_local().shape, name


def test_hsdp_at_1024_ranks(fake_rank: int) -> None:
    mesh = fl.init_mesh(replicate=8, shard=-1, device_type="cpu")
    assert tuple(mesh.shape) == (8, 128)
    model = GPT(TINY_GPT)
    for block in model.blocks:
        fl.fully_shard(block, mesh, reshard_after_forward=4)
    fl.fully_shard(model, mesh)
    assert model.tok_emb.weight.placements == (Replicate(), Shard(0))
    with CommDebugMode() as mode:
        gpt_loss(model, gpt_batch(0, fake_rank)).backward()
    comm = {str(op): n for op, n in mode.get_comm_counts().items()}
    assert sum(n for op, n in comm.items() if "allreduce" in op) == TINY_GPT.n_layers + 1, comm


def test_host_ops_per_step_not_above_torch() -> None:
    """The runtime's host work, counted instead of timed: the aten ops one training step dispatches
    (bf16 params, fp32 reduce, AdamW) under FakeTensorMode on the fake process group, against torch's
    fully_shard on the same model. A per-parameter loop in the hot path ([Note: hot path]) would add
    ops per parameter per step and fail this; the count is the same on every machine, whatever its load.
    benchmarks/bench_host.py reports the same count beside the host time."""
    import sys
    from pathlib import Path

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from _meters import count_ops
    from _parity import torch_shard

    cfg = TINY_GPT.__class__(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4, tie_embeddings=False)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("shard",))  # outside the fake mode
        with FakeTensorMode():
            ours, theirs = GPT(cfg), GPT(cfg)
            policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
            for block in ours.blocks:
                fl.fully_shard(block, mesh, mp_policy=policy)
            fl.fully_shard(ours, mesh, mp_policy=policy)
            torch_shard(theirs, mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
            counts = {}
            for name, model in (("fsdp2lite", ours), ("torch", theirs)):
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

                def step(model: GPT = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
                    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
                    optimizer.step()
                    optimizer.zero_grad()

                step()  # lazy init, optimizer state
                calls = count_ops(step)
                counts[name] = sum(n for op, n in calls.items() if op.startswith("aten::"))
    finally:
        dist.destroy_process_group()
    assert counts["fsdp2lite"] <= counts["torch"], counts
