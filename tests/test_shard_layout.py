"""``ShardLayout`` ([Note: padded shard] in fsdp2lite/_runtime/layout.py): its arithmetic against ``torch.chunk`` for
many (rows, ranks, alignment), and block-aligned shards (each rank's padded rows a multiple of 256, so the padding
sits between ranks' rows) training bit-identical to unaligned ones on 2 and 3 gloo ranks, with the same
``full_tensor()`` and state dict. One spawn per world size. (``tests/test_layout.py`` is the package's layout.)"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import full
from torch.distributed.tensor import DTensor, Shard

import fsdp2lite as fl
from fsdp2lite._runtime.layout import ShardLayout
from fsdp2lite._runtime.post_forward import check_post_forward
from fsdp2lite.estimate import sharded_nbytes

ALIGN = 256


def _round_up(rows: int, align: int) -> int:
    return -(-rows // align) * align


@pytest.mark.parametrize("align", [1, 2, 3, 4, ALIGN])
def test_rows_are_torch_chunks(align: int) -> None:
    """Every rank's start and real rows are torch.chunk's; padded rows are the chunk's, rounded up to ``align``."""
    for rows in range(13):
        for size in range(1, 7):
            chunks = torch.arange(rows).chunk(size) if rows else ()
            for rank in range(size):
                layout = ShardLayout((rows, 3), 0, size, rank, align)
                expect = chunks[rank].tolist() if rank < len(chunks) else []
                held = list(range(layout.start, layout.start + layout.local_rows))
                assert held == expect, (rows, size, rank, align)
                assert (layout.start_of(rank), layout.rows_of(rank)) == (layout.start, layout.local_rows)
                chunk = math.ceil(rows / size)
                assert layout.chunk_rows == chunk
                assert layout.padded_rows == _round_up(chunk, align) and layout.padded_rows % align == 0
                assert layout.padded_shape == (layout.padded_rows, 3)
                assert layout.local_shape == (layout.local_rows, 3)
                assert layout.padded_numel == layout.padded_rows * 3


def test_the_worked_examples() -> None:
    """The numbers of [Note: padded shard]."""
    plain = [ShardLayout((5,), 0, 4, r) for r in range(4)]
    assert [(x.start, x.local_rows, x.padded_rows) for x in plain] == [(0, 2, 2), (2, 2, 2), (4, 1, 2), (5, 0, 2)]
    assert plain[0].gathered_is_contiguous
    aligned = [ShardLayout((5,), 0, 2, r, align=4) for r in range(2)]
    assert [(x.start, x.local_rows, x.padded_rows) for x in aligned] == [(0, 3, 4), (3, 2, 4)]
    assert not aligned[0].gathered_is_contiguous
    gathered = aligned[0].rank_major(torch.arange(1.0, 6.0)).reshape(-1)
    assert gathered.tolist() == [1, 2, 3, 0, 4, 5, 0, 0]  # [0 1 2 p | 3 4 p p]


@pytest.mark.parametrize("align", [1, 4])
def test_rank_major_and_back(align: int) -> None:
    """``rank_major`` (the reduce-scatter's layout) puts each rank's chunk, zero-padded, in its row, on every dim;
    ``from_rank_major`` (the copy-out) gives the tensor back; a contiguous layout's rows are a prefix view."""
    whole = torch.arange(1.0, 5 * 7 * 3 + 1).view(5, 7, 3)
    for dim in range(3):
        for size in (1, 2, 3, 4, 8):
            layouts = [ShardLayout(tuple(whole.shape), dim, size, r, align) for r in range(size)]
            major = layouts[0].rank_major(whole)
            assert major.shape == (size, layouts[0].padded_numel)
            chunks = whole.chunk(size, dim)
            for rank, layout in enumerate(layouts):
                shard = major[rank].view(layout.padded_shape)
                real = shard.narrow(dim, 0, layout.local_rows)
                assert torch.equal(real, layout.local_of(whole))
                if rank < len(chunks):
                    assert torch.equal(real, chunks[rank])
                assert not shard.narrow(dim, layout.local_rows, layout.padded_rows - layout.local_rows).any()
            back = torch.empty_like(whole)
            layouts[0].from_rank_major(major.reshape(-1), back)
            assert torch.equal(back, whole), (dim, size, align)
            prefix = torch.equal(major.reshape(-1)[: whole.numel()], whole.reshape(-1))
            assert layouts[0].gathered_is_contiguous == (dim == 0 and layouts[0].padded_rows == layouts[0].chunk_rows)
            if layouts[0].gathered_is_contiguous:
                assert prefix
            elif dim == 0 and size > 1:  # aligned: padding between the ranks' rows
                assert not prefix


def test_estimates_read_the_layout() -> None:
    """The planner's shard bytes are the layout's (ceil(5 / 4) = 2 rows of 7 fp32 elements), on any dim."""
    assert sharded_nbytes(torch.empty(5, 7), 4, 0) == 2 * 7 * 4
    assert sharded_nbytes(torch.empty(5, 7), 4, 1) == ShardLayout((5, 7), 1, 4, 0).padded_numel * 4 == 5 * 2 * 4
    assert sharded_nbytes(torch.empty(5, 7), 4, -1) == 5 * 2 * 4


def test_post_forward_groups_refuse_aligned_shards() -> None:
    """A k-rank post-forward reshard keeps unaligned chunks: the setter refuses aligned shards in the plan's words."""
    aligned = SimpleNamespace(fqn="w", shard_dim=0, layout=ShardLayout((8, 2), 0, 4, 0, align=4))
    plain = SimpleNamespace(fqn="b", shard_dim=0, layout=ShardLayout((8,), 0, 4, 0))
    check_post_forward(2, 4, (plain,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 keeps torch.chunk's k-rank chunks, but .*align=4"):
        check_post_forward(2, 4, (plain, aligned))  # type: ignore[arg-type]


# ---- block-aligned shards on gloo ranks -------------------------------------------------------------------------
class Net(nn.Module):
    """A group of one parameter (16 rows: all-gathered into itself when unaligned), then uneven blocks and a root
    with rows 2 and 1 (fewer than the ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16, bias=False)
        self.mlp = UnevenMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.inp(x))


def _groups(model: Net) -> list[nn.Module]:
    return [model.inp, *model.mlp.blocks, model]


def _build(align: int, **kwargs: Any) -> Net:
    torch.manual_seed(0)
    model = Net()
    for module in _groups(model):
        fl.fully_shard(module, sharding=fl.ShardingPolicy(align=align), **kwargs)
    return model


def _check_aligned(model: Net, ws: int) -> None:
    """The aligned model's shards really are aligned: padded rows, padded shards, registered views."""
    for module in _groups(model):
        group = module._fsdp_state.group  # type: ignore[union-attr]
        for param in group.params:
            rows = param.gather_shape[param.shard_dim]
            padded = _round_up(math.ceil(rows / ws), ALIGN)
            assert param.layout.padded_rows == padded and param.padded_shard.shape[param.shard_dim] == padded
            assert param.sharded_param._local_tensor is param.local_view  # the view of the new padded shard
            assert param.local_view.shape == param.layout.local_shape
            assert not param.layout.gathered_is_contiguous
    assert not model.inp._fsdp_state.group.forms.gather.direct  # type: ignore[union-attr]  # copied out of the gathered rows


def _assert_same(model: nn.Module, ref: nn.Module, what: str, grads: bool = False) -> None:
    for (name, mine), theirs in zip(model.named_parameters(), ref.parameters()):
        a, b = (full(mine.grad), full(theirs.grad)) if grads else (full(mine), full(theirs))
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: {name} differs"  # type: ignore[arg-type]


def _assert_same_state_dicts(model: nn.Module, ref: nn.Module, what: str) -> None:
    mine, theirs = model.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs), what
    for name, value in mine.items():
        other = theirs[name]
        assert isinstance(value, DTensor) and isinstance(other, DTensor), f"{what}: {name}"
        assert value.placements == other.placements and value.shape == other.shape, f"{what}: {name}"
        assert torch.equal(value.to_local(), other.to_local()), f"{what}: {name} local"
        assert torch.equal(value.full_tensor(), other.full_tensor()), f"{what}: {name} full"


def _train_pair(rank: int, ws: int, what: str, same_batch: bool, steps: int = 3, **kwargs: Any) -> None:
    """The aligned and the unaligned model, trained side by side: every loss, gradient and parameter equal."""
    ref, model = _build(1, **kwargs), _build(ALIGN, **kwargs)
    _check_aligned(model, ws)
    direct = ref.inp._fsdp_state.group.forms.gather.direct  # type: ignore[union-attr]
    assert direct == ("comm_policy" not in kwargs), f"{what}: the unaligned one-parameter group is gathered into itself"
    _assert_same(model, ref, f"{what} at start")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for step in range(steps):
        batch = mlp_batch(step, 0 if same_batch else rank)
        loss, ref_loss = mlp_loss(model, batch), mlp_loss(ref, batch)
        assert torch.equal(loss, ref_loss), f"{what} step {step}: loss {loss.item()} != {ref_loss.item()}"
        loss.backward()
        ref_loss.backward()
        _assert_same(model, ref, f"{what} step {step} grads", grads=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _assert_same(model, ref, f"{what} step {step}")
    _assert_same_state_dicts(model, ref, what)


def _shard_mid_on_dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.shape == (61, 37) else None


def scenario_trains_as_unaligned(rank: int, ws: int) -> None:
    """Different batches per rank (2 ranks sum gradients exactly in either layout)."""
    _train_pair(rank, ws, "plain", same_batch=False)
    _train_pair(rank, ws, "Shard(1)", same_batch=False, shard_placement_fn=_shard_mid_on_dim1)
    _train_pair(rank, ws, "bf16", same_batch=False, mp_policy=fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    _train_pair(rank, ws, "offload", same_batch=False, steps=2, offload_policy=fl.CPUOffloadPolicy(pin_memory=False))
    host_masters = fl.CPUOffloadPolicy(pin_memory=False, optimizer_only=True)
    _train_pair(rank, ws, "optimizer_only", same_batch=False, steps=2, offload_policy=host_masters)
    int8 = fl.CommPolicy(all_gather="int8", reduce_scatter="all_to_all", block_size=16)
    _train_pair(rank, ws, "int8 all-gather", same_batch=False, steps=2, comm_policy=int8)


def scenario_loads_full_tensors(rank: int, ws: int) -> None:
    """A full state dict loads into aligned shards (each rank cuts its rows)."""
    ref, model = _build(1), _build(ALIGN)
    with torch.no_grad():
        for param in ref.parameters():
            param.mul_(2.0)
    model.load_state_dict({name: value.full_tensor() for name, value in ref.state_dict().items()})
    _assert_same(model, ref, "loaded")
    _check_aligned(model, ws)
    mlp_loss(model, mlp_batch(0, rank)).backward()


def scenario_three_ranks(rank: int, ws: int) -> None:
    """Three ranks sum in an order that may differ by position: the same batch everywhere keeps the sums exact."""
    _train_pair(rank, ws, "plain", same_batch=True)
    _train_pair(rank, ws, "Shard(1)", same_batch=True, shard_placement_fn=_shard_mid_on_dim1)


def test_aligned_shards_on_two_ranks() -> None:
    spawn_checks(2, scenario_trains_as_unaligned, scenario_loads_full_tensors)


def test_aligned_shards_on_three_ranks() -> None:
    spawn_checks(3, scenario_three_ranks)


# ---- the setting: ShardingPolicy(align=N), refused where aligned shards are not built ------------------------
def test_the_plan_refuses_alignment_where_it_is_not_built() -> None:
    """ZeRO-1/2, HFSDP and a k-rank post-forward reshard keep torch.chunk's unpadded chunks: with ``align > 1``
    they are refused before anything changes, naming the setting (rank 1 of 4, fake process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        flat = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
        square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        cases = [
            (flat, {"sharding": fl.ShardingPolicy(shard="optimizer", align=8)}, r"align=8\) pads.*shard='optimizer'"),
            (
                square,
                {"sharding": fl.ShardingPolicy(replicate="optimizer", align=8)},
                r"replicate='optimizer' \(HFSDP\)",
            ),
            (
                flat,
                {"sharding": fl.ShardingPolicy(align=8), "reshard_after_forward": 2},
                r"reshard_after_forward=2 keeps torch.chunk's k-rank chunks, but ShardingPolicy\(align=8\)",
            ),
        ]
        for mesh, kwargs, pattern in cases:
            block = nn.Linear(16, 16)
            with pytest.raises(ValueError, match=pattern):
                fl.fully_shard(block, mesh, **kwargs)
            assert not isinstance(block, fl.FSDPModule) and not isinstance(block.weight, DTensor)
        block = nn.Linear(16, 16)
        fl.fully_shard(block, flat, sharding=fl.ShardingPolicy(align=8), reshard_after_forward=4)  # 4 ranks: True
        assert block.weight.to_local().shape == (4, 16) and block._fsdp_state.group.params[0].layout.padded_rows == 8
    finally:
        dist.destroy_process_group()


def test_a_policy_file_asks_for_alignment() -> None:
    """``sharding: {align: N}`` in YAML: a rank count >= 1 (not a bool), kept when ``zero_stage`` sets the shard."""
    from fsdp2lite.config import ConfigError

    assert fl.FSDPConfig.model_validate({"sharding": {"align": 256}}).sharding.align == 256
    assert fl.FSDPConfig.model_validate({"zero_stage": 3, "sharding": {"align": 256}}).sharding.align == 256
    for bad in (0, True, "256"):
        with pytest.raises((ConfigError, ValueError), match="align"):
            fl.FSDPConfig.model_validate({"sharding": {"align": bad}})
