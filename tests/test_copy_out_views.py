"""[Note: copy-out by views]: a group of one parameter sharded on dim 0 all-gathers straight into its unsharded
storage, with no copy-out and no output buffer of its own. DDP parity (uneven rows, fewer rows than ranks,
bf16 mixed precision against the plain path, CPU offload, reshard_after_forward=2, accumulation), the ops and
bytes saved counted exactly, the groups that keep their copy-out, and the one-op copy-in (the mixed-precision
cast in the same cat). One spawn of 4 gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import spawn_checks
from _models import gpt_batch, gpt_loss, tiny_gpt
from _parity import full, train_and_compare

import fsdp2lite as fl
from fsdp2lite._runtime.gather import PlainGather

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _meters import count_ops  # noqa: E402


def shard(**kwargs: object):
    """The embedding and the head sharded alone (one parameter each, as torchtitan shards them), every block,
    then the root (the position embedding and the final norm: several parameters)."""

    def apply(model: nn.Module) -> None:
        fl.fully_shard(model.tok_emb, **kwargs)
        fl.fully_shard(model.head, **kwargs)
        for block in model.blocks:
            fl.fully_shard(block, **kwargs)
        fl.fully_shard(model, **kwargs)

    return apply


class PlainAllGather:
    """A custom all-gather (torch's protocol) doing what the default does: it keeps a group on the copy-out path."""

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN204
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def untied() -> nn.Module:
    model = tiny_gpt()
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # its own group
    return model


def scenario_parity(rank: int, ws: int) -> None:
    """fp32 against DDP every step; CPU offload and host masters; reshard_after_forward=2 (the backward regathers
    over 2 ranks: the copy-out path); ZeRO-1/2 (resident storage) and HFSDP; two microbatches with clipping."""
    for kwargs, label in (
        ({}, "plain"),
        ({"offload_policy": fl.CPUOffloadPolicy(pin_memory=False)}, "offload"),
        ({"reshard_after_forward": 2}, "reshard to 2"),
        ({"sharding": fl.ShardingPolicy(shard="optimizer")}, "ZeRO-1/2: the storage kept across steps"),
        ({"offload_policy": fl.CPUOffloadPolicy(pin_memory=False, optimizer_only=True)}, "host masters"),
        (
            {
                "mesh": fl.init_mesh(replicate=2, shard=2, device_type="cpu"),
                "sharding": fl.ShardingPolicy(replicate="optimizer"),
            },
            "HFSDP",
        ),
    ):
        torch.manual_seed(0)
        train_and_compare(untied(), shard(**kwargs), gpt_batch, gpt_loss, rank, steps=3, label=label)
    torch.manual_seed(0)
    train_and_compare(untied(), shard(), gpt_batch, gpt_loss, rank, steps=2, microbatches=2, clip_norm=0.5)


def scenario_direct_only_where_it_can(rank: int, ws: int) -> None:
    """The one-parameter groups gather into their storage (tiny_gpt's vocab 64 over 4 ranks: 16 rows each;
    bf16 mixed precision too); the blocks and the root copy out. One split_with_sizes_copy per multi-parameter
    group per unshard, none for the others; bit for bit the copy-out path's gradients."""
    for mp in (None, fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
        _check_direct(mp, rank)


def _check_direct(mp: fl.MixedPrecisionPolicy | None, rank: int) -> None:
    torch.manual_seed(0)
    model, plain = untied(), untied()
    plain.load_state_dict(model.state_dict())
    shard(mp_policy=mp)(model)
    shard(mp_policy=mp)(plain)
    for module in (plain.tok_emb, plain.head):  # the same groups, forced onto the copy-out path
        module.set_custom_all_gather(PlainAllGather())
    directs: list[bool] = []
    original = PlainGather.issue

    def recording(form, comm, meters):  # noqa: ANN001, ANN202
        directs.append(form.direct)  # the all-gather writes the parameter's storage: [Note: copy-out by views]
        return original(form, comm, meters)

    PlainGather.issue = recording  # type: ignore[method-assign]
    try:
        ops = count_ops(lambda: gpt_loss(model, gpt_batch(0, rank)).backward())
    finally:
        PlainGather.issue = original  # type: ignore[method-assign]
    assert sum(directs) == 2 * 2, directs  # the embedding and the head, in forward and in backward
    assert len(directs) >= 2 + len(model.blocks) + 1
    assert ops["aten::split_with_sizes_copy"] == len(directs) - 4, (ops["aten::split_with_sizes_copy"], directs)
    gpt_loss(plain, gpt_batch(0, rank)).backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(full(a.grad), full(b.grad)), (mp, name)


def scenario_one_copy_in(rank: int, ws: int) -> None:
    """An unshard's ops, exactly, with bf16 parameters from fp32 masters: the copy-in is one cat that casts
    (no separate cast of the shards); a block then copies out once; the embedding gathers into its storage
    (no buffer, no copy-out)."""
    mp = fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = untied()
    shard(mp_policy=mp)(model)
    gpt_loss(model, gpt_batch(0, rank)).backward()  # lazy init; every unsharded storage made once
    for module, expected in (
        (model.blocks[0], {"aten::empty": 1, "aten::slice": 1, "aten::cat": 1, "c10d::_allgather_base_": 1,
                           "aten::view": 1, "aten::split_with_sizes_copy": 1}),
        (model.tok_emb, {"aten::slice": 1, "aten::cat": 1, "c10d::_allgather_base_": 1}),
    ):  # fmt: skip
        ops = count_ops(lambda module=module: (module.unshard(), module.reshard()))
        assert dict(ops) == expected, (type(module).__name__, dict(ops))


def test_copy_out_by_views_on_four_ranks() -> None:
    spawn_checks(4, scenario_parity, scenario_direct_only_where_it_can, scenario_one_copy_in)
