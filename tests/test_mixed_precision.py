"""Mixed precision and CPU offload in the runtime.

Oracle for mixed precision: torch's fully_shard under the same policy, trained side by side; dtypes are
checked where they matter (the weights a forward sees, the collectives' buffers, the stored grads).
CPU offload on a CPU mesh is checked for exact parity with DDP and for where tensors live.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss, tiny_gpt
from _parity import torch_shard, train_and_compare
from test_comm_counts import collective_kind
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2lite as fl

LOSS_ATOL = 2e-3
POLICIES = {
    "bf16 params, fp32 reduce": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16 params, bf16 reduce": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    "fp16 params": dict(param_dtype=torch.float16),
}


class CollectiveDtypes(TorchDispatchMode):
    """Records the dtype of every all-gather and gradient reduction input that reaches c10d (on gloo the
    reduction is an in-place all-reduce: [Note: gloo reduce-scatter])."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = collective_kind(str(func))
        if kind == "all_gather" or "reduce_scatter" in str(func):
            self.seen.append((kind, args[1].dtype))  # (output, input, ...)
        elif kind == "reduce":
            self.seen.append((kind, args[0][0].dtype))  # allreduce_((tensors, ...)

        return func(*args, **(kwargs or {}))


def shard_both(model: nn.Module, policy: dict[str, torch.dtype]) -> tuple[nn.Module, nn.Module]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    theirs = torch_shard(copy.deepcopy(model), mp_policy=TorchMP(**policy))
    for block in model.blocks:
        fl.fully_shard(block, mp_policy=fl.MixedPrecisionPolicy(**policy))
    fl.fully_shard(model, mp_policy=fl.MixedPrecisionPolicy(**policy))
    return model, theirs


def check_losses_match_torch(rank: int, ws: int) -> None:
    for label, policy in POLICIES.items():
        torch.manual_seed(0)
        ours, theirs = shard_both(tiny_gpt(), policy)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        for step in range(5):
            losses = []
            for model, opt in zip((ours, theirs), opts):
                loss = gpt_loss(model, gpt_batch(step, rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) <= LOSS_ATOL, f"{label} step {step}: {losses}"


def check_dtypes(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = UnevenMLP()
    seen: dict[str, torch.dtype] = {}
    model.blocks[0].up.register_forward_pre_hook(
        lambda m, args: seen.update(weight=m.weight.dtype, input=args[0].dtype)
    )
    policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
    for block in model.blocks:
        fl.fully_shard(block, mp_policy=policy)
    fl.fully_shard(model, mp_policy=policy.model_copy(update={"output_dtype": torch.float32}))
    with CollectiveDtypes() as mode:
        out = model(mlp_batch(0, rank)[0])  # fp32 input
        assert out.dtype == torch.float32, "output_dtype=fp32 casts the bf16 output"
        out.pow(2).mean().backward()
    assert seen == {"weight": torch.bfloat16, "input": torch.bfloat16}, seen
    kinds = {kind for kind, _ in mode.seen}
    assert kinds == {"all_gather", "reduce"}
    assert all(dtype == torch.bfloat16 for kind, dtype in mode.seen if kind == "all_gather"), mode.seen
    assert all(dtype == torch.float32 for kind, dtype in mode.seen if kind == "reduce"), mode.seen
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32, name
        assert isinstance(param.grad, DTensor) and param.grad.dtype == torch.float32, name


def check_accumulation_in_reduce_dtype(rank: int, ws: int) -> None:
    """With sync off, bf16 grads are summed in fp32; the result matches torch's fully_shard."""
    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    ours, theirs = shard_both(UnevenMLP(), policy)
    for model in (ours, theirs):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            mlp_loss(model, mlp_batch(micro, rank)).backward()
            if micro == 0 and model is ours:
                stash = ours.blocks[0]._fsdp_state.group.params[0].accumulated_grad
                assert stash is not None and stash.dtype == torch.float32
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-2, atol=1e-4, msg=name)


def check_cpu_offload(rank: int, ws: int) -> None:
    def shard(model: nn.Module) -> None:
        policy = fl.CPUOffloadPolicy(pin_memory=False)
        for block in model.blocks:
            fl.fully_shard(block, offload_policy=policy)
        fl.fully_shard(model, offload_policy=policy)

    torch.manual_seed(0)
    model = UnevenMLP()
    train_and_compare(model, shard, mlp_batch, mlp_loss, rank, steps=3, label="cpu offload")
    mlp_loss(model, mlp_batch(7, rank)).backward()
    for name, param in model.named_parameters():
        assert param.to_local().device.type == "cpu" and param.grad.to_local().device.type == "cpu", name


def test_mixed_precision_and_offload() -> None:
    spawn_checks(
        2,
        check_losses_match_torch,
        check_dtypes,
        check_accumulation_in_reduce_dtype,
        check_cpu_offload,
    )


@pytest.mark.usefixtures("single_rank_pg")
def test_pin_memory_on_a_cpu_mesh_warns_and_falls_back() -> None:
    """A gloo job is a CPU job even where CUDA is present: nothing is pinned ([Note: device rule])."""
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"pin_memory=True\) on a 'cpu' mesh.*pin_memory=False"):
        fl.fully_shard(model, offload_policy=fl.CPUOffloadPolicy())
    assert not model.weight.to_local().is_pinned()
    model(torch.randn(2, 4)).sum().backward()
    assert model.weight.grad is not None


@pytest.mark.usefixtures("single_rank_pg")
def test_group_dtypes_must_agree() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).half())
    with pytest.raises(ValueError, match=r"2 dtypes \(float32: 0.weight, 0.bias; float16: 1.weight, 1.bias\)"):
        fl.fully_shard(model)
    fl.fully_shard(model, mp_policy=fl.MixedPrecisionPolicy(param_dtype="fp32"))  # one dtype: fine
