"""fast_host_step (issue 33): CPU-offloaded shards stepped by torch's fused CPU AdamW. On 4 gloo ranks (one spawn):
parity with the for-loop AdamW and with DDP, the state kept across the switch, ZeRO-1/2 and optimizer_only seeing
the fused step, shards the fused kernel would get wrong (uneven ``Shard(1)``), step_in_backward bit for bit with a
step after backward. In one process: the param groups after the switch, the split, the layout guard, the version
bump, the refusals and warnings.

Tolerance (``TOL``): the fused kernel and the for-loop compute the same update in a different order and round
differently: in fp32 a parameter of magnitude <= 1 differs by about one ulp (6e-8) per step, measured at most
6.7e-8 after 5 steps here (torch 2.11 and 2.13), against DDP too. ``atol=1e-6`` is 15x that and 1e-4 of one AdamW
update at lr 1e-2, so a skipped, repeated or mis-corrected step fails.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenBlock, UnevenMLP, mlp_batch, mlp_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl
from fsdp2lite.host.steps import HostSteps
from fsdp2lite.offload.host_step import fast_host_step, step_in_backward
from fsdp2lite.trace import HOST_LANE, summarize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the op counter, benchmarks' own
from _meters import OpCounter  # noqa: E402

TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}  # fused vs for-loop rounding: see the module docstring
LR = 1e-2
OFFLOAD = fl.CPUOffloadPolicy(pin_memory=False)


def offloaded_mlp(**kwargs: Any) -> nn.Module:
    """UnevenMLP (seed 0), each block then the root sharded with ``kwargs`` (default: CPU offload)."""
    torch.manual_seed(0)
    model = UnevenMLP(n_blocks=2)
    for module in [*model.blocks, model]:
        fl.fully_shard(module, **(kwargs or {"offload_policy": OFFLOAD}))
    return model


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def assert_params_close(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(full(param), full(ref_param), **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> torch.Tensor:
    loss = mlp_loss(model, mlp_batch(step, rank))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def check_parity_with_loop_and_ddp(rank: int, ws: int) -> None:
    """5 steps: losses and parameters of fast_host_step(AdamW) close to the for-loop AdamW's and DDP's, every step;
    one param group, fused; the fused kernel dispatched once per step, the for-loop's never."""
    fast, loop = offloaded_mlp(), offloaded_mlp()
    torch.manual_seed(0)
    ddp = DDP(UnevenMLP(n_blocks=2))
    start = [full(p).clone() for p in fast.parameters()]
    fast_opt = torch.optim.AdamW(fast.parameters(), lr=LR, weight_decay=0.1)
    assert fast_host_step(fast_opt) is fast_opt
    (group,) = fast_opt.param_groups
    assert group["fused"] is True and group["foreach"] is False and group["lr"] == LR and group["weight_decay"] == 0.1
    assert all(p.device.type == "cpu" and isinstance(p, DTensor) for p in group["params"])
    loop_opt = torch.optim.AdamW(loop.parameters(), lr=LR, weight_decay=0.1)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)
    for step in range(5):
        with OpCounter() as fast_ops:
            fast_loss = train_step(fast, fast_opt, step, rank)
        with OpCounter() as loop_ops:
            loop_loss = train_step(loop, loop_opt, step, rank)
        ddp_loss = train_step(ddp, ddp_opt, step, rank)
        assert fast_ops.calls["aten::_fused_adamw_"] == 1 and loop_ops.calls["aten::_fused_adamw_"] == 0
        torch.testing.assert_close(fast_loss, loop_loss, **TOL)
        torch.testing.assert_close(fast_loss, ddp_loss, **TOL)
        assert_params_close(fast, loop, f"step {step} vs for-loop")
        assert_params_close(fast, ddp.module, f"step {step} vs DDP")
    moved = max((full(p) - s).abs().max().item() for p, s in zip(fast.parameters(), start))
    assert moved > 100 * TOL["atol"], moved  # the tolerance is far below what the steps moved


def check_state_kept_across_the_switch(rank: int, ws: int) -> None:
    """fast_host_step after 2 for-loop steps: the same state tensors go on; 5 steps close to 5 for-loop steps."""
    switched, loop = offloaded_mlp(), offloaded_mlp()
    opt = torch.optim.Adam(switched.parameters(), lr=LR, amsgrad=True)
    loop_opt = torch.optim.Adam(loop.parameters(), lr=LR, amsgrad=True)
    for step in range(2):
        train_step(switched, opt, step, rank)
        train_step(loop, loop_opt, step, rank)
    before = {id(p): dict(opt.state[p]) for p in switched.parameters()}
    fast_host_step(opt)
    for step in range(2, 5):
        train_step(switched, opt, step, rank)
        train_step(loop, loop_opt, step, rank)
    for param in switched.parameters():
        state = opt.state[param]
        assert all(state[key] is before[id(param)][key] for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        assert state["step"].item() == 5
    assert_params_close(switched, loop, "switched after 2 steps")


def check_resident_groups_see_the_fused_step(rank: int, ws: int) -> None:
    """ZeRO-1/2 (resident unsharded parameters) and optimizer_only (device shards refreshed from host masters)
    notice changed shards by their version counters, which the fused kernel leaves alone: fast_host_step bumps
    them, so 4 steps stay close to the for-loop's ([Note: fused steps and version counters])."""
    for label, kwargs in (
        ("ZeRO-1/2", {"sharding": fl.ShardingPolicy(shard="optimizer"), "offload_policy": OFFLOAD}),
        ("optimizer_only", {"offload_policy": fl.CPUOffloadPolicy(pin_memory=False, optimizer_only=True)}),
    ):
        fast, loop = offloaded_mlp(**kwargs), offloaded_mlp(**kwargs)
        fast_opt = fast_host_step(torch.optim.AdamW(fast.parameters(), lr=LR))
        loop_opt = torch.optim.AdamW(loop.parameters(), lr=LR)
        for step in range(4):
            torch.testing.assert_close(train_step(fast, fast_opt, step, rank), train_step(loop, loop_opt, step, rank))
        assert_params_close(fast, loop, label)


def check_uneven_shard_1(rank: int, ws: int) -> None:
    """Shard(1) of 7 columns on 4 ranks: chunks 2, 2, 2, 1, so rank 3's weight shard is a (16, 1) view of its
    (16, 2) padded shard, strides (2, 1): not dense. It is stepped on the for-loop there (with a warning on that
    rank only), close to the for-loop everywhere; the groups are as before after every step."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 3))
        fl.fully_shard(model, offload_policy=OFFLOAD, shard_placement_fn=lambda p: Shard(p.ndim - 1))
        return model

    fast, loop = build(), build()
    fast_opt, loop_opt = torch.optim.AdamW(fast.parameters(), lr=0.1), torch.optim.AdamW(loop.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast_host_step(fast_opt)
    messages = [str(w.message) for w in caught]
    if rank == 3:
        (message,) = messages
        assert "param_groups[0][0] DTensor (16, 7) float32 (its local shard is not dense" in message, message
    else:
        assert messages == [], messages
    params = list(fast_opt.param_groups[0]["params"])
    for step in range(3):
        batch = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, opt in ((fast, fast_opt), (loop, loop_opt)):
            model(batch).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        # one group on every rank, as before the step: a checkpoint sees the same structure everywhere
        assert len(fast_opt.param_groups) == 1 and fast_opt.param_groups[0]["params"] == params
        assert_params_close(fast, loop, f"Shard(1) step {step}")


def check_step_in_backward(rank: int, ws: int) -> None:
    """Each group stepped inside backward: bit for bit fast_host_step's one step after backward (the fused kernel
    updates each tensor on its own); no gradient left after backward; remove() stops it. A factory that breaks
    its contract is refused before any hook is registered."""

    def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return fast_host_step(torch.optim.AdamW(params, lr=LR, weight_decay=0.1))

    in_backward, after = offloaded_mlp(), offloaded_mlp()
    handle = step_in_backward(in_backward, adamw)
    assert [len(opt.param_groups[0]["params"]) for opt in handle.optimizers] == [3, 6, 6]  # the root, then 2 blocks
    after_opt = adamw(list(after.parameters()))
    for step in range(5):
        loss = mlp_loss(in_backward, mlp_batch(step, rank))
        loss.backward()
        assert all(p.grad is None for p in in_backward.parameters())  # stepped and freed inside backward
        assert torch.equal(loss.detach(), train_step(after, after_opt, step, rank))
        for param, ref in zip(in_backward.parameters(), after.parameters(), strict=True):
            assert torch.equal(full(param), full(ref)), step
    for model in (in_backward, after):  # accumulation: sync off steps nothing, the synchronising microbatch steps
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        mlp_loss(model, mlp_batch(5, rank)).backward()
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
        mlp_loss(model, mlp_batch(6, rank)).backward()
    after_opt.step()
    after_opt.zero_grad()
    for param, ref in zip(in_backward.parameters(), after.parameters(), strict=True):
        assert torch.equal(full(param), full(ref)) and param.grad is None
    handle.remove()
    mlp_loss(in_backward, mlp_batch(7, rank)).backward()
    assert all(p.grad is not None for p in in_backward.parameters())

    fresh = offloaded_mlp()
    with pytest.raises(TypeError, match="takes the root fsdp2lite.FSDPModule, got Linear"):
        step_in_backward(nn.Linear(2, 2), adamw)
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer, got list"):
        step_in_backward(fresh, lambda params: params)  # type: ignore[arg-type,return-value]
    made: list[torch.optim.Optimizer] = []

    def wrong_on_the_last(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        made.append(adamw(params if len(made) < 2 else params[:1]))
        return made[-1]

    with pytest.raises(ValueError, match=r"exactly the 6 parameters it is given \(group 2\); it holds 1, 0 of them"):
        step_in_backward(fresh, wrong_on_the_last)
    mlp_loss(fresh, mlp_batch(0, rank)).backward()
    assert len(made) == 3 and all(p.grad is not None for p in fresh.parameters())  # no hook was registered


def _signal_on_grad(released: threading.Event, module: nn.Module, args: Any, output: torch.Tensor) -> None:
    """Forward hook: set ``released`` when backward computes the gradient of ``module``'s output."""
    output.register_hook(lambda grad: released.set())


def _note_signal(released: threading.Event, seen: list[bool], wait: bool, *_: Any) -> None:
    """Step pre-hook: note whether ``released`` is set (after waiting up to a minute for it, with ``wait``)."""
    seen.append(released.wait(60) if wait else released.is_set())


def check_host_step_trace(events: list[dict[str, Any]], overlap: bool) -> None:
    """One backward's trace under step_in_backward: one ``host_step`` span per group, in the order the groups
    were reduced, in the host-step lane when overlapped; ``summarize`` counts each group's step, and without
    overlap all of it as spent by backward's thread and none of it as communication (the step runs inside the
    group's reduce-scatter wait span, which keeps only the rest)."""
    steps = [e for e in events if e["name"] == "host_step"]
    assert [e["group"] for e in steps] == ["blocks.1", "blocks.0", "<root>"]
    assert {e["lane"] for e in steps} == {HOST_LANE if overlap else ""}
    rows = {row.group: row for row in summarize(events)}
    for step in steps:
        row = rows[step["group"]]
        assert row.host_step_ms == pytest.approx(step["duration_s"] * 1e3, abs=1e-9) and row.host_step_ms > 0
        waited = sum(e["duration_s"] for e in events if e["name"] == "reduce_scatter_wait" and e["group"] == row.group)
        if overlap:
            assert row.reduce_scatter_wait_ms == pytest.approx(waited * 1e3, abs=1e-9)
            assert 0 <= row.host_step_exposed_ms  # the waits for the host-step thread attributed to this group
        else:
            assert row.host_step_exposed_ms == row.host_step_ms
            assert row.reduce_scatter_wait_ms == pytest.approx((waited - step["duration_s"]) * 1e3, abs=1e-9)


def check_step_in_backward_overlaps(rank: int, ws: int) -> None:
    """Host groups step on a thread of their own while backward goes on ([Note: host steps off backward's thread]):
    with ``overlap=True`` the last block's step waits for a signal that only comes once backward has moved on to
    the first block (the gradient of the first block's output), and gets it; with ``overlap=False``, and by default
    on a CPU mesh (nothing to overlap with but the same cores), that step runs before, so the signal is not there
    yet. Each way backward returns with every group stepped and the same parameters. A step that raises makes
    ``loss.backward()`` raise its error; the groups reduced after it keep their gradients, unstepped; the next
    backward steps every group again."""
    stepped: list[nn.Module] = []
    for overlap in (True, False, None):
        off_thread = overlap is True  # None: only where the mesh's device is not the host
        model = offloaded_mlp()
        released = threading.Event()
        signalled: list[bool] = []
        model.blocks[0].register_forward_hook(partial(_signal_on_grad, released))
        handle = step_in_backward(model, lambda ps: fast_host_step(torch.optim.AdamW(ps, lr=LR)), overlap=overlap)
        assert handle.overlap is overlap
        last_block = handle.optimizers[2]  # the root's, then blocks[0]'s, blocks[1]'s: blocks[1] is reduced first
        last_block.register_step_pre_hook(partial(_note_signal, released, signalled, off_thread))
        for step in range(2):
            released.clear()
            with fl.record_trace(model) as trace:
                mlp_loss(model, mlp_batch(step, rank)).backward()
            assert all(p.grad is None for p in model.parameters()), (overlap, step)  # stepped when backward returns
        assert signalled == [off_thread, off_thread], (overlap, signalled)
        check_host_step_trace(trace.as_dicts(), off_thread)
        stepped.append(model)
    for params in zip(*(model.parameters() for model in stepped), strict=True):
        assert all(torch.equal(full(params[0]), full(param)) for param in params[1:])
    with pytest.raises(TypeError, match="overlap must be True, False or None"):
        step_in_backward(offloaded_mlp(), lambda ps: torch.optim.AdamW(ps), overlap="yes")  # type: ignore[arg-type]

    model = offloaded_mlp()
    handle = step_in_backward(model, lambda ps: fast_host_step(torch.optim.AdamW(ps, lr=LR)), overlap=True)
    before = [full(p).clone() for p in model.parameters()]

    def refuse(*_: Any) -> None:
        raise RuntimeError(f"block 1 refuses to step on rank {rank}")

    refusal = handle.optimizers[2].register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match=f"block 1 refuses to step on rank {rank}"):
        mlp_loss(model, mlp_batch(0, rank)).backward()
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(full(param), old)  # blocks[1] raised; blocks[0] and the root, reduced after it, skipped
    assert sum(p.grad is not None for p in model.parameters()) == 15  # every gradient still there, none stepped
    refusal.remove()
    for optimizer in handle.optimizers:
        optimizer.zero_grad()
    mlp_loss(model, mlp_batch(1, rank)).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(full(p), old) for p, old in zip(model.parameters(), before, strict=True))


class _BlockTwice(nn.Module):
    """One block applied twice, then a head: the block's group reduces twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = UnevenBlock(16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


def check_step_in_backward_overlap_twice_and_microbatches(rank: int, ws: int) -> None:
    """Overlapped host steps give overlap=False's parameters bit for bit where a group reduces twice in one backward
    (a block used twice: its second reduction waits for its first step, [Note: host steps off backward's thread])
    and over microbatches marked not the last backward (each still returns with every group stepped)."""
    models: dict[bool, nn.Module] = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = _BlockTwice()
        for module in (model.block, model):
            fl.fully_shard(module, offload_policy=OFFLOAD)
        step_in_backward(model, lambda ps: fast_host_step(torch.optim.AdamW(ps, lr=LR)), overlap=overlap)
        for step in range(4):
            model.set_is_last_backward(step % 2 == 1)  # type: ignore[operator]
            mlp_loss(model, mlp_batch(step, rank)).backward()
            assert all(p.grad is None for p in model.parameters()), (overlap, step)
        models[overlap] = model
    for param, ref in zip(models[True].parameters(), models[False].parameters(), strict=True):
        assert torch.equal(full(param), full(ref))


def check_step_in_backward_overlap_with_nvme_and_hsdp(rank: int, ws: int) -> None:
    """Overlapped host steps with optimizer state on NVMe (the I/O thread streams each group's state while the
    host-step thread steps it) equal in-memory offload bit for bit; on an HSDP mesh (2 x 2) they equal
    overlap=False's."""
    with tempfile.TemporaryDirectory() as nvme:
        results = []
        for policy, mesh, overlap in (
            (OFFLOAD, None, False),
            (fl.CPUOffloadPolicy(pin_memory=False, optimizer="nvme", nvme_path=nvme), None, True),
            (OFFLOAD, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), True),
            (OFFLOAD, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), False),
        ):
            model = offloaded_mlp(offload_policy=policy, **({"mesh": mesh} if mesh is not None else {}))
            step_in_backward(model, lambda ps: fast_host_step(torch.optim.AdamW(ps, lr=LR)), overlap=overlap)
            for step in range(3):
                mlp_loss(model, mlp_batch(step, rank)).backward()
            results.append([full(p) for p in model.parameters()])
    for first, second in ((0, 1), (2, 3)):
        assert all(torch.equal(a, b) for a, b in zip(results[first], results[second], strict=True)), (first, second)


def check_step_in_backward_checkpoint_round_trip(rank: int, ws: int) -> None:
    """``fl.save_checkpoint(path, model, handle.optimizers)``: the per-group optimizers saved as one state; loaded
    into a fresh model whose own optimizers already stepped elsewhere, the next steps (overlapped) equal the
    saving model's bit for bit, so parameters and every group's AdamW state came back."""
    box = [tempfile.mkdtemp(prefix="fsdp2lite_sib_") if rank == 0 else None]
    dist.broadcast_object_list(box)
    path = Path(str(box[0])) / "checkpoint"

    def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return fast_host_step(torch.optim.AdamW(params, lr=LR))

    saving = offloaded_mlp()
    saving_steps = step_in_backward(saving, adamw, overlap=True)
    for step in range(2):
        mlp_loss(saving, mlp_batch(step, rank)).backward()
    fl.save_checkpoint(path, saving, saving_steps.optimizers)
    loading = offloaded_mlp()
    loading_steps = step_in_backward(loading, adamw, overlap=True)
    mlp_loss(loading, mlp_batch(9, rank)).backward()  # other parameters and state, replaced by the load
    fl.load_checkpoint(path, loading, loading_steps.optimizers)
    for step in range(2, 4):
        for model in (saving, loading):
            mlp_loss(model, mlp_batch(step, rank)).backward()
        for param, ref in zip(loading.parameters(), saving.parameters(), strict=True):
            assert torch.equal(full(param), full(ref)), step
    dist.barrier()  # every rank has read it
    if rank == 0:
        shutil.rmtree(path.parent)


def test_fast_host_step_on_4_offloaded_ranks() -> None:
    spawn_checks(
        4,
        check_parity_with_loop_and_ddp,
        check_state_kept_across_the_switch,
        check_resident_groups_see_the_fused_step,
        check_uneven_shard_1,
        check_step_in_backward,
        check_step_in_backward_overlaps,
        check_step_in_backward_overlap_twice_and_microbatches,
        check_step_in_backward_overlap_with_nvme_and_hsdp,
        check_step_in_backward_checkpoint_round_trip,
    )


# ---- one process -------------------------------------------------------------------------------------------------


def host_param(*shape: int, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def test_groups_after_the_switch_keep_their_settings() -> None:
    a, b = host_param(4, 3), host_param(5, seed=1)
    opt = torch.optim.Adam([{"params": [a], "lr": 0.5}, {"params": [b], "weight_decay": 0.1}], lr=0.1, foreach=True)
    before = [{k: v for k, v in group.items() if k not in ("fused", "foreach")} for group in opt.param_groups]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        assert fast_host_step(opt) is opt
        fast_host_step(opt)  # again: nothing changes, one guard
    assert [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in opt.param_groups] == before
    assert all(group["fused"] is True and group["foreach"] is False for group in opt.param_groups)
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    assert not getattr(opt, "_step_supports_amp_scaling", False)  # GradScaler keeps unscaling the gradients


def test_a_fused_step_bumps_the_versions_of_what_it_stepped() -> None:
    """As the for-loop's in-place ops do: the runtime learns from them that the shards changed."""
    stepped, untouched = host_param(4, 3), host_param(2, seed=1)
    opt = fast_host_step(torch.optim.AdamW([stepped, untouched]))
    stepped.grad = torch.ones_like(stepped)
    before = (stepped._version, untouched._version)
    opt.step()
    assert stepped._version > before[0] and untouched._version == before[1]


def test_a_group_mixing_host_and_other_parameters_is_split() -> None:
    """Host floating-point parameters stay in the group, fused; device (meta here) and complex ones move to a new
    group at the end with the same hyperparameters and the old fused/foreach; the state goes on."""
    a, c = host_param(4, 3), host_param(3, seed=2)
    device = nn.Parameter(torch.empty(6, device="meta"))
    complex_param = nn.Parameter(torch.randn(2, dtype=torch.complex64))
    opt = torch.optim.AdamW([a, device, c, complex_param], lr=0.3, betas=(0.8, 0.9), weight_decay=0.2, foreach=False)
    a.grad, c.grad = torch.ones_like(a), torch.ones_like(c)
    opt.step()
    state = dict(opt.state[a])
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\[3\] tensor \(2,\) complex64 \(dtype torch.complex64"):
        fast_host_step(opt)
    host, rest = opt.param_groups
    assert host["params"] == [a, c] and rest["params"] == [device, complex_param]
    assert host["fused"] is True and host["foreach"] is False
    assert rest["fused"] is None and rest["foreach"] is False
    for key in ("lr", "betas", "weight_decay", "eps", "amsgrad", "maximize"):
        assert host[key] == rest[key], key
    assert opt.state[a]["exp_avg"] is state["exp_avg"]
    opt.step()
    assert opt.state[a]["step"].item() == 2


def test_layout_guard_steps_what_the_kernel_would_get_wrong_on_the_loop() -> None:
    """A non-dense parameter (a (5, 3) view of a (5, 4) buffer) and a contiguous one with a transposed gradient
    step exactly as the for-loop steps them; the groups are as before after each step, and after a step that
    raised the next one puts them back first."""

    def build() -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        buffer = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
        params = [nn.Parameter(buffer[:, :3]), host_param(4, 3, seed=1), host_param(6, seed=2)]
        return params, torch.optim.AdamW(params, lr=0.1)

    (view, square, plain), fast_opt = build()
    loop_params, loop_opt = build()
    assert not view.is_contiguous()
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\[0\] tensor \(5, 3\) float32 \(its local shard is not"):
        fast_host_step(fast_opt)
    for step in range(3):
        grads = [torch.randn(5, 3), torch.randn(3, 4).t(), torch.randn(6)]  # the second: strides (1, 4)
        for params, opt in (((view, square, plain), fast_opt), (loop_params, loop_opt)):
            for param, grad in zip(params, grads):
                param.grad = grad.clone() if grad.is_contiguous() else grad.t().clone().t()
            opt.step()
        assert len(fast_opt.param_groups) == 1 and fast_opt.param_groups[0]["params"] == [view, square, plain]
        assert torch.equal(view, loop_params[0]) and torch.equal(square, loop_params[1]), step  # both on the loop
        torch.testing.assert_close(plain, loop_params[2], **TOL)

    def failing_closure() -> torch.Tensor:
        raise RuntimeError("closure failed")

    with pytest.raises(RuntimeError, match="closure failed"):
        fast_opt.step(failing_closure)
    assert len(fast_opt.param_groups) == 2  # the failed step's loop group is still there ...
    fast_opt.step()  # ... until the next step puts its parameters back first
    assert len(fast_opt.param_groups) == 1 and fast_opt.param_groups[0]["params"] == [view, square, plain]


def test_what_it_cannot_speed_up_is_left_as_it_is_with_a_warning() -> None:
    p = host_param(3)
    sgd = torch.optim.SGD([p], lr=0.1)
    with pytest.warns(UserWarning, match=r"torch.optim.sgd.SGD keeps torch's default step for every group \(only"):
        assert fast_host_step(sgd) is sgd

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.warns(UserWarning, match="MyAdamW keeps torch's default step"):
        fast_host_step(MyAdamW([p]))
    opt = torch.optim.Adam([{"params": [p], "differentiable": True}, {"params": [host_param(2)]}])
    with pytest.warns(UserWarning, match=r"param_groups\[0\] \(differentiable=True: the fused kernel has no autograd"):
        fast_host_step(opt)
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[1]["fused"] is True
    on_meta = torch.optim.AdamW([nn.Parameter(torch.empty(3, device="meta"))])
    with pytest.warns(UserWarning, match="no parameter is on the host"):
        fast_host_step(on_meta)
    assert on_meta.param_groups[0]["fused"] is None


def test_a_split_after_an_lr_scheduler_is_refused_by_warning() -> None:
    """A scheduler holds one lr per group: a mixed group stays whole (warning saying what to do); a host-only group
    needs no split and is switched."""
    mixed = [host_param(3), nn.Parameter(torch.empty(2, device="meta"))]
    opt = torch.optim.AdamW([{"params": mixed}, {"params": [host_param(4, seed=1)]}], lr=0.1)
    torch.optim.lr_scheduler.LinearLR(opt, total_iters=3)
    with pytest.warns(UserWarning, match="call fast_host_step before making it"):
        fast_host_step(opt)
    assert len(opt.param_groups) == 2 and opt.param_groups[0]["params"] == mixed
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[1]["fused"] is True


def test_refuses_what_is_not_an_optimizer() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"takes a torch.optim.Optimizer \(Adam or AdamW\), got Linear"):
        fast_host_step(model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got list"):
        fast_host_step(list(model.parameters()))  # type: ignore[arg-type]


CPU = torch.device("cpu")


def test_host_steps_run_in_order_wait_for_their_parameters_and_raise_the_first_error() -> None:
    """[Note: host steps off backward's thread]: one worker, steps in submission order; ``wait_for`` waits only for
    steps submitted for the given parameters; a step that raises skips the ones queued after it and is raised by
    the next wait, which clears it; ``wait_quietly`` turns it into a warning."""
    steps = HostSteps()
    gate = threading.Event()
    log: list[str] = []
    a, b = torch.zeros(1), torch.zeros(1)
    steps.submit(lambda: log.append(f"a {gate.wait(60)}"), None, [a], "a", CPU)
    steps.submit(lambda: log.append("b"), None, [b], "b", CPU)
    steps.wait_for([torch.zeros(1)])  # neither's: returns while ``a`` waits at the gate, ``b`` queued behind it
    assert log == [] and len(steps.pending) == 2
    gate.set()
    steps.wait_for([b])
    assert log == ["a True", "b"] and steps.pending == [] and steps.wait() is False

    def refuse() -> None:
        raise ValueError("group 1 refuses")

    steps.submit(refuse, None, [a], "a", CPU)
    steps.submit(lambda: log.append("after the error"), None, [b], "b", CPU)
    with pytest.raises(ValueError, match="group 1 refuses"):
        steps.wait()
    assert log == ["a True", "b"]  # skipped, as backward's thread would have stopped
    steps.submit(lambda: log.append("c"), None, [a], "a", CPU)
    assert steps.wait() is True and log[-1] == "c"  # the error was cleared by the wait that raised it
    steps.submit(refuse, None, [a], "a", CPU)
    with pytest.warns(RuntimeWarning, match="a host step in backward also raised: ValueError"):
        steps.wait_quietly()
