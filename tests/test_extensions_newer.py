"""torch's newer all-gather extension surface (issue 29, item 4): ``fsdp_pre_all_gather`` inputs given as
``AllGatherInput(tensor, dim, output_size)`` records ([Note: all-gather input records]), and hooks set on a
sharded parameter's local tensor after ``fully_shard``, looked up at every all-gather ([Note: hooks looked
up per all-gather]). Records against plain math and DDP (torch 2.13 has no records); late hooks against
torch's fully_shard (which looks them up per all-gather too) and DDP; bad records and late hooks a
group cannot take get errors naming the parameter."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _parity import full
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl

RTOL, ATOL = 1e-5, 1e-6
TAGS = torch.arange(12, dtype=torch.bfloat16).view(2, 3, 2)


class Payload(NamedTuple):
    """A record of one's own: any object with tensor, dim and output_size is read as AllGatherInput."""

    tensor: torch.Tensor
    dim: int = 0
    output_size: tuple[int, ...] | None = None


def record_kinds() -> list[Callable[..., Any]]:
    """fsdp2lite's AllGatherInput, a NamedTuple of one's own and, where torch defines it, torch's."""
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    kinds: list[Callable[..., Any]] = [fl.AllGatherInput, Payload]
    torch_record = getattr(_fsdp_api, "AllGatherInput", None)  # pytorch main, after 2.13
    return kinds + [torch_record] if torch_record is not None else kinds


def patch_hooks(local: torch.Tensor, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
    """torch's monkey-patching form: hooks bound to the sharded parameter's local tensor object."""
    local.fsdp_pre_all_gather = pre.__get__(local)  # type: ignore[attr-defined]
    local.fsdp_post_all_gather = post.__get__(local)  # type: ignore[attr-defined]


def finish_post(weight: torch.Tensor, out: torch.Tensor | None) -> Any:
    """The tail of a post hook: the new unsharded tensor the first time, later a refill of ``out``."""
    if out is None:
        return weight, (weight,)
    out.data.copy_(weight[: out.shape[0]])  # .data: autograd's saved copy must not see a new version
    return None


def record_hooks(record: Callable[..., Any], calls: list[int | None], payload_refs: list[weakref.ref]) -> tuple:
    """Hooks gathering a weight through five inputs, four of them records: its transpose along dim 1 (the
    rank-major output is reassembled), bf16 tags along dim 2, a scalar rank, the weight as a plain tensor,
    and the weight again viewed flat through output_size. The post hook checks every gathered layout."""

    def pre(local: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any) -> Any:
        rank, ws = mesh.get_local_rank(), mesh.size()
        tags = TAGS + 16 * rank
        rank_tag = torch.tensor(rank, dtype=torch.int64)
        payload_refs.extend((weakref.ref(tags), weakref.ref(rank_tag)))
        inputs = (
            record(local.t().contiguous(), dim=1),  # (cols, padded rows) -> (cols, ws * padded rows)
            record(tags, dim=2),  # (2, 3, 2) -> (2, 3, 2 * ws)
            record(rank_tag),  # () -> (ws,)
            local,  # a plain tensor: along dim 0
            record(local, 0, (ws * local.numel(),)),  # viewed flat for the post hook
        )
        return inputs, (tuple(local.shape), ws)

    @torch.no_grad()
    def post(local: torch.Tensor, outputs: tuple, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        weight_t, tags, ranks, plain, flat = outputs
        (rows, cols), ws = metadata
        assert weight_t.shape == (cols, ws * rows) and plain.shape == (ws * rows, cols), (weight_t.shape, plain.shape)
        assert torch.equal(weight_t.t(), plain), "the dim-1 record reassembled is the dim-0 gather transposed"
        assert flat.shape == (ws * rows * cols,) and torch.equal(flat, plain.reshape(-1))
        assert tags.dtype == torch.bfloat16 and torch.equal(tags, torch.cat([TAGS + 16 * r for r in range(ws)], 2))
        assert ranks.dtype == torch.int64 and torch.equal(ranks, torch.arange(ws))
        calls.append(None if out is None else id(out))
        return finish_post(weight_t.t().contiguous(), out)

    return pre, post


def check_records_train_like_ddp(rank: int, world_size: int) -> None:
    """Each kind of record, on an even (8 rows) and an uneven (5 rows over 2 ranks) weight whose hooks are
    set after fully_shard: the same losses, grads and parameters as DDP every step; post builds the
    unsharded tensor once and then refills the same one; no payload outlives its all-gather."""
    for record in record_kinds():
        for rows in (8, 5):
            torch.manual_seed(rows)
            model = nn.Linear(8, rows)
            twin = DDP(copy.deepcopy(model))
            fl.fully_shard(model, mesh=cpu_mesh(), reshard_after_forward=True)
            calls: list[int | None] = []
            payload_refs: list[weakref.ref] = []
            patch_hooks(model.weight._local_tensor, *record_hooks(record, calls, payload_refs))
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
            for step in range(2):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
                losses = [m(x).pow(2).mean() for m in (model, twin)]
                for loss in losses:
                    loss.backward()
                label = f"{getattr(record, '__name__', record)} rows {rows} step {step}"
                torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL, msg=label)
                for (name, mine), theirs in zip(model.named_parameters(), twin.module.parameters()):
                    torch.testing.assert_close(full(mine.grad), theirs.grad, rtol=RTOL, atol=ATOL, msg=name)
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            for mine, theirs in zip(model.parameters(), twin.module.parameters()):
                torch.testing.assert_close(full(mine.detach()), theirs.detach(), rtol=RTOL, atol=ATOL)
            # forward and backward all-gather each step: built once, then the same tensor refilled
            assert len(calls) == 4 and calls[0] is None and calls[1] is not None, calls
            assert calls[1:] == [calls[1]] * 3, calls
            assert [ref() for ref in payload_refs] == [None] * 8  # nothing holds the hooks' inputs


def bf16_hooks(counter: dict[str, int]) -> tuple:
    """torch's monkey-patch test's hooks: all-gather in bf16, back to the parameter dtype after."""

    def pre(local: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any) -> Any:
        counter["pre"] += 1
        return (local.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(local: torch.Tensor, outputs: tuple, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        (gathered,) = outputs
        assert gathered.dtype == torch.bfloat16, gathered.dtype
        return finish_post(gathered.to(param_dtype), out)

    return pre, post


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 2))


def _shard_blocks(model: nn.Sequential, shard: Callable[..., Any]) -> None:
    for index in (0, 2):
        shard(model[index], mesh=cpu_mesh())
    shard(model, mesh=cpu_mesh())


def check_late_hooks_like_torch(rank: int, world_size: int) -> None:
    """Hooks patched onto the weights' local tensors after fully_shard are used as torch's fully_shard uses
    them: the same number of pre-hook calls and the same losses and grads every step."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    results = []
    for shard in (fl.fully_shard, torch_fully_shard):
        model = _blocks()
        _shard_blocks(model, shard)
        counter = {"pre": 0}
        for name, param in model.named_parameters():
            if name.endswith("weight"):
                patch_hooks(param._local_tensor, *bf16_hooks(counter))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            run.append((loss.detach(), [full(p.grad) for p in model.parameters()], counter["pre"]))
            opt.step()
            opt.zero_grad()
        results.append(run)
    for step, (mine, theirs) in enumerate(zip(*results)):
        assert mine[2] == theirs[2] > 0, f"step {step}: pre-hook calls {mine[2]} != torch's {theirs[2]}"
        torch.testing.assert_close(mine[0], theirs[0], rtol=RTOL, atol=ATOL, msg=f"step {step} loss")
        for a, b in zip(mine[1], theirs[1]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"step {step} grad")


def identity_hooks(counter: dict[str, int], key: str) -> tuple:
    """Hooks that gather the padded shard as it is: the math of no hooks at all, counted."""

    def pre(local: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any) -> Any:
        counter[key] += 1
        return (local,), None

    @torch.no_grad()
    def post(local: torch.Tensor, outputs: tuple, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        return finish_post(outputs[0], out)

    return pre, post


def check_hooks_come_and_go(rank: int, world_size: int) -> None:
    """Meta init, to_empty, then hooks patched on an uneven model (torch's fully_shard would need padded
    inputs back): training matches DDP; hooks replaced by others are used from the next all-gather on;
    hooks removed return the weights to the plain all-gather (no hook call, still DDP's math)."""
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(16, 37), nn.ReLU(), nn.Linear(37, 5))
    twin = DDP(copy.deepcopy(ref))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 37), nn.ReLU(), nn.Linear(37, 5))
    for index in (0, 2):
        fl.fully_shard(model[index], mesh=cpu_mesh())
    fl.fully_shard(model, mesh=cpu_mesh())
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # full tensors: each rank keeps its rows
    counter = {"a": 0, "b": 0}
    weights = [model[0].weight, model[2].weight]
    for weight in weights:
        patch_hooks(weight._local_tensor, *identity_hooks(counter, "a"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    expected = []
    for step in range(6):
        if step == 2:
            for weight in weights:  # other hooks: used from now on
                patch_hooks(weight._local_tensor, *identity_hooks(counter, "b"))
        if step == 4:
            for weight in weights:  # none: the plain all-gather again
                del weight._local_tensor.fsdp_pre_all_gather, weight._local_tensor.fsdp_post_all_gather
        before = dict(counter)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        losses = [m(x).pow(2).mean() for m in (model, twin)]
        for loss in losses:
            loss.backward()
        expected.append({key: counter[key] - before[key] for key in counter})
        torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL, msg=f"step {step}")
        for (name, mine), theirs in zip(model.named_parameters(), twin.module.parameters()):
            torch.testing.assert_close(full(mine.grad), theirs.grad, rtol=RTOL, atol=ATOL, msg=f"{step} {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # forward + backward all-gather of both blocks per step: 4 calls of whichever hooks are set
    assert expected == [{"a": 4, "b": 0}] * 2 + [{"a": 0, "b": 4}] * 2 + [{"a": 0, "b": 0}] * 2, expected


def test_newer_extension_surface_world2() -> None:
    spawn_checks(2, check_records_train_like_ddp, check_late_hooks_like_torch, check_hooks_come_and_go)


# ---- one rank: records and late hooks a group cannot take, named ---------------------------------------
def _hooked_layer(pre_inputs: Callable[[torch.Tensor], Any], **kwargs: Any) -> nn.Linear:
    layer = nn.Linear(4, 4)
    fl.fully_shard(layer, **kwargs)

    def pre(local: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any) -> Any:
        return pre_inputs(local), None

    def post(local: torch.Tensor, outputs: tuple, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
        return finish_post(outputs[0].reshape(4, 4), out)

    patch_hooks(layer.weight._local_tensor, pre, post)
    return layer


@pytest.mark.usefixtures("single_rank_pg")
@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (lambda t: (fl.AllGatherInput(t, dim=2),), r"input 0 has dim 2 for a tensor of shape \(4, 4\); valid: -2 to 1"),
        (lambda t: (t, Payload(t, 0, (3, 4))), r"input 1 has output_size \(3, 4\) \(12 elements\), but 1 ranks'"),
        (lambda t: (fl.AllGatherInput(t, output_size=(4, -4)),), r"input 0 has output_size \(4, -4\); expected"),
        (lambda t: (Payload(None),), r"input 0 must be a plain tensor or an AllGatherInput.*Payload with tensor None"),
        (lambda t: (), r"must return \(inputs, metadata\), inputs a non-empty tuple .*got no inputs"),
    ],
)
def test_bad_records_are_named(inputs: Callable[[torch.Tensor], Any], message: str) -> None:
    layer = _hooked_layer(inputs)
    with pytest.raises(ValueError, match=r"parameter 'weight': fsdp_pre_all_gather.*" + message):
        layer(torch.randn(2, 4))


@pytest.mark.usefixtures("single_rank_pg")
def test_late_hooks_a_group_cannot_take_are_refused_at_the_all_gather() -> None:
    for kwargs, problem in (
        ({"comm_policy": fl.CommPolicy(all_gather="int8")}, "its group's CommPolicy quantizes the all-gather"),
    ):
        layer = _hooked_layer(lambda t: (t,), **kwargs)
        for _ in range(2):  # refused every time: nothing was adopted
            with pytest.raises(ValueError, match=f"parameter 'weight' defines torch's all-gather extension.*{problem}"):
                layer(torch.randn(2, 4))
            layer.reset_iter_state()  # after an exception mid-step, as the README says
    layer = nn.Linear(4, 4)
    fl.fully_shard(layer)
    layer.weight._local_tensor.fsdp_pre_all_gather = lambda mesh: ((layer.weight._local_tensor,), None)
    with pytest.raises(ValueError, match=r"'weight' \(Tensor\) defines only one of .*no fsdp_post_all_gather"):
        layer(torch.randn(2, 4))


@pytest.mark.usefixtures("single_rank_pg")
def test_hooks_on_a_replaced_local_tensor_are_used() -> None:
    """A local tensor swapped in under the DTensor (as conversions to quantized weights do) with hooks set on
    it: the runtime copies it into its padded storage at the next reset and the hooks come along (torch
    keeps the object itself)."""
    layer = nn.Linear(4, 4)
    fl.fully_shard(layer)
    weight = torch.randn(4, 4)
    counter = {"a": 0}
    patch_hooks(weight, *identity_hooks(counter, "a"))
    layer.weight._local_tensor = weight
    x = torch.randn(2, 4)
    expected = x @ weight.t() + layer.bias.full_tensor()
    assert torch.equal(layer(x), expected)
    assert counter == {"a": 1}
