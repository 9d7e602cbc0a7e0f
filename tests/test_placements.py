"""shard_placement_fn: parameters sharded on a dim other than 0 (torch.chunk along it), as torch's fully_shard.

Layout against torch.chunk, parity with DDP (uneven chunks included, which torch's fully_shard does not
allow off dim 0), placements and training against torch's fully_shard where it allows them (even
chunks), one all-gather per group, a DCP checkpoint resharded to Shard(0), and the bad inputs.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from _parity import train_and_compare
from test_comm_counts import counts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp2lite as fl
from fsdp2lite.models import GPT, GPTConfig

EVEN_GPT = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2, tie_embeddings=False)


def dim1(param: nn.Parameter) -> Shard | None:
    """Shard(1) for every matrix (an MoE-style choice), Shard(0) (None) for vectors."""
    return Shard(1) if param.dim() == 2 else None


def last_dim(param: nn.Parameter) -> Shard | None:
    return Shard(-1) if param.dim() == 2 else None


def shard_with(fn, **kwargs):
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, shard_placement_fn=fn, **kwargs)
        fl.fully_shard(model, shard_placement_fn=fn, **kwargs)

    return shard


def check_layout(rank: int, ws: int) -> None:
    """Each matrix is a Shard(1) DTensor holding torch.chunk's piece along dim 1 (uneven: 16, 37, 61
    columns), vectors Shard(0); full_tensor() gives back the original; Shard(-1) means Shard(1)."""
    for fn in (dim1, last_dim):
        torch.manual_seed(0)  # every rank builds the same model
        model = UnevenMLP()
        ref = dict(copy.deepcopy(model).named_parameters())
        shard_with(fn)(model)
        for name, param in model.named_parameters():
            full = ref[name].detach()
            dim = 1 if full.dim() == 2 else 0
            assert isinstance(param, DTensor) and param.placements == (Shard(dim),), (name, param.placements)
            chunks = torch.chunk(full, ws, dim=dim)
            expected = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
            assert param.to_local().shape == expected.shape, (name, param.to_local().shape, expected.shape)
            assert torch.equal(param.to_local(), expected), name
            assert torch.equal(param.full_tensor(), full), name


def check_parity(rank: int, ws: int) -> None:
    """Against DDP, every step: losses, every gradient, every parameter; resharded or kept after
    forward, with gradient accumulation (sync off) and with activation checkpointing."""
    for reshard in (True, False):
        torch.manual_seed(0)
        model = UnevenMLP()
        train_and_compare(
            model, shard_with(dim1, reshard_after_forward=reshard), mlp_batch, mlp_loss, rank, label=f"dim1 {reshard}"
        )
    torch.manual_seed(0)
    train_and_compare(UnevenMLP(), shard_with(dim1), mlp_batch, mlp_loss, rank, microbatches=2, label="accumulate")
    torch.manual_seed(0)
    model = UnevenMLP(checkpoint_blocks=True)
    train_and_compare(model, shard_with(dim1), mlp_batch, mlp_loss, rank, label="checkpointed")


def check_against_torch(rank: int, ws: int) -> None:
    """Where torch's fully_shard accepts the placements (columns divisible by the world size): the same
    placements and local tensors, and the same losses and parameters over 3 AdamW steps in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def fn(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param.dim() == 2 and param.shape[1] % ws == 0 else None

    torch.manual_seed(0)
    ours, theirs = GPT(EVEN_GPT), GPT(EVEN_GPT)
    theirs.load_state_dict(ours.state_dict())
    policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
    shard_with(fn, mp_policy=policy)(ours)
    mesh = cpu_mesh()
    torch_policy = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (*theirs.blocks, theirs):
        torch_fully_shard(module, mesh=mesh, shard_placement_fn=fn, mp_policy=torch_policy)
    theirs_named = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert param.placements == theirs_named[name].placements, (name, param.placements)
        assert torch.equal(param.to_local(), theirs_named[name].to_local()), name
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(3):
        batch = gpt_batch(step, rank)  # tokens < 61 <= vocab 64, seq 8
        losses = [gpt_loss(m, batch) for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-3, atol=2e-3)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.full_tensor(), theirs_named[name].full_tensor(), rtol=2e-3, atol=2e-3)


def check_one_all_gather_per_group(rank: int, ws: int) -> None:
    """Mixed dims in one group still all-gather once per group and reduce once per group."""
    torch.manual_seed(0)
    model = UnevenMLP(n_blocks=3)
    shard_with(dim1)(model)
    batch = mlp_batch(0, rank)
    with CommDebugMode() as mode:
        mlp_loss(model, batch).backward()
    got = counts(mode)
    assert got["all_gather"] == 4 + 3, got  # 3 blocks + root in forward, the 3 blocks again in backward
    assert got["reduce"] == 4, got


def check_checkpoint(rank: int, ws: int, path: str) -> None:
    """A DCP checkpoint of a Shard(1) model loads into a Shard(0) one (DCP reshards): same values."""
    torch.manual_seed(0)
    source = UnevenMLP()
    shard_with(dim1)(source)
    dcp.save(source.state_dict(), checkpoint_id=path)
    target = UnevenMLP()  # other values than source's: the load must bring them
    shard_with(None)(target)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=path)
    target.load_state_dict(state)
    for (name, mine), (_, theirs) in zip(target.named_parameters(), source.named_parameters()):
        assert mine.placements == (Shard(0),), name
        assert torch.equal(mine.full_tensor(), theirs.full_tensor()), name
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_placement_fn(world_size: int, tmp_path: Path) -> None:
    checks = [check_layout, check_parity, check_one_all_gather_per_group]
    checks.append(functools.partial(check_checkpoint, path=str(tmp_path / "ckpt")))
    if world_size == 2:
        checks.append(check_against_torch)
    spawn_checks(world_size, *checks)


# ---- bad input: one process acting as rank 1 of 4 (fake process group), nothing sharded after an error


@pytest.fixture
def fake_world_4():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def _untouched(module: nn.Module) -> None:
    assert not isinstance(module, fl.FSDPModule)
    assert not any(isinstance(p, DTensor) for p in module.parameters())


@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (lambda p: Replicate(), TypeError, r"returned Replicate\(\) for parameter 'up.weight' of Linear.*Shard\(dim\)"),
        (
            lambda p: Shard(2),
            ValueError,
            r"up.weight: shard_placement_fn asks for dim 2, but the parameter has shape \(37, 16\); "
            r"use a dim in 0 \.\. 1",
        ),
        (lambda p: Shard(-3), ValueError, r"up.weight: shard_placement_fn asks for dim -3.*\(or -2 \.\. -1\)"),
        ("Shard(1)", TypeError, r"shard_placement_fn must be a callable.*got str"),
    ],
)
def test_bad_shard_placement_fn(fake_world_4, fn, error, match) -> None:
    block = UnevenMLP().blocks[0]
    with pytest.raises(error, match=match):
        fl.fully_shard(block, fake_world_4, shard_placement_fn=fn)
    _untouched(block)


def test_post_forward_reshard_needs_dim_0(fake_world_4) -> None:
    """reshard_after_forward=k keeps dim-0 chunks: a Shard(1) parameter is named, at fully_shard and in
    set_reshard_after_forward, and nothing changes."""
    block = UnevenMLP().blocks[0]
    with pytest.raises(ValueError, match=r"reshard_after_forward=2.*up.weight \(Shard\(1\)\).*True or False"):
        fl.fully_shard(block, fake_world_4, reshard_after_forward=2, shard_placement_fn=dim1)
    _untouched(block)
    fl.fully_shard(block, fake_world_4, shard_placement_fn=dim1)
    with pytest.raises(ValueError, match=r"reshard_after_forward=2.*mid.weight \(Shard\(1\)\)"):
        block.set_reshard_after_forward(2)
    other = UnevenMLP().blocks[1]
    fl.fully_shard(other, fake_world_4, reshard_after_forward=4, shard_placement_fn=dim1)  # k = 4 is True
    assert isinstance(other.up.weight, DTensor) and other.up.weight.placements == (Shard(1),)
