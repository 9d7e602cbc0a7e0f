"""torch's all-gather extension protocol (issue 23, part 1): parameters whose local tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` are all-gathered through them, in the group's one
collective ([Note: all-gather extension]). A test subclass (int8 values + per-row fp32 scales,
tests/_quant_weight.py) against torch's ``fully_shard`` and against a plain model holding the dequantized
weights; torchao's NF4 (QLoRA) against torch's ``fully_shard``; bad hooks get clear errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import full
from _quant_weight import QuantWeight, dequantized, quantize_linears
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2lite as fl

RTOL, ATOL = 1e-5, 1e-6


def _even_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    quantize_linears(model)
    return model


def _shard(model: nn.Module, shard: Any, **kwargs: Any) -> None:
    for block in model.blocks if hasattr(model, "blocks") else (model[0], model[2]):
        shard(block, **kwargs)
    shard(model, **kwargs)


def _plain_twin(model: nn.Module) -> nn.Module:
    """The same model with each QuantWeight replaced by what its hooks deliver (dequantized, frozen)."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.Linear) and isinstance(module.weight, QuantWeight):
            module.weight = nn.Parameter(dequantized(module.weight._data), requires_grad=False)
    return twin


def check_against_torch(rank: int, world_size: int) -> None:
    """Frozen quantized weights, trainable biases: losses and grads equal torch's fully_shard every step,
    the pre hook called on every unshard, post building the unsharded tensor once, then refilling it."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _even_model()
    ref = copy.deepcopy(model)
    mesh = cpu_mesh()
    QuantWeight.calls.update(pre=0, post=0, post_out=0)
    _shard(model, fl.fully_shard, mesh=mesh)
    assert type(model[0].weight.to_local()) is QuantWeight  # the shard stays a subclass tensor
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        batch = mlp_batch(step, rank)
        loss = (model(batch[0]) - batch[1]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            assert QuantWeight.calls == {"pre": 4, "post": 2, "post_out": 2}, QuantWeight.calls  # fwd + bwd
    assert QuantWeight.calls == {"pre": 12, "post": 2, "post_out": 10}, QuantWeight.calls
    _shard(ref, torch_fully_shard, mesh=mesh)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        batch = mlp_batch(step, rank)
        (ref(batch[0]) - batch[1]).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, mine), theirs in zip(model.named_parameters(), ref.parameters()):
        a, b = mine.to_local(), theirs.to_local()
        a, b = (a._data, b._data) if isinstance(a, QuantWeight) else (a, b)
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)


def _train_against_twin(model: nn.Module, shard: Any, rank: int, label: str, steps: int = 3) -> None:
    """``model`` (hooked weights) sharded by ``shard`` against DDP on its dequantized twin: losses, and the
    trainable parameters' grads and values, every step (the frozen hooked weights keep their fp32 masters)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    twin = DDP(_plain_twin(model))
    shard(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    theirs = dict(twin.module.named_parameters())
    opt = torch.optim.SGD([p for _, p in trainable], lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD([theirs[n] for n, _ in trainable], lr=0.05, momentum=0.9)
    for step in range(steps):
        batch = mlp_batch(step, rank)
        loss, ref_loss = mlp_loss(model, batch), mlp_loss(twin, batch)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6, msg=f"{label} step {step} loss")
        for name, param in trainable:
            torch.testing.assert_close(full(param.grad), theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, param in trainable:
            torch.testing.assert_close(full(param.detach()), theirs[name].detach(), rtol=1e-4, atol=1e-6, msg=name)


def check_uneven_and_reshard_settings(rank: int, world_size: int) -> None:
    """Uneven shards (rows 37, 61, 16 and a 2-row head; torch's fully_shard would need the hook to pad)
    train like DDP on the dequantized weights, with the blocks resharded after forward or kept."""
    for reshard in (True, False):
        torch.manual_seed(1)
        model = UnevenMLP()
        quantize_linears(model)

        def shard(m: nn.Module, reshard: bool = reshard) -> None:
            for block in m.blocks:
                fl.fully_shard(block, mesh=cpu_mesh(), reshard_after_forward=reshard)
            fl.fully_shard(m, mesh=cpu_mesh())

        _train_against_twin(model, shard, rank, f"reshard {reshard}")


def check_one_collective_per_group(rank: int, world_size: int) -> None:
    """A group of hooked weights and plain biases is one all-gather (its bytes), not one per input."""
    model = _even_model()
    _shard(model, fl.fully_shard, mesh=cpu_mesh())
    with CommDebugMode() as mode:
        model(torch.randn(4, 16))
    counts = {str(op): n for op, n in mode.get_comm_counts().items()}
    gathers = sum(n for op, n in counts.items() if "gather" in op)
    assert gathers == 2, counts  # the two blocks (the root holds nothing)


def check_int_reshard_with_hooks(rank: int, world_size: int) -> None:
    """reshard_after_forward=2 on 4 ranks (torch's fully_shard refuses an int for hooked parameters): each
    rank keeps two of the forward all-gather's four slots, the backward regathers them over 2 ranks without
    calling the pre hook again, and training matches DDP on the dequantized twin, uneven rows included."""
    from _collectives import recorded_collectives

    torch.manual_seed(4)
    model = UnevenMLP()
    quantize_linears(model)

    def shard(m: nn.Module) -> None:
        for block in m.blocks:
            fl.fully_shard(block, mesh=cpu_mesh(), reshard_after_forward=2)
        fl.fully_shard(m, mesh=cpu_mesh())

    _train_against_twin(model, shard, rank, "reshard_after_forward=2 with hooks")
    QuantWeight.calls.update(pre=0, post=0, post_out=0)
    with recorded_collectives() as forward_calls:
        loss = mlp_loss(model, mlp_batch(9, rank))
    pre_in_forward = QuantWeight.calls["pre"]
    with recorded_collectives() as backward_calls:
        loss.backward()
    forward_gathers = [(ranks.size, n) for kind, ranks, n, _ in forward_calls if kind == "all_gather"]
    backward_gathers = [(ranks.size, n) for kind, ranks, n, _ in backward_calls if kind == "all_gather"]
    assert [size for size, _ in forward_gathers] == [4, 4, 4], forward_gathers  # root, blocks 0 and 1
    assert [size for size, _ in backward_gathers] == [2, 2], backward_gathers  # blocks 1 and 0, k=2 ranks
    assert backward_gathers[0][1] == forward_gathers[2][1]  # the same bytes: the whole block's slots
    # 3 hooked weights per block and the root's head: the pre hook runs in forward only; post refills in
    # place in forward (7) and again after each block's regather (6)
    assert (pre_in_forward, QuantWeight.calls["pre"], QuantWeight.calls["post_out"]) == (7, 7, 13), QuantWeight.calls


def check_int_reshard_mixed_dtypes(rank: int, world_size: int) -> None:
    """A group of several dtypes (a frozen bf16 layer beside fp32 ones) gathers bytes; with
    reshard_after_forward=2 it trains bit for bit like the same group with True, over 2-rank regathers."""
    results = []
    for reshard in (True, 2):
        torch.manual_seed(5)
        model = UnevenMLP()
        for block in model.blocks:
            block.mid.to(torch.bfloat16).requires_grad_(False)
            block.mid.register_forward_pre_hook(lambda m, args: (args[0].bfloat16(),))
            block.mid.register_forward_hook(lambda m, args, out: out.float())
            fl.fully_shard(block, mesh=cpu_mesh(), reshard_after_forward=reshard)
        fl.fully_shard(model, mesh=cpu_mesh())
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        run = []
        for step in range(3):
            loss = mlp_loss(model, mlp_batch(step, rank))
            loss.backward()
            run.append((loss.detach(), [full(p.grad) for p in model.parameters() if p.requires_grad]))
            opt.step()
            opt.zero_grad()
        results.append(run)
    for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(*results)):
        assert torch.equal(loss_a, loss_b), f"step {step}: {loss_a} != {loss_b}"
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b)), f"step {step} grads"


def check_hsdp_hooks_get_the_shard_mesh(rank: int, world_size: int) -> None:
    """2 replicas x 2 shards: the hook sees the 1D shard mesh; training matches the dequantized twin."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    seen: list[int] = []
    original = QuantWeight.fsdp_pre_all_gather

    def recording(self: QuantWeight, mesh_: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any) -> Any:
        seen.append(mesh_.ndim * 100 + mesh_.size())
        return original(self, mesh_, outer_size, outer_stride, module, mp)

    QuantWeight.fsdp_pre_all_gather = recording  # type: ignore[method-assign]
    try:
        torch.manual_seed(2)
        model = UnevenMLP()
        quantize_linears(model)

        def shard(m: nn.Module) -> None:
            for block in m.blocks:
                fl.fully_shard(block, mesh=mesh)
            fl.fully_shard(m, mesh=mesh)

        _train_against_twin(model, shard, rank, "HSDP hooks", steps=2)
    finally:
        QuantWeight.fsdp_pre_all_gather = original  # type: ignore[method-assign]
    assert seen and set(seen) == {102}, seen  # a 1D mesh of the 2 shard ranks


class LoRALinear(nn.Module):
    """A frozen NF4 base weight (torchao) and trainable low-rank adapters: QLoRA's layer."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(d_out, d_in, dtype=torch.bfloat16) / d_in**0.5
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.a = nn.Parameter(torch.randn(4, d_in, dtype=torch.bfloat16) * 0.01)
        self.b = nn.Parameter(torch.full((d_out, 4), 0.01, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + (x @ self.a.t()) @ self.b.t()


def check_nf4_qlora_against_torch(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def run(shard: Any) -> list[float]:
        torch.manual_seed(3)
        model = nn.Sequential(LoRALinear(128, 256), nn.ReLU(), LoRALinear(256, 128))
        _shard(model, shard, mesh=cpu_mesh())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randn(8, 128, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    mine = run(fl.fully_shard)
    assert mine == run(torch_fully_shard), mine  # bit for bit: the same bytes gathered, the same kernels
    assert mine[-1] < mine[0]  # the adapters learn


def test_extension_protocol_world2() -> None:
    checks = [check_against_torch, check_uneven_and_reshard_settings, check_one_collective_per_group]
    try:
        import torchao  # noqa: F401
    except ImportError:
        pass  # the NF4 check below says so
    else:
        checks.append(check_nf4_qlora_against_torch)
    spawn_checks(2, *checks)


def test_nf4_needs_torchao() -> None:
    pytest.importorskip("torchao", reason="torchao is not installed: pip install -e '.[dev]' (the NF4 check)")


def test_extension_hsdp_world4() -> None:
    spawn_checks(4, check_hsdp_hooks_get_the_shard_mesh, check_int_reshard_with_hooks, check_int_reshard_mixed_dtypes)


class OnlyPre(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        return (self,), None


class ThreeArgs(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, module: Any) -> Any:
        return (self,), None

    def fsdp_post_all_gather(self, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        return outputs[0], ()


class WrongShape(QuantWeight):
    def fsdp_post_all_gather(self, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        return outputs[0][:1].float(), ()


@pytest.mark.usefixtures("single_rank_pg")
@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (OnlyPre, r"'weight' \(OnlyPre\) defines only one of .*no fsdp_post_all_gather"),
        (ThreeArgs, r"'weight' \(ThreeArgs\): fsdp_pre_all_gather\(.*\) takes 3 arguments; expected \(mesh\)"),
    ],
)
def test_bad_hooks_are_refused_before_anything_is_sharded(cls: type, message: str) -> None:
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(cls), requires_grad=False)
    before = layer.weight
    with pytest.raises(ValueError, match=message):
        fl.fully_shard(layer)
    assert not isinstance(layer, fl.FSDPModule) and layer.weight is before  # nothing changed


@pytest.mark.usefixtures("single_rank_pg")
def test_a_hook_returning_the_wrong_shape_is_named() -> None:
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(WrongShape(layer.weight.detach().clone()), requires_grad=False)
    fl.fully_shard(layer)
    with pytest.raises(ValueError, match=r"'weight': fsdp_post_all_gather returned shape \(1, 4\), .*\(4, 4\)"):
        layer(torch.randn(2, 4))


@pytest.mark.usefixtures("single_rank_pg")
def test_hooked_parameters_refuse_what_they_cannot_do() -> None:
    for kwargs, message in (
        ({"shard_placement_fn": lambda p: torch.distributed.tensor.Shard(1) if p.dim() == 2 else None}, r"Shard\(1\)"),
    ):
        model = _even_model()
        with pytest.raises(ValueError, match=f"'weight' defines torch's all-gather extension.*{message}"):
            fl.fully_shard(model[0], **kwargs)
        assert not isinstance(model[0], fl.FSDPModule)
