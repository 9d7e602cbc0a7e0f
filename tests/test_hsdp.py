"""HSDP on 4 ranks: (replicate, shard) meshes 2x2, 4x1 and 1x4, against DDP over all 4 ranks.

Checks per step: losses, every grad and every param (parity), which process group each collective
ran on, collective counts, gradient accumulation with either switch, and reshard_after_forward=k.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _collectives import recorded_collectives
from _dist import spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import assert_params_match, train_and_compare
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl

MESHES = [(2, 2), (4, 1), (1, 4)]


def hsdp_mesh(replicate: int, shard: int) -> DeviceMesh:
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def shard_with(mesh: DeviceMesh, reshard: bool | int | None) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, mesh, reshard_after_forward=reshard)
        fl.fully_shard(model, mesh, reshard_after_forward=reshard)

    return shard


def check_placements(rank: int, ws: int) -> None:
    for replicate, shard in MESHES:
        mesh = hsdp_mesh(replicate, shard)
        torch.manual_seed(0)
        ref = UnevenMLP()
        model = copy.deepcopy(ref)
        shard_with(mesh, None)(model)
        shard_rank = mesh.get_local_rank(1)
        for name, param in model.named_parameters():
            assert param.placements == (Replicate(), Shard(0)), name
            chunks = torch.chunk(dict(ref.named_parameters())[name].detach(), shard, dim=0)
            expected = chunks[shard_rank] if shard_rank < len(chunks) else chunks[0][:0]
            assert torch.equal(param.to_local(), expected), name


def check_parity(rank: int, ws: int) -> None:
    for replicate, shard in MESHES:
        mesh = hsdp_mesh(replicate, shard)
        for reshard in (True, False, 2):
            if reshard == 2 and shard < 2:
                continue
            torch.manual_seed(0)
            label = f"mesh {replicate}x{shard} reshard={reshard}"
            train_and_compare(UnevenMLP(), shard_with(mesh, reshard), mlp_batch, mlp_loss, rank, label=label)
            torch.manual_seed(0)
            train_and_compare(
                UnevenMLP(), shard_with(mesh, reshard), mlp_batch, mlp_loss, rank, microbatches=3, label="sync " + label
            )


def check_shard_placement_fn(rank: int, ws: int) -> None:
    """HSDP with matrices sharded on dim 1: (Replicate(), Shard(1)) holding torch.chunk's columns, and
    DDP parity on a 2x2 mesh."""
    mesh = hsdp_mesh(2, 2)

    def dim1(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param.dim() == 2 else None

    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, mesh, shard_placement_fn=dim1)
        fl.fully_shard(model, mesh, shard_placement_fn=dim1)

    torch.manual_seed(0)
    model = UnevenMLP()
    ref = dict(copy.deepcopy(model).named_parameters())
    shard(model)
    for name, param in model.named_parameters():
        dim = 1 if param.dim() == 2 else 0
        assert param.placements == (Replicate(), Shard(dim)), (name, param.placements)
        chunks = torch.chunk(ref[name].detach(), 2, dim=dim)
        assert torch.equal(param.to_local(), chunks[mesh.get_local_rank(1)]), name
    torch.manual_seed(0)
    train_and_compare(UnevenMLP(), shard, mlp_batch, mlp_loss, rank, label="hsdp dim1")


def check_all_reduce_accumulation(rank: int, ws: int) -> None:
    """set_requires_all_reduce(False) on all but the last microbatch == DDP's no_sync accumulation."""
    mesh = hsdp_mesh(2, 2)
    torch.manual_seed(0)
    model = UnevenMLP()
    ddp = DDP(copy.deepcopy(model))
    shard_with(mesh, None)(model)
    for step in range(2):
        for micro in range(3):
            last = micro == 2
            model.set_requires_all_reduce(last)
            batch = mlp_batch(10 * step + micro, rank)
            mlp_loss(model, batch).backward()
            if last:
                mlp_loss(ddp, batch).backward()
            else:
                with ddp.no_sync():
                    mlp_loss(ddp, batch).backward()
        assert_params_match(model, ddp.module, f"all-reduce accumulation step {step}", grads=True)
        for p in (*model.parameters(), *ddp.parameters()):
            p.grad = None


def check_collective_groups(rank: int, ws: int) -> None:
    mesh = hsdp_mesh(2, 2)
    shard_group, replicate_group = mesh.get_group("shard"), mesh.get_group("replicate")
    n_groups = 3  # two blocks + root
    torch.manual_seed(0)
    model = UnevenMLP()
    shard_with(mesh, None)(model)
    for step in range(2):
        with recorded_collectives() as calls:
            mlp_loss(model, mlp_batch(step, rank)).backward()
        kinds = [kind for kind, *_ in calls]
        assert kinds.count("all_gather") == n_groups + 2, kinds  # forward all, backward all but the root
        assert kinds.count("reduce_scatter") == n_groups and kinds.count("all_reduce") == n_groups, kinds
        for kind, ranks, _, async_op in calls:
            expected = replicate_group if kind == "all_reduce" else shard_group
            assert ranks.group is expected, f"{kind} ran on the wrong process group"
            assert async_op, f"{kind} was not issued async (CPU: a Work waited by its consumer)"
    model.set_requires_all_reduce(False)
    with recorded_collectives() as calls:
        mlp_loss(model, mlp_batch(5, rank)).backward()
    assert [k for k, *_ in calls].count("all_reduce") == 0


def check_post_forward_reshard(rank: int, ws: int) -> None:
    """reshard_after_forward=2 on a 1x4 mesh: backward all-gathers run over 2 ranks, a quarter-size each."""
    mesh = hsdp_mesh(1, 4)
    torch.manual_seed(0)
    model = UnevenMLP()
    for block in model.blocks:
        fl.fully_shard(block, mesh, reshard_after_forward=2)
    fl.fully_shard(model, mesh)
    with recorded_collectives() as forward_calls:
        loss = mlp_loss(model, mlp_batch(0, rank))
    with recorded_collectives() as backward_calls:
        loss.backward()
    sizes = {ranks.size for kind, ranks, _, _ in forward_calls if kind == "all_gather"}
    assert sizes == {4}, sizes
    backward_gathers = [(ranks.group, numel) for kind, ranks, numel, _ in backward_calls if kind == "all_gather"]
    assert len(backward_gathers) == 2 and all(dist.get_world_size(g) == 2 for g, _ in backward_gathers)
    block_forward = [numel for kind, _, numel, _ in forward_calls if kind == "all_gather"][1]
    assert abs(backward_gathers[0][1] - block_forward) <= 4 * 64, "a 2-rank gather moves the whole block"
    # k == shard size behaves like True, k == 1 like False; other values are rejected with the divisors
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must divide the shard group size \(4\)"):
        model.blocks[0].set_reshard_after_forward(3)
    model.blocks[0].set_reshard_after_forward(1)
    with recorded_collectives() as calls:
        mlp_loss(model, mlp_batch(1, rank)).backward()
    assert [k for k, *_ in calls].count("all_gather") == 3 + 1  # forward 3, backward only blocks.1


def check_mixed_meshes_rejected(rank: int, ws: int) -> None:
    model = UnevenMLP()
    fl.fully_shard(model.blocks[0], hsdp_mesh(2, 2))
    fl.fully_shard(model.blocks[1], init_device_mesh("cpu", (4,), mesh_dim_names=("shard",)))
    fl.fully_shard(model, hsdp_mesh(2, 2))
    with pytest.raises(ValueError, match=r"same mesh; got .*blocks.1: \(4,\)"):
        model(mlp_batch(0, rank)[0])


def check_init_mesh(rank: int, ws: int) -> None:
    mesh = fl.init_mesh(replicate=2, shard=-1, device_type="cpu")
    assert tuple(mesh.shape) == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")
    flat = fl.init_mesh(device_type="cpu")
    assert tuple(flat.shape) == (4,) and flat.mesh_dim_names == ("shard",)
    with pytest.raises(ValueError, match=r"mesh replicate\(3\) \* shard\(2\) != world_size\(4\)"):
        fl.init_mesh(replicate=3, shard=2)
    with pytest.raises(ValueError, match=r"replicate\(3\) does not divide world_size\(4\)"):
        fl.init_mesh(replicate=3)


def check_hsdp_config(rank: int, ws: int) -> None:
    from test_config import config_file

    torch.manual_seed(0)
    from _models import gpt_batch, gpt_loss, tiny_gpt

    model = tiny_gpt()
    train_and_compare(
        model, lambda m: fl.apply_config(m, config_file("hsdp")), gpt_batch, gpt_loss, rank, label="hsdp.yaml"
    )
    assert isinstance(model.tok_emb.weight, DTensor) and model.tok_emb.weight.placements == (Replicate(), Shard(0))


def test_hsdp_on_four_ranks() -> None:
    spawn_checks(
        4,
        check_placements,
        check_parity,
        check_shard_placement_fn,
        check_all_reduce_accumulation,
        check_collective_groups,
        check_post_forward_reshard,
        check_mixed_meshes_rejected,
        check_init_mesh,
        check_hsdp_config,
    )
