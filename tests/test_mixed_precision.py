"""Mixed precision and CPU offload in the runtime.

Oracle for mixed precision: torch's fully_shard under the same policy, trained side by side; dtypes are
checked where they matter (the weights a forward sees, the collectives' buffers, the stored grads).
CPU offload on a CPU mesh is checked for exact parity with DDP and for where tensors live.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
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
                stash = ours.blocks[0]._fsdp_state.group.params[0].grads.accumulated_grad
                assert stash is not None and stash.dtype == torch.float32
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-2, atol=1e-4, msg=name)


class Branches(nn.Module):
    """Four layers into one output; ``uses`` picks which run, so a layer can miss a microbatch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 4) for _ in range(4))

    def forward(self, x: torch.Tensor, uses: tuple[str, ...]) -> torch.Tensor:
        return sum(getattr(self, name)(x) for name in uses)


MICROBATCH_USES = (("a", "c"), ("a",), ("a", "b", "c"))  # b only in the synchronising one, c not in the middle


def check_accumulation_keeps_one_reduce_dtype(rank: int, ws: int) -> None:
    """bf16 params, fp32 reduce, sync off for two microbatches: a layer missing one (c), one first used in
    the reducing one (b) and one never used (d, reduced as zeros) keep every sum and the one reduction in
    fp32 (torch's fully_shard raises on b and d: pytorch#196996), and the grads are exactly the fp32 sums
    of the bf16 microbatch grads, averaged over ranks."""
    policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
    torch.manual_seed(0)
    model = Branches()
    ref = copy.deepcopy(model).to(torch.bfloat16)
    fl.fully_shard(model, mp_policy=policy)
    model.set_reduce_scatter_unused_params(True)
    params = model._fsdp_state.group.params
    xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * m + rank)) for m in range(3)]
    with CollectiveDtypes() as mode:
        for micro, uses in enumerate(MICROBATCH_USES):
            model.set_requires_gradient_sync(micro == 2)
            model(xs[micro], uses).float().pow(2).mean().backward()
            if micro < 2:
                kept = {p.fqn: p.grads.accumulated_grad for p in params}
                stashed = {fqn: grad.dtype for fqn, grad in kept.items() if grad is not None}
                assert stashed == dict.fromkeys(["a.weight", "a.bias", "c.weight", "c.bias"], torch.float32), stashed
                assert not [kind for kind, _ in mode.seen if kind == "reduce"], mode.seen  # nothing reduced yet
    assert [dtype for kind, dtype in mode.seen if kind == "reduce"] == [torch.float32], mode.seen
    sums: dict[str, torch.Tensor] = {
        name: torch.zeros_like(p, dtype=torch.float32) for name, p in ref.named_parameters()
    }
    for x, uses in zip(xs, MICROBATCH_USES):
        ref(x.bfloat16(), uses).float().pow(2).mean().backward()
        for name, param in ref.named_parameters():
            if param.grad is not None:
                sums[name] += param.grad.float()
                param.grad = None
    for name, param in model.named_parameters():
        dist.all_reduce(sums[name])
        assert param.grad.dtype == torch.float32, (name, param.grad.dtype)
        assert torch.equal(param.grad.full_tensor(), sums[name] / ws), name
    assert not model.d.weight.grad.full_tensor().any()  # never used: reduced as zeros


@dataclasses.dataclass
class Inner:
    y: torch.Tensor
    ids: torch.Tensor  # integer: never cast


@dataclasses.dataclass(frozen=True)
class Inputs:
    x: torch.Tensor
    inner: Inner
    extra: list[torch.Tensor]
    scale: float = 0.5


@dataclasses.dataclass
class Outputs:
    out: torch.Tensor
    parts: tuple[torch.Tensor, ...]


class DataclassModel(nn.Module):
    """Takes and returns dataclasses; records what its forward was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list[tuple[Any, ...]] = []

    def forward(self, inputs: Inputs) -> Outputs:
        inner, extra = inputs.inner, inputs.extra[0]
        self.seen.append((type(inputs), type(inner), inputs.x.dtype, inner.y.dtype, inner.ids.dtype, extra.dtype))
        first, second = self.lin(inputs.x), self.lin(inner.y) * inputs.scale
        return Outputs(first + second + extra, (first, second))


def make_inputs(rank: int) -> Inputs:
    g = torch.Generator().manual_seed(rank)
    inner = Inner(torch.randn(2, 8, generator=g).requires_grad_(), torch.arange(2))
    return Inputs(torch.randn(2, 8, generator=g), inner, [torch.randn(2, 8, generator=g)])


def check_dataclass_inputs_cast_like_torch(rank: int, ws: int) -> None:
    """cast_forward_inputs casts the tensors inside dataclass inputs (nested ones too) into new instances, and
    output_dtype those of a dataclass output, as torch's fully_shard does: the forward sees what torch's sees
    and returns the same, the caller's objects keep their fp32 tensors. The backward reaches the group
    through the dataclass output (torch 2.11's fully_shard misses it): the grads are exactly one bf16
    process's, reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    torch.manual_seed(0)
    ref = DataclassModel()
    models = [copy.deepcopy(ref) for _ in range(2)]
    fl.fully_shard(models[0], mesh=cpu_mesh(), mp_policy=fl.MixedPrecisionPolicy(**policy))
    torch_fully_shard(models[1], mesh=cpu_mesh(), mp_policy=TorchMP(**policy))
    inputs = make_inputs(rank)
    result = models[0](inputs)
    result.out.sum().backward()
    with torch.no_grad():
        torch_result = models[1](make_inputs(rank))
    assert models[0].seen == models[1].seen == [(Inputs, Inner, *[torch.bfloat16] * 2, torch.int64, torch.bfloat16)]
    assert type(result) is Outputs and torch.equal(result.out, torch_result.out), result
    assert [t.dtype for t in (result.out, *result.parts)] == [torch.float32] * 3
    assert all(torch.equal(a, b) for a, b in zip(result.parts, torch_result.parts))
    assert inputs.inner.y.dtype == inputs.x.dtype == inputs.extra[0].dtype == torch.float32  # the caller's
    ref_inputs = make_inputs(rank)
    x, inner, extra = ref_inputs.x, ref_inputs.inner, ref_inputs.extra[0]
    bf16 = Inputs(x.bfloat16(), Inner(inner.y.bfloat16(), inner.ids), [extra.bfloat16()])
    ref.to(torch.bfloat16)(bf16).out.float().sum().backward()
    weight_grad = ref.lin.weight.grad.float()
    dist.all_reduce(weight_grad)
    assert torch.equal(models[0].lin.weight.grad.full_tensor(), weight_grad / ws)
    assert torch.equal(inputs.inner.y.grad, ref_inputs.inner.y.grad)  # through the dataclass input's cast


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
        check_accumulation_keeps_one_reduce_dtype,
        check_dataclass_inputs_cast_like_torch,
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


@dataclasses.dataclass
class Derived:
    x: torch.Tensor
    doubled: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.doubled = self.x * 2


@pytest.mark.usefixtures("single_rank_pg")
def test_dataclass_inputs_with_init_false_fields_are_cast() -> None:
    """torch's fully_shard raises for these (``dataclasses.replace`` of an ``init=False`` field): the init
    fields are cast into a new instance and ``__post_init__`` derives the others from them."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    layer = nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda m, args: seen.append((args[0].x.dtype, args[0].doubled.dtype)))
    fl.fully_shard(layer, mp_policy=fl.MixedPrecisionPolicy(param_dtype="bf16"))
    original = Derived(torch.randn(2, 4))
    layer.forward = lambda inputs: nn.Linear.forward(layer, inputs.x + inputs.doubled)  # type: ignore[method-assign]
    assert layer(original).dtype == torch.bfloat16
    assert seen == [(torch.bfloat16, torch.bfloat16)] and original.doubled.dtype == torch.float32
