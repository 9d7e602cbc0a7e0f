"""The FSDP2 controls larger setups reach for, each against a reference on 2 gloo ranks.

register_fsdp_forward_method (a generate-like method that reads weights directly), set_is_last_backward
(microbatches with sync on), set_unshard_in_backward (an embedding group never all-gathered in
backward), set_all_reduce_hook (a hook on each group's reduced gradient), set_reduce_scatter_unused_params
(experts of one group used by different ranks), set_post_optim_event (CUDA only: the CPU error here,
the GPU path in test_gpu.py), and the bad inputs of each.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import ATOL, RTOL, assert_params_match, full
from test_comm_counts import counts
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl
from fsdp2lite.models import GPT, GPTConfig

UNTIED = GPTConfig(vocab_size=61, seq_len=8, d_model=16, n_heads=2, n_layers=2, tie_embeddings=False)


def shard_all(model: nn.Module, **kwargs) -> nn.Module:
    for block in model.blocks:
        fl.fully_shard(block, **kwargs)
    fl.fully_shard(model, **kwargs)
    return model


def oracle(model: nn.Module, *groups: str) -> nn.Module:
    """torch's fully_shard on a copy of the unsharded ``model``: ``groups`` (module paths), the blocks,
    then the root, on a CPU mesh."""
    from torch.distributed.fsdp import fully_shard

    twin = copy.deepcopy(model)
    mesh = cpu_mesh()
    for path in groups:
        fully_shard(twin.get_submodule(path), mesh=mesh)
    for block in twin.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(twin, mesh=mesh)
    return twin


def assert_same_as(model: nn.Module, twin: nn.Module, what: str, grads: bool = True) -> None:
    """Every full gradient (or parameter) of ``model`` equals ``twin``'s (torch's fully_shard)."""
    theirs = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        mine, other = (param.grad, theirs[name].grad) if grads else (param, theirs[name])
        assert (mine is None) == (other is None), f"{what} {name}: grad presence differs from torch's"
        if mine is not None:
            torch.testing.assert_close(full(mine), full(other), rtol=RTOL, atol=ATOL, msg=f"{what} {name}")


def step_both(model: nn.Module, ddp: nn.Module, opts: list[torch.optim.Optimizer], what: str) -> None:
    assert_params_match(model, ddp.module, f"{what} grads", grads=True)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    assert_params_match(model, ddp.module, f"{what} params", grads=False)


# ---- register_fsdp_forward_method ---------------------------------------------------------------


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """Reads the weight directly, outside forward: needs it unsharded."""
        assert not isinstance(self.lin.weight, DTensor), "score() ran on sharded parameters"
        return x @ self.lin.weight.T


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Scorer(), Scorer()])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def generate(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        """Calls forward several times and reads the head's weight between the calls."""
        for _ in range(steps):
            x = self(x)
            assert not isinstance(self.head.weight, DTensor), "generate() saw the head resharded mid-way"
            x = torch.softmax(x @ self.head.weight, dim=-1)
        return x


def check_forward_method(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = Generator()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fl.fully_shard(block)
    fl.fully_shard(model, reshard_after_forward=True)  # the root reshards too: generate must keep it
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        model(x)  # lazy init from the root
        with pytest.raises(AssertionError, match="resharded mid-way"):
            model.generate(x)  # not registered: forward's post-hook reshards the head under generate
        model.reset_iter_state()
        fl.register_fsdp_forward_method(model, "generate")
        fl.register_fsdp_forward_method(model.blocks[0], "score")
        torch.testing.assert_close(model.generate(x), ref.generate(x), rtol=RTOL, atol=ATOL)
        assert isinstance(model.head.weight, DTensor), "the root was not resharded after generate()"
        torch.testing.assert_close(model.blocks[0].score(x), ref.blocks[0].score(x), rtol=RTOL, atol=ATOL)
        assert isinstance(model.blocks[0].lin.weight, DTensor), "score() left its block unsharded"
    # with grad: a registered method's output backpropagates and is reduced like forward's
    loss = model.generate(x, steps=1).pow(2).sum()
    loss.backward()
    ddp = DDP(ref)
    ddp.module.generate(x, steps=1).pow(2).sum().backward()
    for (name, param), (_, ref_param) in zip(model.named_parameters(), ddp.module.named_parameters()):
        if ref_param.grad is None:
            continue
        dist.all_reduce(ref_param.grad)  # DDP's hooks fire on forward only: average by hand
        ref_param.grad /= ws
        torch.testing.assert_close(full(param.grad), ref_param.grad, rtol=RTOL, atol=ATOL, msg=name)
    fl.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not an FSDPModule: left alone
    with pytest.raises(ValueError, match=r"Generator has no method 'sample'"):
        fl.register_fsdp_forward_method(model, "sample")
    with pytest.raises(TypeError, match=r"method_name must be a str, got int"):
        fl.register_fsdp_forward_method(model, 3)  # type: ignore[arg-type]


# ---- set_is_last_backward ----------------------------------------------------------------------


def check_is_last_backward(rank: int, ws: int) -> None:
    """3 microbatches per step with gradient sync on: only the last backward finishes the reductions
    (the root's is still in flight after the others); the grads equal DDP's sums, every step."""
    torch.manual_seed(0)
    model = UnevenMLP()
    ddp = DDP(copy.deepcopy(model))
    twin = oracle(model)
    shard_all(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ddp, twin)]
    root = model._fsdp_state.group
    for step in range(3):
        for micro in range(3):
            last = micro == 2
            model.set_is_last_backward(last)
            twin.set_is_last_backward(last)
            batch = mlp_batch(3 * step + micro, rank)
            losses = [mlp_loss(net, batch) for net in (model, ddp, twin)]
            for loss in losses:
                loss.backward()
            torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(losses[0], losses[2], rtol=RTOL, atol=ATOL)
            in_flight = root.reduce_scatter_result is not None
            assert in_flight != last, f"step {step} micro {micro}: root reduce-scatter in flight: {in_flight}"
        assert_same_as(model, twin, f"is_last_backward step {step}")
        step_both(model, ddp, opts, f"is_last_backward step {step}")
    with pytest.raises(TypeError, match=r"is_last_backward must be True or False, got 1"):
        model.set_is_last_backward(1)  # type: ignore[arg-type]


# ---- set_unshard_in_backward -------------------------------------------------------------------


def check_unshard_in_backward(rank: int, ws: int) -> None:
    """The token embedding as its own group, never all-gathered in backward: one all-gather less per
    backward than with the default, and the same training as DDP."""
    from _models import gpt_batch, gpt_loss

    def build(flag: bool) -> tuple[nn.Module, DDP, nn.Module]:
        torch.manual_seed(0)
        model = GPT(UNTIED)
        ddp = DDP(copy.deepcopy(model))
        twin = oracle(model, "tok_emb")
        fl.fully_shard(model.tok_emb)
        shard_all(model)
        model.tok_emb.set_unshard_in_backward(flag)
        twin.tok_emb.set_unshard_in_backward(flag)
        return model, ddp, twin

    backward_gathers = {}
    for flag in (True, False):
        model, ddp, twin = build(flag)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ddp, twin)]
        for step in range(3):
            batch = gpt_batch(step, rank)
            losses = [gpt_loss(net, batch) for net in (model, ddp, twin)]
            for index, loss in enumerate(losses):
                with CommDebugMode() as mode:
                    loss.backward()
                backward_gathers[(flag, index)] = counts(mode)["all_gather"]
            torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(losses[0], losses[2], rtol=RTOL, atol=ATOL)
            assert_same_as(model, twin, f"unshard_in_backward={flag} step {step}")
            step_both(model, ddp, opts, f"unshard_in_backward={flag} step {step}")
    n = UNTIED.n_layers
    assert backward_gathers[(True, 0)] == backward_gathers[(True, 2)] == n + 1, backward_gathers  # 0 ours, 2 torch's
    assert backward_gathers[(False, 0)] == backward_gathers[(False, 2)] == n, backward_gathers
    with pytest.raises(TypeError, match=r"unshard_in_backward must be True or False, got 'no'"):
        model.tok_emb.set_unshard_in_backward("no")  # type: ignore[arg-type]


# ---- set_all_reduce_hook -----------------------------------------------------------------------


def check_all_reduce_hook(rank: int, ws: int) -> None:
    """A hook per block sees its group's reduced flat gradient once per backward (the sum over ranks,
    in the reduce dtype) and may change it: doubling it doubles exactly that group's gradients."""
    torch.manual_seed(0)
    model = UnevenMLP()
    ddp = DDP(copy.deepcopy(model))
    twin = oracle(model)
    shard_all(model)
    seen: list[tuple[int, torch.dtype, int]] = []

    def hook_for(index: int):
        def hook(reduced: torch.Tensor) -> None:
            seen.append((index, reduced.dtype, reduced.numel()))
            reduced.mul_(2.0)

        return hook

    for index, block in enumerate(model.blocks):
        block.set_all_reduce_hook(hook_for(index))
    for block in twin.blocks:
        block.set_all_reduce_hook(lambda reduced: reduced.mul_(2.0))
    padded = [sum(p.padded_numel for p in block._fsdp_state.group.params) for block in model.blocks]
    for step in range(2):
        seen.clear()
        batch = mlp_batch(step, rank)
        for net in (model, ddp, twin):
            mlp_loss(net, batch).backward()
        assert sorted(seen) == [(i, torch.float32, padded[i]) for i in range(len(padded))], seen
        assert_same_as(model, twin, f"all_reduce_hook step {step}")
        twin.zero_grad()
        for name, param in model.named_parameters():
            expected = ddp.module.get_parameter(name).grad * (2.0 if name.startswith("blocks.") else 1.0)
            torch.testing.assert_close(full(param.grad), expected, rtol=RTOL, atol=ATOL, msg=name)
            param.grad = None
        ddp.zero_grad()
    with pytest.raises(TypeError, match=r"callable hook\(tensor\) -> None, got int"):
        model.blocks[0].set_all_reduce_hook(3)  # type: ignore[arg-type]
    if torch.cuda.is_available():
        stream = torch.cuda.Stream()
        with pytest.raises(ValueError, match=r"stream=\.\.\.\) needs a CUDA mesh; this group is on a 'cpu' mesh"):
            model.blocks[0].set_all_reduce_hook(hook_for(0), stream=stream)


# ---- set_reduce_scatter_unused_params ----------------------------------------------------------


class Experts(nn.Module):
    """A mixture-of-experts layer as one group: each rank routes to the experts named for it."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.route: list[int] = list(range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(self.experts[i](x) for i in self.route)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Experts()])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks[0](self.inp(x)))


def _train_unused_params(rank: int, against_torch: bool) -> None:
    """Ranks use different experts of one group (routes change per step, an expert may be unused on
    a rank): with the flag every rank reduces the same layout, zeros for what it did not use, and
    training matches DDP(find_unused_parameters=True) and, with ``against_torch``, torch's fully_shard
    with the same flag."""
    routes = [([0], [1, 2]), ([0, 1], [2]), ([2], [0, 1, 2])]  # per step: rank 0's, rank 1's experts
    torch.manual_seed(0)
    model = MoE()
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    twin = oracle(model) if against_torch else None
    if twin is not None:
        twin.set_reduce_scatter_unused_params(True)
    shard_all(model)
    model.set_reduce_scatter_unused_params(True)
    assert all(
        g.controls.reduce_scatter_unused_params for g in (model._fsdp_state.group, model.blocks[0]._fsdp_state.group)
    )
    nets = [model, ddp] if twin is None else [model, ddp, twin]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in nets]
    for step, route in enumerate(routes):
        for net in (model, ddp.module, twin):
            if net is not None:
                net.blocks[0].route = route[rank]
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        losses = [(net(x) - y).pow(2).mean() for net in nets]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL)
        if twin is not None:
            assert_same_as(model, twin, f"unused params step {step}")
        step_both(model, ddp, opts, f"unused params step {step}")
    with pytest.raises(TypeError, match=r"reduce_scatter_unused_params must be True or False"):
        model.set_reduce_scatter_unused_params(None)  # type: ignore[arg-type]


def check_reduce_scatter_unused_params(rank: int, ws: int) -> None:
    """fsdp2lite's flag against DDP, on every torch."""
    _train_unused_params(rank, against_torch=False)


def check_reduce_scatter_unused_params_against_torch(rank: int, ws: int) -> None:
    _train_unused_params(rank, against_torch=True)


# ---- set_post_optim_event (CPU: a clear error) -------------------------------------------------


def check_post_optim_event_on_cpu(rank: int, ws: int) -> None:
    model = shard_all(UnevenMLP())
    with pytest.raises(TypeError, match=r"set_post_optim_event takes a torch.Event.*got str"):
        model.set_post_optim_event("after step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"orders CUDA streams; this model is on a 'cpu' mesh"):
        model.set_post_optim_event(torch.Event("cpu") if hasattr(torch, "Event") else None)  # type: ignore[arg-type]


def _torch_has_unused_params_flag() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


@pytest.mark.skipif(
    not _torch_has_unused_params_flag(),
    reason=f"torch {torch.__version__}'s fully_shard has no set_reduce_scatter_unused_params (torch 2.13's has): "
    "no oracle; fsdp2lite's flag is still checked against DDP in test_training_controls",
)
def test_reduce_scatter_unused_params_matches_torchs_fully_shard() -> None:
    spawn_checks(2, check_reduce_scatter_unused_params_against_torch)


def test_training_controls() -> None:
    spawn_checks(
        2,
        check_forward_method,
        check_is_last_backward,
        check_unshard_in_backward,
        check_all_reduce_hook,
        check_reduce_scatter_unused_params,
        check_post_optim_event_on_cpu,
    )
