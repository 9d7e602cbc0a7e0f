"""FSDP over tensor-parallel parameters: 2D (dp x tp) and HSDP + TP (replicate x shard x tp), 4 gloo ranks.

Blocks get torch's tensor parallelism first (``parallelize_module(block, mesh["tp"], {fc1: Colwise,
fc2: Rowwise})``), then ``fully_shard(block, mesh=mesh["dp"])``. Checked every step against torch's own
fully_shard on the same setup (placements, local shards, losses, gradients with their placements) and
against one process training the plain model on the whole batch (every gradient and parameter).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2lite as fl

RTOL, ATOL = 1e-5, 1e-6


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Model(nn.Module):
    """Plain input and output layers (sharded over dp only) around tensor-parallel blocks."""

    def __init__(self, hidden: int, d: int = 8, n_blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n_blocks))
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def tp_and_shard(ref: nn.Module, dp: DeviceMesh, tp: DeviceMesh, library: str, **kwargs) -> nn.Module:
    model = copy.deepcopy(ref)
    for block in model.blocks:
        parallelize_module(block, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if library == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fl.fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    return model


def batch(step: int, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's batch: one slice of 3 samples per data-parallel rank."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(slices, 3, 4, generator=g), torch.randn(slices, 3, 2, generator=g)


def dp_index(dp: DeviceMesh) -> int:
    """This rank's slice of the batch: its position among the data-parallel ranks."""
    coords = [dp.get_local_rank(i) for i in range(dp.ndim)]
    index = 0
    for i, coord in enumerate(coords):
        index = index * dp.size(i) + coord
    return index


def train_three_ways(dp: DeviceMesh, tp: DeviceMesh, hidden: int, mixed_precision: bool = False) -> None:
    torch.manual_seed(0)
    ref = Model(hidden)
    kwargs = {}
    if mixed_precision:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

        ours = tp_and_shard(
            ref, dp, tp, "fsdp2lite", mp_policy=fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
        )
        kwargs["mp_policy"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        ours = tp_and_shard(ref, dp, tp, "fsdp2lite")
    theirs = tp_and_shard(ref, dp, tp, "torch", **kwargs)
    theirs_named, ref_named = dict(theirs.named_parameters()), dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        other = theirs_named[name]
        assert isinstance(param, DTensor) and param.placements == other.placements, (name, param.placements)
        assert param.device_mesh == other.device_mesh, name
        assert torch.equal(param.to_local(), other.to_local()), name
        assert torch.equal(param.full_tensor(), ref_named[name]), name
    fc1 = ours.blocks[0].fc1.weight  # tp Shard(0) on the dim FSDP shards too: strided
    assert fc1.placements[-1] == Shard(0) and isinstance(fc1.placements[-2], _StridedShard), fc1.placements
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs, ref)]
    index = dp_index(dp)
    tol = {"rtol": 2e-2, "atol": 2e-3} if mixed_precision else {"rtol": RTOL, "atol": ATOL}
    for step in range(3):
        xs, ys = batch(step, dp.size())
        losses = []
        for model in (ours, theirs):
            loss = (model(xs[index]) - ys[index]).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], **tol)
        if not mixed_precision:
            (ref(xs.flatten(0, 1)) - ys.flatten(0, 1)).pow(2).mean().backward()
        for name, param in ours.named_parameters():
            other = theirs_named[name]
            assert param.grad.placements == other.grad.placements == param.placements, (name, param.grad.placements)
            torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), **tol)
            if not mixed_precision:
                torch.testing.assert_close(param.grad.full_tensor(), ref_named[name].grad, rtol=RTOL, atol=ATOL)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for name, param in ours.named_parameters():
            torch.testing.assert_close(param.full_tensor(), theirs_named[name].full_tensor(), **tol)
            if not mixed_precision:
                torch.testing.assert_close(param.full_tensor(), ref_named[name].detach(), rtol=RTOL, atol=ATOL)


def check_2d(rank: int, ws: int) -> None:
    """dp 2 x tp 2: hidden 12 (even pieces) and 10 (5 rows per tp rank, 3 and 2 per dp rank)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for hidden in (12, 10):
        train_three_ways(mesh["dp"], mesh["tp"], hidden)


def check_checkpoint_both_ways(rank: int, ws: int, path: str) -> None:
    """A DCP checkpoint of fsdp2lite's dp x tp model loads into torch's fully_shard + TP model (and
    torch's into fsdp2lite's): the same DTensors, value for value."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for first, second, name in (("fsdp2lite", "torch", "a"), ("torch", "fsdp2lite", "b")):
        torch.manual_seed(0)
        source = tp_and_shard(Model(10), mesh["dp"], mesh["tp"], first)
        torch.manual_seed(1)
        target = tp_and_shard(Model(10), mesh["dp"], mesh["tp"], second)
        dcp.save(source.state_dict(), checkpoint_id=f"{path}/{name}")
        state = target.state_dict()
        dcp.load(state, checkpoint_id=f"{path}/{name}")
        target.load_state_dict(state)
        for (key, mine), (_, theirs) in zip(target.named_parameters(), source.named_parameters()):
            assert mine.placements == theirs.placements, key
            assert torch.equal(mine.full_tensor(), theirs.full_tensor()), f"{first} -> {second}: {key}"
        dist.barrier()


def check_2d_bf16(rank: int, ws: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    train_three_ways(mesh["dp"], mesh["tp"], 12, mixed_precision=True)


def check_hsdp_tp(rank: int, ws: int) -> None:
    """3D: (replicate, shard, tp) = (2, 1, 2) and (1, 2, 2); fully_shard on the 2D (replicate, shard)."""
    for shape in ((2, 1, 2), (1, 2, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
        train_three_ways(mesh["replicate", "shard"], mesh["tp"], 10)


def check_collectives_stay_on_dp(rank: int, ws: int) -> None:
    """FSDP's all-gathers and reduce-scatters run over the dp group only: each gathers 2 ranks' pieces."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = tp_and_shard(Model(12), mesh["dp"], mesh["tp"], "fsdp2lite")
    xs, _ = batch(0, 2)
    with CommDebugMode() as mode:
        model(xs[dp_index(mesh["dp"])]).sum().backward()
    gathers = {str(op): n for op, n in mode.get_comm_counts().items() if "allgather" in str(op)}
    # 3 groups in forward, the 2 resharded blocks in backward; TP's own collectives are functional ones
    assert gathers.get("c10d._allgather_base_", gathers.get("c10d::_allgather_base_", 0)) == 5, gathers


def check_bad_tp_meshes(rank: int, ws: int) -> None:
    """A DTensor parameter whose mesh is not a sibling of the fully_shard mesh is named, nothing sharded."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    block = Block(8, 12)
    block.fc1.weight = nn.Parameter(distribute_tensor(block.fc1.weight.detach(), other, [Shard(0)]))
    combine = (
        r"fc1.weight: a DTensor \(tensor parallel\?\) of Linear.*(do not combine|not a sub-mesh).*mesh\['tp'\] to "
        r"parallelize_module"
    )
    with pytest.raises(ValueError, match=combine):
        fl.fully_shard(block, mesh=mesh["dp"])
    assert not isinstance(block, fl.FSDPModule)
    block = Block(8, 12)
    block.fc2.weight = nn.Parameter(distribute_tensor(block.fc2.weight.detach(), mesh["dp"], [Shard(0)]))
    with pytest.raises(
        ValueError, match=r"fc2.weight: a DTensor \(tensor parallel\?\) of Linear.*shares dims \['dp'\]"
    ):
        fl.fully_shard(block, mesh=mesh["dp"])
    assert not isinstance(block, fl.FSDPModule)


class SPBlock(nn.Module):
    """Megatron's sequence-parallel block: a norm on this tp rank's sequence chunk, then fc1, fc2 over tp."""

    def __init__(self, d: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def sp_and_shard(ref: nn.Module, dp: DeviceMesh, tp: DeviceMesh, library: str, **kwargs: Any) -> nn.Module:
    """The norms' weights are replicated over tp and see one sequence chunk each: their grads come Partial."""
    model = copy.deepcopy(ref)
    plan = {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1))}
    plan["fc2"] = RowwiseParallel(output_layouts=Shard(1))
    if library == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fl.fully_shard
    for block in model:
        parallelize_module(block, tp, plan)
        fully_shard(block, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    return model


class TpAllReduces(TorchDispatchMode):
    """(dtype, bytes) of every tensor-parallel all-reduce (DTensor's functional collectives; FSDP's own
    collectives are c10d ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if str(func).startswith("_c10d_functional.all_reduce"):
            self.seen.append((args[0].dtype, args[0].nbytes))
        return func(*args, **(kwargs or {}))


def sp_batch(step: int, slices: int) -> torch.Tensor:
    """The whole step's batch: per dp slice, 3 sequences of 4 positions of width 8."""
    return torch.randn(slices, 3, 4, 8, generator=torch.Generator().manual_seed(step))


def check_sp_grad_reduce_dtype(rank: int, ws: int) -> None:
    """Sequence-parallel norms: the tp all-reduce of their Partial grads runs in reduce_dtype (pytorch#190626),
    one per parameter per step even over microbatches with sync off: 2 blocks x (weight, bias) x 8 fp32 =
    four all-reduces of 32 bytes. In fp32 the grads equal torch's fully_shard and one process's on the
    whole batch; with bf16 params and fp32 reduce, that process's within bf16 tolerance."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    torch.manual_seed(0)
    ref = nn.Sequential(SPBlock(), SPBlock())
    chunk = slice(2 * tp.get_local_rank(), 2 * tp.get_local_rank() + 2)  # this tp rank's sequence positions
    mp = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
    ours = {
        "fp32": sp_and_shard(ref, dp, tp, "fsdp2lite"),
        "bf16": sp_and_shard(ref, dp, tp, "fsdp2lite", mp_policy=mp),
    }
    theirs = sp_and_shard(ref, dp, tp, "torch")
    for micro in range(2):
        xs = sp_batch(micro, dp.size())
        (ref(xs.flatten(0, 1)).pow(2).sum() / dp.size()).backward()
        for label, model in ours.items():
            model.set_requires_gradient_sync(micro == 1)
            with TpAllReduces() as recorder:
                model(xs[dp.get_local_rank()][:, chunk]).float().pow(2).sum().backward()
            expected = [(torch.float32, 32)] * 4 if micro == 1 else []
            assert recorder.seen == expected, (label, micro, recorder.seen)
        theirs(xs[dp.get_local_rank()][:, chunk]).pow(2).sum().backward()
    ref_grads = dict((name, p.grad) for name, p in ref.named_parameters())
    their_grads = dict((name, p.grad.full_tensor()) for name, p in theirs.named_parameters())
    for label, model in ours.items():
        for name, param in model.named_parameters():
            assert param.grad.dtype == torch.float32 and param.grad.placements == param.placements, name
            grad, expected = param.grad.full_tensor(), ref_grads[name]
            if label == "bf16":  # bf16 compute: within 2% of the fp32 grads (by norm)
                assert (grad - expected).norm() <= 2e-2 * expected.norm(), (name, grad, expected)
                continue
            torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(grad, their_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_fsdp_with_tensor_parallel(tmp_path: Path) -> None:
    spawn_checks(
        4,
        check_2d,
        check_2d_bf16,
        check_hsdp_tp,
        check_collectives_stay_on_dp,
        functools.partial(check_checkpoint_both_ways, path=str(tmp_path)),
        check_bad_tp_meshes,
        check_sp_grad_reduce_dtype,
    )
