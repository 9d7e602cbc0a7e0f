"""Parity with DDP at world sizes 1-4: losses, every grad and every param, each step.

One spawn per world size runs every scenario, so the suite pays for process start-up four times.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from _collectives import wrapped_collectives
from _dist import spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss, tiny_gpt
from _parity import train_and_compare
from torch.distributed.tensor import DTensor, Shard

import fsdp2lite as fl
from fsdp2lite._runtime.collective import Native

RESHARD_MODES = (None, True, False)


def shard_blocks(reshard: bool | None):
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, reshard_after_forward=reshard)
        fl.fully_shard(model, reshard_after_forward=reshard)

    return shard


def check_layout(model: nn.Module, ref: nn.Module, rank: int, ws: int) -> None:
    """Each parameter is a Shard(0) DTensor whose local tensor is torch.chunk's piece for this rank."""
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not a DTensor"
        assert isinstance(param, nn.Parameter), f"{name} is not an nn.Parameter"
        assert param.placements == (Shard(0),), f"{name}: {param.placements}"
        full = ref_params[name].detach()
        assert param.shape == full.shape, f"{name}: global shape {param.shape} != {full.shape}"
        chunks = torch.chunk(full, ws, dim=0)
        expected = chunks[rank] if rank < len(chunks) else full[:0]
        local = param.to_local()
        assert local.shape == expected.shape, f"{name}: local {local.shape} != chunk {expected.shape}"
        assert torch.equal(local, expected), f"{name}: local values differ from torch.chunk"


def scenario_layout(rank: int, ws: int) -> None:
    for model in (UnevenMLP(), tiny_gpt()):
        ref = copy.deepcopy(model)
        shard_blocks(None)(model)
        check_layout(model, ref, rank, ws)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]


def scenario_reshard_modes(rank: int, ws: int) -> None:
    for reshard in RESHARD_MODES:
        torch.manual_seed(0)
        train_and_compare(
            UnevenMLP(),
            shard_blocks(reshard),
            mlp_batch,
            mlp_loss,
            rank,
            label=f"mlp reshard={reshard}",
        )
        torch.manual_seed(0)
        train_and_compare(
            tiny_gpt(),
            shard_blocks(reshard),
            gpt_batch,
            gpt_loss,
            rank,
            label=f"tied gpt reshard={reshard}",
        )


def scenario_frozen(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = UnevenMLP()
    model.blocks[0].mid.requires_grad_(False)  # frozen inside a block group
    model.scale.requires_grad_(False)  # frozen inside the root group
    train_and_compare(model, shard_blocks(None), mlp_batch, mlp_loss, rank, label="frozen")
    assert model.blocks[0].mid.weight.grad is None and model.scale.grad is None


def scenario_grad_accumulation(rank: int, ws: int) -> None:
    for reshard in (True, False):
        torch.manual_seed(0)
        train_and_compare(
            UnevenMLP(),
            shard_blocks(reshard),
            mlp_batch,
            mlp_loss,
            rank,
            microbatches=3,
            label=f"accumulate reshard={reshard}",
        )


def scenario_activation_checkpointing(rank: int, ws: int) -> None:
    for reshard in (True, False):
        torch.manual_seed(0)
        model = UnevenMLP(checkpoint_blocks=True)
        train_and_compare(
            model,
            shard_blocks(reshard),
            mlp_batch,
            mlp_loss,
            rank,
            label=f"checkpoint reshard={reshard}",
        )


def scenario_meta_init(rank: int, ws: int) -> None:
    with torch.device("meta"):
        model = UnevenMLP()
    shard_blocks(None)(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_all()
    # The reference starts from exactly what initialization wrote into the shards.
    ref = UnevenMLP()
    ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    assert not torch.equal(ref.blocks[0].up.weight, torch.zeros_like(ref.blocks[0].up.weight))
    train_and_compare(model, lambda m: None, mlp_batch, mlp_loss, rank, ref=ref, label="meta init")


def scenario_clip_grad_norm(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    train_and_compare(UnevenMLP(), shard_blocks(None), mlp_batch, mlp_loss, rank, clip_norm=0.05, label="clip")


def scenario_device_schedule_variants(rank: int, ws: int) -> None:
    """The paths the CPU defaults skip, still exact on gloo: the native reduce-scatter (instead of the
    in-place all-reduce, [Note: gloo reduce-scatter]) and CUDA's schedule (backward prefetch at
    pre-backward, reduce-scatters pipelined)."""
    calls: list[int] = []

    def counted(kind: str, method: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            calls.append(kind == "reduce_scatter" and type(args[0]) is Native)
            return method(*args, **kwargs)

        return run

    def native(model: nn.Module) -> None:
        shard_blocks(None)(model)
        for module in model.modules():
            if isinstance(module, fl.FSDPModule):
                module._fsdp_state.group.forms.set_collective(Native())  # type: ignore[union-attr]

    with wrapped_collectives(counted):
        torch.manual_seed(0)
        train_and_compare(UnevenMLP(), native, mlp_batch, mlp_loss, rank, label="native reduce-scatter")
    assert any(calls) or ws == 1, "the native reduce-scatter path never ran"  # one rank sends nothing

    def cuda_schedule(model: nn.Module) -> None:
        shard_blocks(None)(model)
        model.set_late_backward_prefetch(False)  # type: ignore[operator]
        model.set_overlap_reduce_scatter(True)  # type: ignore[operator]

    torch.manual_seed(0)
    train_and_compare(UnevenMLP(), cuda_schedule, mlp_batch, mlp_loss, rank, label="cuda schedule on cpu")


SCENARIOS = [
    scenario_layout,
    scenario_reshard_modes,
    scenario_frozen,
    scenario_grad_accumulation,
    scenario_activation_checkpointing,
    scenario_meta_init,
    scenario_clip_grad_norm,
    scenario_device_schedule_variants,
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_with_ddp(world_size: int) -> None:
    spawn_checks(world_size, *SCENARIOS)
