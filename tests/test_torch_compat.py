"""Drop-in compatibility with torch's ``fully_shard`` (issue 21): behaviours torch's own FSDP2 tests
found different, each checked against torch's ``fully_shard`` (the oracle, on the same CPU mesh) or
DDP, every step.

One spawn per world size; each check is a function of (rank, world_size) so a failure names it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import full, train_and_compare
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2lite as fl

RTOL, ATOL = 1e-5, 1e-6


def _torch_fully_shard() -> Callable[..., Any]:
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _shard_mlp(model: nn.Module, shard: Callable[..., Any], **kwargs: Any) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _pair(seed: int = 0, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """The same UnevenMLP sharded by fsdp2lite and by torch's fully_shard, on one CPU mesh."""
    torch.manual_seed(seed)
    model = UnevenMLP()
    ref = copy.deepcopy(model)
    mesh = cpu_mesh()
    _shard_mlp(model, fl.fully_shard, mesh=mesh, **kwargs)
    _shard_mlp(ref, _torch_fully_shard(), mesh=mesh, **kwargs)
    return model, ref


def _assert_same(model: nn.Module, ref: nn.Module, what: str, grads: bool) -> None:
    mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert list(mine) == list(theirs), f"{what}: names differ"
    for name, param in mine.items():
        a = full(param.grad) if grads else full(param.detach())
        b = full(theirs[name].grad) if grads else full(theirs[name].detach())
        if b is None:
            assert a is None, f"{what}: {name} has a grad, torch's has none"
            continue
        assert a is not None, f"{what}: {name} has no grad, torch's has one"
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _train_pair(
    model: nn.Module,
    ref: nn.Module,
    rank: int,
    what: str,
    steps: int = 3,
    batch_fn: Callable[[int, int], Any] = mlp_batch,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = mlp_loss,
) -> None:
    """SGD with momentum on both, comparing losses, grads and params at every step."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    for step in range(steps):
        batch = batch_fn(step, rank)
        loss, ref_loss = loss_fn(model, batch), loss_fn(ref, batch)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=f"{what} step {step} loss")
        _assert_same(model, ref, f"{what} step {step} grads", grads=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _assert_same(model, ref, f"{what} step {step} params", grads=False)


# ---- 1. freezing after fully_shard --------------------------------------------------------------
def check_freeze_after_shard(rank: int, world_size: int) -> None:
    """LoRA-style: requires_grad_(False) on sharded parameters after fully_shard, before the first
    forward. The frozen ones get no grad and never move; the rest train like torch's."""
    model, ref = _pair()
    frozen = ("blocks.0.up.weight", "blocks.1.mid.bias", "head.weight")
    for m in (model, ref):
        params = dict(m.named_parameters())
        for name in frozen:
            params[name].requires_grad_(False)
    before = {name: full(dict(model.named_parameters())[name].detach()).clone() for name in frozen}
    _train_pair(model, ref, rank, "frozen after fully_shard")
    params = dict(model.named_parameters())
    for name in frozen:
        assert params[name].grad is None, f"{name} is frozen but got a gradient"
        assert torch.equal(full(params[name].detach()), before[name]), f"{name} is frozen but changed"


def check_freeze_and_unfreeze_between_steps(rank: int, world_size: int) -> None:
    """Freezing after the first step (the unsharded parameter already exists) and unfreezing later
    take effect at the next forward: the frozen step leaves the parameter alone, the others match DDP."""
    torch.manual_seed(1)
    model = UnevenMLP()
    ref = copy.deepcopy(model)
    _shard_mlp(model, fl.fully_shard, mesh=cpu_mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    name = "blocks.1.up.weight"
    for step, trainable in enumerate((True, False, True)):
        dict(model.named_parameters())[name].requires_grad_(trainable)
        dict(ref.named_parameters())[name].requires_grad_(trainable)
        x, y = mlp_batch(step, 0)  # the same batch on every rank: the average is the local gradient
        mlp_loss(model, (x, y)).backward()
        mlp_loss(ref, (x, y)).backward()
        grad = dict(model.named_parameters())[name].grad
        assert (grad is not None) == trainable, f"step {step}: {name} grad present={grad is not None}"
        for (n, p), r in zip(model.named_parameters(), ref.parameters()):
            if r.grad is not None:
                torch.testing.assert_close(full(p.grad), r.grad, rtol=RTOL, atol=ATOL, msg=f"step {step} {n}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


# ---- 2. torch's replicate() composes -----------------------------------------------------------
def check_replicate_sees_fsdp2lite(rank: int, world_size: int) -> None:
    """replicate(model) over fully_shard-ed blocks manages only the root's own parameters (as with
    torch's fully_shard), so block gradients are reduced once; replicate() on a sharded module is refused."""
    from torch.distributed._composable.replicate import replicate

    torch.manual_seed(2)
    model = UnevenMLP()
    ref = copy.deepcopy(model)
    mesh = cpu_mesh()
    for block in model.blocks:
        fl.fully_shard(block, mesh=mesh)
    for block in ref.blocks:
        _torch_fully_shard()(block, mesh=mesh)
    replicate(model, device_ids=None)
    replicate(ref, device_ids=None)
    _train_pair(model, ref, rank, "replicate over fully_shard")
    managed = sum(p.numel() for p in replicate.state(model)._param_list)  # known after the first forward
    ref_managed = sum(p.numel() for p in replicate.state(ref)._param_list)
    assert managed == ref_managed == 16 + 2 * 16 + 2, (managed, ref_managed)  # scale, head weight and bias
    with pytest.raises(RuntimeError, match="already managed by `fully_shard`"):
        replicate(model.blocks[0], device_ids=None)


def check_fully_shard_state(rank: int, world_size: int) -> None:
    """fully_shard.state(module) gives the module's fsdp2lite state (torch gives its own)."""
    model, _ = _pair()
    state = fl.fully_shard.state(model.blocks[0])
    assert state is model.blocks[0]._fsdp_state
    with pytest.raises(ValueError, match="not sharded"):
        fl.fully_shard.state(nn.Linear(2, 2))


# ---- 3. HSDP meshes with any axis names (world 4) -----------------------------------------------
def check_hsdp_axis_names(rank: int, world_size: int) -> None:
    """dim 0 replicates and dim 1 shards whatever the axes are called: torchtitan's names, or none (which
    torch 2.13 refuses; the oracle then runs on the same layout, named)."""
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for mesh in (named, init_device_mesh("cpu", (2, 2))):
        torch.manual_seed(3)
        model = UnevenMLP()
        ref = copy.deepcopy(model)
        _shard_mlp(model, fl.fully_shard, mesh=mesh)
        _shard_mlp(ref, _torch_fully_shard(), mesh=named)
        names = mesh.mesh_dim_names
        for (n, p), r in zip(model.named_parameters(), ref.parameters()):
            assert p.placements == r.placements and p.to_local().shape == r.to_local().shape, n
        _train_pair(model, ref, rank, f"HSDP axes {names}")


# ---- 4. a group whose forward runs only some of its modules ------------------------------------
class NormHead(nn.Module):
    """torchtitan's shape: the norm runs in the model's forward, the output projection after it, in
    chunks, from the loss (so the group [norm, output] is used by two separate calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.norm(x)


def _chunked_loss(model: NormHead, x: torch.Tensor) -> torch.Tensor:
    h = model(x)
    return sum(model.output(chunk).pow(2).mean() for chunk in h.chunk(2))  # type: ignore[return-value]


def _x8(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def check_partial_group_forward(rank: int, world_size: int) -> None:
    """fully_shard([norm, output]) with only norm in the root's forward: grads of both as torch's,
    with the group kept unsharded after forward (torchtitan) or resharded and gathered again."""
    mesh = cpu_mesh()
    for reshard in (False, True):
        torch.manual_seed(4)
        model = NormHead()
        ref = copy.deepcopy(model)
        for m, shard in ((model, fl.fully_shard), (ref, _torch_fully_shard())):
            for block in m.blocks:
                shard(block, mesh=mesh)
            shard([m.norm, m.output], mesh=mesh, reshard_after_forward=reshard)
            shard(m, mesh=mesh)
        _train_pair(model, ref, rank, f"partial group (reshard {reshard})", batch_fn=_x8, loss_fn=_chunked_loss)


def check_group_module_never_run(rank: int, world_size: int) -> None:
    """A module of a list group that never runs in a step: its parameters get no grad, the others
    train as torch's."""
    mesh = cpu_mesh()
    torch.manual_seed(5)
    model = NormHead()
    ref = copy.deepcopy(model)
    for m, shard in ((model, fl.fully_shard), (ref, _torch_fully_shard())):
        shard([m.norm, m.output], mesh=mesh)
        shard(m, mesh=mesh)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))
        model(x).sum().backward()
        ref(x).sum().backward()
        _assert_same(model, ref, f"unused module step {step} grads", grads=True)
        assert model.output.weight.grad is None
        model.zero_grad()
        ref.zero_grad()


# ---- 6. module.to(dtype) after fully_shard ------------------------------------------------------
def check_to_dtype_after_shard(rank: int, world_size: int) -> None:
    """model.to(float64) after fully_shard: parameters, compute and gradients in float64, as torch's;
    a bf16 model .to(float32) trains in float32."""
    model, ref = _pair(seed=6)
    model.to(torch.float64)
    ref.to(torch.float64)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == r.dtype == torch.float64, n
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = (t.double() for t in mlp_batch(step, rank))
        loss, ref_loss = mlp_loss(model, (x, y)), mlp_loss(ref, (x, y))
        assert loss.dtype == torch.float64
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        _assert_same(model, ref, f"float64 step {step} grads", grads=True)
        assert all(p.grad.dtype == torch.float64 for p in model.parameters())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    torch.manual_seed(7)
    bf16 = UnevenMLP().to(torch.bfloat16)
    _shard_mlp(bf16, fl.fully_shard, mesh=cpu_mesh())
    bf16(mlp_batch(0, rank)[0].bfloat16()).sum().backward()  # unsharded params exist in bf16 now
    bf16.zero_grad()
    bf16.to(torch.float32)
    out = bf16(mlp_batch(1, rank)[0])
    assert out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad.dtype == torch.float32 and p.dtype == torch.float32 for p in bf16.parameters())


# ---- 7. post-accumulate-grad hooks on sharded parameters ----------------------------------------
def check_post_accumulate_grad_hooks(rank: int, world_size: int) -> None:
    """Optimizer in backward: a hook per sharded parameter fires once per step, after the reduced
    gradient is written; stepping there and dropping the grad trains like torch's."""
    model, ref = _pair(seed=8)
    fired: list[str] = []
    for m, log in ((model, fired), (ref, None)):
        optimizers = {p: torch.optim.SGD([p], lr=0.05) for p in m.parameters()}
        names = {id(p): n for n, p in m.named_parameters()}

        def step_in_backward(param: torch.Tensor, optimizers=optimizers, names=names, log=log) -> None:
            assert isinstance(param.grad, DTensor)
            if log is not None:
                log.append(names[id(param)])
            optimizers[param].step()
            param.grad = None

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)
    for step in range(2):
        fired.clear()
        batch = mlp_batch(step, rank)
        mlp_loss(model, batch).backward()
        mlp_loss(ref, batch).backward()
        assert sorted(fired) == sorted(n for n, _ in model.named_parameters()), fired
        assert all(p.grad is None for p in model.parameters())
        _assert_same(model, ref, f"optimizer in backward step {step}", grads=False)


# ---- 8. frozen parameters of another dtype in a group -------------------------------------------
class MixedDtypeBlock(nn.Module):
    """A frozen bf16 (and a frozen int8) weight beside fp32 trainable ones: one group."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Parameter(torch.randn(5, 8).to(torch.bfloat16), requires_grad=False)
        self.codes = nn.Parameter(torch.randint(-100, 100, (3, 8), dtype=torch.int8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.codes.float().mean() / 100
        return self.lin(x) + (x @ self.frozen.float().t()).sum(-1, keepdim=True) * scale


def _torch_shards_integer_params() -> bool:
    """torch 2.11's fully_shard makes every sharded parameter require grad first, which integer tensors
    cannot ("only Tensors of floating point dtype can require gradients"); torch 2.13's does not."""
    holder = nn.Module()
    holder.codes = nn.Parameter(torch.zeros(2, 2, dtype=torch.int8), requires_grad=False)
    try:
        _torch_fully_shard()(holder, mesh=cpu_mesh())
    except RuntimeError as exc:
        if "floating point dtype can require gradients" not in str(exc):
            raise
        return False
    return True


def check_frozen_params_of_another_dtype(rank: int, world_size: int) -> None:
    """fsdp2lite shards the frozen int8 weight on every torch; where torch's fully_shard cannot (torch
    2.11), the oracle leaves it unsharded (ignored_params): the same values, so the same math."""
    mesh = cpu_mesh()
    torch.manual_seed(9)
    model = nn.Sequential(MixedDtypeBlock(), MixedDtypeBlock())
    ref = copy.deepcopy(model)
    oracle_ignores = set() if _torch_shards_integer_params() else {block.codes for block in ref}
    for block in model:
        fl.fully_shard(block, mesh=mesh)
    fl.fully_shard(model, mesh=mesh)
    for block in ref:
        _torch_fully_shard()(block, mesh=mesh, ignored_params=oracle_ignores & {block.codes} or None)
    _torch_fully_shard()(ref, mesh=mesh, ignored_params=oracle_ignores or None)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor) and p.dtype == r.dtype, n
        if r not in oracle_ignores:
            assert p.to_local().shape == r.to_local().shape, n
    _train_pair(model, ref, rank, "mixed dtypes", steps=2, batch_fn=_x8, loss_fn=lambda m, x: m(x).pow(2).mean())


# ---- 9. torch's other FSDPModule setters, share_comm_ctx, dp_mesh_dims ---------------------------
class CountingComm:
    """torch's AllGather / ReduceScatter protocol over plain c10d, counting calls and allocations."""

    def __init__(self, kind: str) -> None:
        self.kind, self.calls, self.allocations = kind, 0, 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any = None,
                 async_op: bool = False) -> Any:  # fmt: skip
        import torch.distributed as dist

        self.calls += 1
        if self.kind == "all_gather":
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def check_comm_setters(rank: int, world_size: int) -> None:
    """Each setter's effect, against torch's fully_shard with the same setting."""
    model, ref = _pair(seed=10)
    for m in (model, ref):
        m.set_reduce_scatter_divide_factor(4.0)  # torch's older name of set_gradient_divide_factor
        m.set_force_sum_reduction_for_comms(True)  # fsdp2lite always sums, then divides
    gather, reduce = CountingComm("all_gather"), CountingComm("reduce_scatter")
    model.blocks[0].set_custom_all_gather(gather)
    model.blocks[0].set_custom_reduce_scatter(reduce)
    model.set_separate_reduce_scatter_group(True)
    model.set_overlap_reduce_scatter(True)
    model.set_reduce_scatter_max_input_buffers(2)
    _train_pair(model, ref, rank, "comm setters", steps=2)
    assert gather.calls == 2 * 2 and reduce.calls == 2, (gather.calls, reduce.calls)  # forward + backward each step
    assert gather.allocations == gather.calls and reduce.allocations == 2 * reduce.calls  # input and output
    groups = [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]
    assert all(g.forms.reduce_scatter_group is groups[0].forms.reduce_scatter_group is not None for g in groups)
    with pytest.raises(ValueError, match="max_input_buffers must be an int >= 1, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="allocate"):
        model.set_custom_all_gather(lambda *a: None)
    model.set_allocate_memory_from_process_group_for_comm(False)
    for call in (lambda: model.set_allocate_memory_from_process_group_for_comm(True), model.set_symm_mem_for_comm):
        with pytest.raises(NotImplementedError, match="not implemented. This module's mesh is 'cpu'"):
            call()


def check_share_comm_ctx(rank: int, world_size: int) -> None:
    """Two roots (pipeline stages) share one communication context after share_comm_ctx."""
    stages = [nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))]
    for stage in stages:
        fl.fully_shard(stage, mesh=cpu_mesh())
    fl.share_comm_ctx(stages)
    x = torch.randn(2, 4)
    stages[1](stages[0](x)).sum().backward()
    contexts = [stage._fsdp_state.root_context for stage in stages]
    assert contexts[0] is not contexts[1] and contexts[0].comm is contexts[1].comm
    assert contexts[0].host is contexts[1].host and contexts[0].meters is contexts[1].meters
    with pytest.raises(ValueError, match="takes FSDPModules"):
        fl.share_comm_ctx([nn.Linear(2, 2)])


class _MeshDims(NamedTuple):
    """The fields of torch's DataParallelMeshDims, for torch versions without it (2.11)."""

    shard: str
    replicate: str


def check_dp_mesh_dims_is_refused_clearly(rank: int, world_size: int) -> None:
    import torch.distributed.fsdp as torch_fsdp

    mesh_dims = getattr(torch_fsdp, "DataParallelMeshDims", _MeshDims)  # torch 2.13 has it, 2.11 not
    model = UnevenMLP()
    with pytest.raises(NotImplementedError, match=r"mesh=mesh\['dp_replicate', 'dp_shard'\]"):
        fl.fully_shard(model, dp_mesh_dims=mesh_dims(shard="dp_shard", replicate="dp_replicate"))
    assert not isinstance(model, fl.FSDPModule)


# ---- 10. small API differences -----------------------------------------------------------------
def check_small_api(rank: int, world_size: int) -> None:
    """The default mesh equals init_device_mesh's; slicing a sharded Sequential gives a plain one;
    the all-reduce hook sees the gradient as stored (averaged), as torch's hook does."""
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    fl.fully_shard(seq)
    assert seq[0].weight.device_mesh == init_device_mesh("cpu", (world_size,))
    head = seq[:2]
    assert type(head) is nn.Sequential and not isinstance(head, fl.FSDPModule) and len(head) == 2
    model, ref = _pair(seed=11)
    seen: dict[str, list[torch.Tensor]] = {"mine": [], "torch": []}
    model.blocks[1].set_all_reduce_hook(lambda t: seen["mine"].append(t.clone()))
    ref.blocks[1].set_all_reduce_hook(lambda t: seen["torch"].append(t.clone()))
    _train_pair(model, ref, rank, "all-reduce hook", steps=1)
    assert len(seen["mine"]) == len(seen["torch"]) == 1
    torch.testing.assert_close(seen["mine"][0], seen["torch"][0], rtol=RTOL, atol=ATOL)  # same layout, averaged


# ---- 11. ties across calls, channels_last ------------------------------------------------------
class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 6, bias=False)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + self.emb(x)


def check_tie_across_calls_is_refused(rank: int, world_size: int) -> None:
    """emb and head share a weight; sharding each separately would untie them silently: the first forward
    refuses, naming both, and changes nothing (fixed by one call over both, which then trains)."""
    model = TiedPair()
    for module in (model.emb, model.head):
        fl.fully_shard(module, mesh=cpu_mesh())
    fl.fully_shard(model, mesh=cpu_mesh())
    with pytest.raises(
        ValueError, match=r"sharded by two fully_shard calls \('weight' of group 'emb' and 'weight' of group 'head'\)"
    ):
        model(torch.randn(2, 4))
    assert model._fsdp_state.root_context is None  # nothing was changed: no lazy init happened
    fixed = TiedPair()
    fl.fully_shard([fixed.emb, fixed.head], mesh=cpu_mesh())
    fl.fully_shard(fixed, mesh=cpu_mesh())
    fixed(torch.randn(2, 4)).sum().backward()
    assert fixed.emb.weight is fixed.head.weight and fixed.emb.weight.grad is not None


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Conv2d(3, 5, 3), nn.Conv2d(5, 4, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def check_channels_last(rank: int, world_size: int) -> None:
    """channels_last conv weights (torch's fully_shard refuses them: non-contiguous) shard to the right
    values and train like DDP."""
    torch.manual_seed(12)
    model = ConvNet().to(memory_format=torch.channels_last)
    full_weights = [b.weight.detach().clone() for b in model.blocks]

    def shard(m: nn.Module) -> None:
        _shard_mlp(m, fl.fully_shard, mesh=cpu_mesh())
        for block, weight in zip(m.blocks, full_weights):
            assert torch.equal(block.weight.full_tensor(), weight)

    def batch(step: int, rank: int) -> torch.Tensor:
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(step + 5 * rank))
        return x.to(memory_format=torch.channels_last)

    train_and_compare(model, shard, batch, lambda m, x: m(x).pow(2).mean(), rank, steps=2, label="channels_last")


def test_positional_policies() -> None:
    """torch's policies are dataclasses: positional arguments work the same, in the same order."""
    policy = fl.MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    assert policy == fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32", cast_forward_inputs=False)
    assert fl.CPUOffloadPolicy(False).pin_memory is False
    with pytest.raises(TypeError, match="both by position and by keyword"):
        fl.MixedPrecisionPolicy(torch.bfloat16, param_dtype=torch.float32)
    with pytest.raises(TypeError, match="at most 4 positional"):
        fl.MixedPrecisionPolicy(None, None, None, True, 5)


@pytest.mark.usefixtures("single_rank_pg")
def test_world_size_one_sends_nothing() -> None:
    """One rank: no collective at all (torch sends none either), and training still works."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(13)
    model = UnevenMLP()
    ref = copy.deepcopy(model)
    _shard_mlp(model, fl.fully_shard)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        batch = mlp_batch(step, 0)
        with CommDebugMode() as mode:
            mlp_loss(model, batch).backward()
        assert mode.get_total_counts() == 0, mode.get_comm_counts()
        mlp_loss(ref, batch).backward()
        for (n, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(full(p.grad), r.grad, msg=n)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def test_torch_compat_world2() -> None:
    spawn_checks(
        2,
        check_freeze_after_shard,
        check_freeze_and_unfreeze_between_steps,
        check_replicate_sees_fsdp2lite,
        check_fully_shard_state,
        check_partial_group_forward,
        check_group_module_never_run,
        check_to_dtype_after_shard,
        check_post_accumulate_grad_hooks,
        check_frozen_params_of_another_dtype,
        check_comm_setters,
        check_share_comm_ctx,
        check_dp_mesh_dims_is_refused_clearly,
        check_small_api,
        check_tie_across_calls_is_refused,
        check_channels_last,
    )


def test_torch_compat_world4() -> None:
    spawn_checks(4, check_hsdp_axis_names)


def test_every_method_of_torchs_fsdpmodule_is_ours() -> None:
    """fsdp2lite's FSDPModule subclasses torch's (so tools recognise it): none of torch's methods, which
    reach into torch-private state, may be inherited."""
    import inspect

    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    torchs = [name for name, value in vars(TorchFSDPModule).items() if inspect.isfunction(value)]
    assert len(torchs) > 20
    inherited = [name for name in torchs if name not in vars(fl.FSDPModule)]
    assert not inherited, f"inherited from torch's FSDPModule: {inherited}"
    assert issubclass(fl.FSDPModule, TorchFSDPModule)


@pytest.mark.usefixtures("single_rank_pg")
def test_deepcopy_of_a_sharded_module_is_refused_clearly() -> None:
    model = fl.fully_shard(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(NotImplementedError, match="FSDP does not support deepcopy.*before fully_shard"):
        copy.deepcopy(model)
    plain = copy.deepcopy(nn.Sequential(nn.Linear(4, 4)))  # unsharded modules copy as always
    assert type(plain) is nn.Sequential
