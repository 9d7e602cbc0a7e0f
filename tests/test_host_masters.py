"""ZeRO-Offload's shape (``CPUOffloadPolicy(optimizer_only=True)``, ``offload: {device: cpu, optimizer_only:
true}``): shards stay where the all-gathers read them, masters, gradients and optimizer state on the host. DDP
parity, bit for bit full CPU offload under AdamW, one host-to-device copy per parameter per step, never stale,
checkpoints, meta init, refusals. One spawn of 4 gloo ranks; a gpu test checks the devices themselves."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss, tiny_gpt
from _parity import full, train_and_compare
from torch.distributed.tensor import DTensor

import fsdp2lite as fl

OPTIMIZER_ONLY = fl.CPUOffloadPolicy(pin_memory=False, optimizer_only=True)
FULL = fl.CPUOffloadPolicy(pin_memory=False)


def shard(offload, mesh=None, **kwargs):
    def apply(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, mesh, offload_policy=offload, **kwargs)
        fl.fully_shard(model, mesh, offload_policy=offload, **kwargs)

    return apply


def _groups(model: nn.Module) -> list:
    return [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]


def _syncs(model: nn.Module) -> list:
    return [sync for group in _groups(model) for sync in group.storages]


def scenario_parity_with_ddp(rank: int, ws: int) -> None:
    """fp32 against DDP, every step: losses, grads, params; uneven rows; accumulation with clipping."""
    torch.manual_seed(0)
    train_and_compare(tiny_gpt(), shard(OPTIMIZER_ONLY), gpt_batch, gpt_loss, rank, steps=5, label="optimizer_only")
    torch.manual_seed(1)
    train_and_compare(
        UnevenMLP(), shard(OPTIMIZER_ONLY), mlp_batch, mlp_loss, rank, steps=3, microbatches=2, clip_norm=0.05,
        label="optimizer_only uneven, accumulating, clipped",
    )  # fmt: skip


def scenario_bitwise_full_offload(rank: int, ws: int) -> None:
    """The same reduced gradients and the same host AdamW: bit for bit full CPU offload, in fp32 and with bf16
    mixed precision, on a 1-D mesh and on HSDP (2, 2)."""
    bf16 = fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for extra in ({}, {"mp_policy": bf16}, {"mesh": fl.init_mesh(replicate=2, shard=2, device_type="cpu")}):
        torch.manual_seed(0)
        full_offload, masters = tiny_gpt(), tiny_gpt()
        masters.load_state_dict(full_offload.state_dict())
        shard(FULL, **extra)(full_offload)
        shard(OPTIMIZER_ONLY, **extra)(masters)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (full_offload, masters)]
        for step in range(3):
            losses = []
            for model, opt in zip((full_offload, masters), opts):
                losses.append(gpt_loss(model, gpt_batch(step, rank)))
                losses[-1].backward()
                opt.step()
                opt.zero_grad()
            assert torch.equal(losses[0], losses[1]), (extra, step, losses)
        for a, b in zip(full_offload.parameters(), masters.parameters()):
            assert torch.equal(full(a), full(b)), extra


def scenario_frozen_base_has_no_master(rank: int, ws: int) -> None:
    """A block frozen before fully_shard (LoRA's base) keeps its shards on the device with no host copy; the
    rest steps bit for bit as under full offload."""
    from fsdp2lite._runtime.host_masters import HostMasters

    torch.manual_seed(0)
    whole, masters = UnevenMLP(), UnevenMLP()
    masters.load_state_dict(whole.state_dict())
    for model in (whole, masters):
        model.blocks[0].requires_grad_(False)
    shard(FULL)(whole)
    shard(OPTIMIZER_ONLY)(masters)
    root, frozen, trained = _groups(masters)  # modules() order: the root, blocks.0, blocks.1
    assert frozen.storages == () and not any(isinstance(p.storage, HostMasters) for p in frozen.params)
    assert all(isinstance(p.storage, HostMasters) for group in (root, trained) for p in group.params)
    assert len(root.storages) == len(trained.storages) == 1
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (whole, masters)]
    for step in range(3):
        losses = []
        for model, opt in zip((whole, masters), opts):
            losses.append(mlp_loss(model, mlp_batch(step, rank)))
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        assert torch.equal(losses[0], losses[1]), step
    for a, b in zip(whole.parameters(), masters.parameters()):
        assert torch.equal(full(a), full(b))


def scenario_fused_steps_are_seen(rank: int, ws: int) -> None:
    """torch's fused AdamW writes the parameters without moving their version counters; ZeRO-1/2, HFSDP and
    optimizer_only still see its steps ([Note: fused steps bump no version]): the same losses as the for-loop
    AdamW, step by step (fused and for-loop differ by rounding only; a stale forward would be off by ~1e-2)."""
    mesh = fl.init_mesh(replicate=2, shard=2, device_type="cpu")
    setups = {
        "zero-1/2": {"sharding": fl.ShardingPolicy(shard="optimizer")},
        "hfsdp": {"sharding": fl.ShardingPolicy(replicate="optimizer"), "mesh": mesh},
        "optimizer_only": {"offload": OPTIMIZER_ONLY},
    }
    for label, setup in setups.items():
        torch.manual_seed(0)
        fused, loop = UnevenMLP(), UnevenMLP()
        loop.load_state_dict(fused.state_dict())
        for model in (fused, loop):
            shard(setup.get("offload"), setup.get("mesh"), sharding=setup.get("sharding"))(model)
        opts = [torch.optim.AdamW(fused.parameters(), lr=1e-2, fused=True)]
        opts.append(torch.optim.AdamW(loop.parameters(), lr=1e-2, foreach=False))
        for step in range(4):
            losses = []
            for model, opt in zip((fused, loop), opts):
                losses.append(mlp_loss(model, mlp_batch(step, rank)))
                losses[-1].backward()
                opt.step()
                opt.zero_grad()
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6, msg=f"{label} step {step}")


def scenario_one_copy_per_step(rank: int, ws: int) -> None:
    """The registered shard is the master (its own storage, beside the shard the all-gather reads); each
    group's masters are copied once per step, after the step, and not for a forward without one."""
    torch.manual_seed(0)
    model = UnevenMLP()
    shard(OPTIMIZER_ONLY)(model)
    for group in _groups(model):
        for param in group.params:
            master = param.sharded_param._local_tensor
            host = param.storage.host_padded
            assert master.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
            assert param.padded_shard.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    syncs = _syncs(model)
    for step in range(3):
        mlp_loss(model, mlp_batch(step, rank)).backward()
        assert all(isinstance(p.grad, DTensor) and p.grad.to_local().device.type == "cpu" for p in model.parameters())
        opt.step()
        opt.zero_grad()
        assert [sync.copies for sync in syncs] == [step] * len(syncs)  # copied at the next forward, not yet
        with torch.no_grad():
            mlp_loss(model, mlp_batch(step, rank))
            mlp_loss(model, mlp_batch(step, rank))  # nothing changed: no second copy
        assert [sync.copies for sync in syncs] == [step + 1] * len(syncs)
    padded = sum(p.storage.host_padded.nbytes for group in _groups(model) for p in group.params)
    assert sum(sync.copied_bytes for sync in syncs) == 3 * padded  # one padded shard per parameter per step


def scenario_never_stale(rank: int, ws: int) -> None:
    """copy_, a full load_state_dict, a write through .data after model.reshard(), and a model built on meta,
    each reach the next forward."""
    torch.manual_seed(0)
    model, ref = UnevenMLP(), UnevenMLP()
    ref.load_state_dict(model.state_dict())
    shard(OPTIMIZER_ONLY)(model)
    batch = mlp_batch(0, rank)

    def same(target: nn.Module) -> None:
        with torch.no_grad():
            torch.testing.assert_close(mlp_loss(target, batch), mlp_loss(ref, batch), rtol=1e-5, atol=1e-6)

    same(model)
    with torch.no_grad():
        for param, ref_param in zip(model.parameters(), ref.parameters()):
            ref_param.mul_(0.5)
            param.mul_(0.5)  # in place on the master
    same(model)
    state = {k: v + 1 for k, v in ref.state_dict().items()}
    ref.load_state_dict(state)
    model.load_state_dict(state)  # full tensors: each rank takes its rows
    same(model)
    with torch.no_grad():
        for param, ref_param in zip(model.parameters(), ref.parameters()):
            ref_param.add_(1.0)
            param.data.to_local().add_(1.0)  # bypasses the version counters ...
    model.reshard()  # ... so the next forward copies every master
    same(model)
    with torch.device("meta"):
        built = UnevenMLP()
    shard(OPTIMIZER_ONLY)(built)
    built.to_empty(device="cpu")
    built.load_state_dict(ref.state_dict())
    same(built)


def scenario_checkpoint_and_policy_file(rank: int, ws: int) -> None:
    """A DCP checkpoint with AdamW state saved under optimizer_only loads into plain FSDP, equal; a policy
    file's ``offload: {device: cpu, optimizer_only: true}`` per rule gives host masters to those groups only."""
    torch.manual_seed(0)
    source, target = tiny_gpt(), tiny_gpt()
    shard(OPTIMIZER_ONLY)(source)
    shard(None)(target)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (source, target)]
    gpt_loss(source, gpt_batch(0, rank)).backward()
    opts[0].step()
    opts[0].zero_grad()
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    fl.save_checkpoint(directory[0], source, opts[0])
    fl.load_checkpoint(directory[0], target, opts[1])
    for model, opt in zip((source, target), opts):
        gpt_loss(model, gpt_batch(1, rank)).backward()
        opt.step()
    for (name, a), b in zip(source.named_parameters(), target.parameters()):
        assert torch.equal(full(a), full(b)), name
    rules = [{"match": {"class": "Block"}, "offload": {"device": "cpu", "pin_memory": False, "optimizer_only": True}}]
    model = tiny_gpt()
    fl.apply_config(model, fl.FSDPConfig.model_validate({"wrap": rules}))
    assert [len(group.storages) for group in _groups(model)] == [0, 1, 1]  # the root, then the blocks


def scenario_refusals(rank: int, ws: int) -> None:
    mesh = fl.init_mesh(replicate=2, shard=2, device_type="cpu")
    model = UnevenMLP()
    with pytest.raises(ValueError, match=r"optimizer_only=True\) and ShardingPolicy\(replicate='optimizer'\)"):
        fl.fully_shard(model, mesh, offload_policy=OPTIMIZER_ONLY, sharding=fl.ShardingPolicy(replicate="optimizer"))
    assert not isinstance(model, fl.FSDPModule)


def test_host_masters_on_four_ranks() -> None:
    spawn_checks(
        4,
        scenario_parity_with_ddp,
        scenario_bitwise_full_offload,
        scenario_frozen_base_has_no_master,
        scenario_fused_steps_are_seen,
        scenario_one_copy_per_step,
        scenario_never_stale,
        scenario_checkpoint_and_policy_file,
        scenario_refusals,
    )


def test_policy_values() -> None:
    assert fl.FSDPConfig.model_validate({"offload": {"device": "cpu", "optimizer_only": True}}).offload.to_policy() == (
        fl.CPUOffloadPolicy(optimizer_only=True)
    )
    with pytest.raises(ValueError, match="optimizer_only: true moves the optimizer to the host, but device is 'none'"):
        fl.FSDPConfig.model_validate({"offload": {"optimizer_only": True}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the shards on the GPU, the masters on the host")
def test_shards_on_the_gpu_masters_pinned_on_the_host() -> None:
    from _dist import spawn

    spawn(_run_on_gpu, 1)


def _run_on_gpu(rank: int, ws: int) -> None:
    torch.cuda.set_device(0)
    mesh = fl.init_mesh(device_type="cuda")
    torch.manual_seed(0)
    model, ref = UnevenMLP().cuda(), UnevenMLP().cuda()
    ref.load_state_dict(model.state_dict())
    shard(fl.CPUOffloadPolicy(optimizer_only=True), mesh)(model)
    for group in _groups(model):
        for param in group.params:
            assert param.padded_shard.is_cuda and param.storage.host_padded.is_pinned()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(3):
        batch = tuple(t.cuda() for t in mlp_batch(step, rank))
        for m, opt in zip((model, ref), opts):
            mlp_loss(m, batch).backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(full(a).cuda(), b, rtol=1e-5, atol=1e-6)


def test_estimate_keeps_the_shards_on_the_device() -> None:
    """optimizer_only in the planner (both methods): the device keeps the shards of no offload and none of the
    optimizer state; the host holds what full offload puts there (masters at the shards' pinned sizes)."""
    from fsdp2lite.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_heads=4, n_layers=2)
    host = {"device": "cpu", "pin_memory": False}
    configs = [
        fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}}], "offload": offload})
        for offload in ({}, host, {**host, "optimizer_only": True})
    ]
    for method in ("analytic", "simulate"):
        none, whole, masters = (
            fl.estimate_memory(lambda: GPT(config), c, world_size=4, device="cuda", method=method) for c in configs
        )
        assert dict(masters.breakdown)["params"] == dict(none.breakdown)["params"] > 0, method
        assert dict(whole.breakdown)["params"] == 0 and dict(masters.breakdown)["optimizer"] == 0, method
        assert masters.host_bytes == whole.host_bytes > 0 and none.host_bytes == 0, method


def test_pinning_that_fails_falls_back_to_pageable_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where pinning fails (a board's locked-memory limit), offload goes on with pageable memory: the same
    values, one warning with the bytes and the error ([Note: pinning fails])."""
    import warnings

    from fsdp2lite._runtime import pinned

    real = torch.zeros

    def failing(*args, pin_memory: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real(*args, **kwargs)

    monkeypatch.setattr(pinned, "_warned", False)
    monkeypatch.setattr(torch, "zeros", failing)
    with pytest.warns(RuntimeWarning, match=r"pinning 48 bytes .* failed \(CUDA error: out of memory"):
        buffer = pinned.host_buffer((3, 4), torch.float32, pin=True, zero=True)
    assert not buffer.is_pinned() and torch.equal(buffer, real(3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second failure is quiet
        assert pinned.host_buffer((2,), torch.bfloat16, pin=True, zero=True).dtype == torch.bfloat16
