"""FSDPModule's methods and the behaviours around a step: class swap, state dicts, explicit
unshard/reshard, list groups, exceptions mid-step, gradient divide factor, inference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import assert_params_match, full, train_and_compare
from test_comm_counts import counts
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl


def shard_mlp(model: UnevenMLP) -> UnevenMLP:
    for block in model.blocks:
        fl.fully_shard(block)
    fl.fully_shard(model)
    return model


@pytest.mark.usefixtures("single_rank_pg")
def test_class_swap_in_place() -> None:
    model = UnevenMLP()
    names = [n for n, _ in model.named_parameters()]
    returned = fl.fully_shard(model)
    assert returned is model
    assert isinstance(model, fl.FSDPModule) and isinstance(model, UnevenMLP)
    assert type(model).__name__ == "FSDPUnevenMLP"
    assert [n for n, _ in model.named_parameters()] == names
    group = [nn.Linear(2, 3), nn.Linear(3, 2)]
    assert fl.fully_shard(group) is group and all(isinstance(m, fl.FSDPModule) for m in group)


# ---- multi-rank checks, one spawn --------------------------------------------------------------
def check_state_dict(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    ref = UnevenMLP()
    model = shard_mlp(copy.deepcopy(ref))
    with CommDebugMode() as mode:
        state = model.state_dict()
    assert sum(mode.get_comm_counts().values()) == 0, "state_dict() must not communicate"
    assert list(state) == list(ref.state_dict())
    for name, value in state.items():
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), name
        assert torch.equal(value.full_tensor(), ref.state_dict()[name]), name
    torch.manual_seed(1)
    fresh = shard_mlp(UnevenMLP())  # different initial values
    fresh.load_state_dict(state)
    x = mlp_batch(0, rank)[0]
    torch.testing.assert_close(fresh(x), ref(x), rtol=0, atol=0)
    # plain full tensors (e.g. a single-process checkpoint) are sharded on load, without communication
    torch.manual_seed(2)
    from_full = shard_mlp(UnevenMLP())
    with CommDebugMode() as mode:
        from_full.load_state_dict(ref.state_dict())
    assert sum(mode.get_comm_counts().values()) == 0
    assert all(isinstance(p, DTensor) for p in from_full.parameters())
    torch.testing.assert_close(from_full(x), ref(x), rtol=0, atol=0)
    # the root is unsharded now (kept after a forward with grad): state dicts still act on the shards
    assert not isinstance(from_full.head.weight, DTensor)
    assert all(isinstance(v, DTensor) for v in from_full.state_dict().values())
    from_full.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(from_full(x), fresh(x), rtol=0, atol=0)
    wrong = {k: (v[:-1] if k == "head.weight" else v) for k, v in ref.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"size mismatch for head.weight"):
        from_full.load_state_dict(wrong)


def check_unshard_reshard(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    ref = UnevenMLP()
    model = shard_mlp(copy.deepcopy(ref))
    model(mlp_batch(0, rank)[0])  # lazy init
    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert not isinstance(block.up.weight, DTensor)
    assert torch.equal(block.up.weight, ref.blocks[0].up.weight)
    with CommDebugMode() as mode:
        out = model(mlp_batch(1, rank)[0])
    # blocks[0] was unsharded ahead of time; the root stayed unsharded after the first forward
    assert counts(mode)["all_gather"] == len(model.blocks) - 1, counts(mode)
    torch.testing.assert_close(out, ref(mlp_batch(1, rank)[0]))
    model.reshard()
    block.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())


def check_list_group(rank: int, ws: int) -> None:
    def shard(model: nn.Module) -> None:
        fl.fully_shard(list(model.blocks))  # both blocks: one group, one all-gather per use
        fl.fully_shard(model)

    torch.manual_seed(0)
    model = UnevenMLP()
    train_and_compare(model, shard, mlp_batch, mlp_loss, rank, steps=3, label="list group")
    with CommDebugMode() as fwd:
        loss = mlp_loss(model, mlp_batch(9, rank))
    with CommDebugMode() as bwd:
        loss.backward()
    assert counts(fwd)["all_gather"] == 2 and counts(bwd) == {
        "all_gather": 1,
        "reduce": 2,
        "other": 0,
    }


class Boom(RuntimeError):
    pass


def check_reset_after_exceptions(rank: int, ws: int) -> None:
    """Failed forward/backward attempts, each followed by reset_iter_state, leave no trace."""
    torch.manual_seed(0)
    model = UnevenMLP()
    ddp = DDP(copy.deepcopy(model))
    shard_mlp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    fail = {"forward": False, "backward": False}

    def forward_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if fail["forward"]:
            raise Boom("forward")
        if fail["backward"] and out.requires_grad:
            out.register_hook(lambda g: (_ for _ in ()).throw(Boom("backward")))
        return out

    model.blocks[0].register_forward_hook(forward_hook)
    for step in range(3):
        # microbatch 0 accumulates with sync off; then a forward that fails mid-model
        model.set_requires_gradient_sync(False)
        mlp_loss(model, mlp_batch(2 * step, rank)).backward()
        with ddp.no_sync():
            mlp_loss(ddp, mlp_batch(2 * step, rank)).backward()
        fail["forward"] = True
        with pytest.raises(Boom):
            mlp_loss(model, mlp_batch(2 * step + 1, rank))
        fail["forward"] = False
        model.reset_iter_state()  # keeps microbatch 0's unsharded grads
        model.set_requires_gradient_sync(True)
        mlp_loss(model, mlp_batch(2 * step + 1, rank)).backward()
        mlp_loss(ddp, mlp_batch(2 * step + 1, rank)).backward()
        assert_params_match(model, ddp.module, f"step {step} grads", grads=True)
        opt.step(), ref_opt.step()
        # a step whose backward fails half-way is dropped and leaves nothing behind
        opt.zero_grad(), ref_opt.zero_grad()
        fail["backward"] = True
        with pytest.raises(Boom):
            mlp_loss(model, mlp_batch(100 + step, rank)).backward()
        fail["backward"] = False
        model.reset_iter_state()
        opt.zero_grad()
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert_params_match(model, ddp.module, f"step {step} params", grads=False)


def check_divide_factor(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = UnevenMLP()
    ddp = DDP(copy.deepcopy(model))
    shard_mlp(model)
    for module in [model, *model.blocks]:
        module.set_gradient_divide_factor(1.0)  # sum instead of average
    mlp_loss(model, mlp_batch(0, rank)).backward()
    mlp_loss(ddp, mlp_batch(0, rank)).backward()
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        torch.testing.assert_close(full(p.grad), q.grad * ws, msg=name)


def check_inference_then_train(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = UnevenMLP()
    ref = copy.deepcopy(model)
    shard_mlp(model)
    x = mlp_batch(0, rank)[0]
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, ref(x))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    torch.manual_seed(0)
    train_and_compare(model, lambda m: None, mlp_batch, mlp_loss, rank, steps=2, ref=ref, label="after no_grad")


def test_module_api_on_two_ranks() -> None:
    spawn_checks(
        2,
        check_state_dict,
        check_unshard_reshard,
        check_list_group,
        check_reset_after_exceptions,
        check_divide_factor,
        check_inference_then_train,
    )
