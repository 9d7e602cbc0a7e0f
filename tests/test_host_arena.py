"""One host buffer per offloaded group, of its exact size ([Note: one host buffer per group]): every host shard
(full offload) or master (``optimizer_only``) is a view of it, packed again when ``to_empty`` renews them,
stepped in place every step; pinned by registering exactly its bytes on CUDA, with torch's allocator and then
pageable memory as the fallbacks. One spawn of 2 gloo ranks; a gpu test checks the pinning itself."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss, tiny_gpt
from _parity import full

import fsdp2lite as fl
from fsdp2lite._runtime import host_arena
from fsdp2lite._runtime.host_arena import host_tensor

FULL = fl.CPUOffloadPolicy(pin_memory=False)
MASTERS = fl.CPUOffloadPolicy(pin_memory=False, optimizer_only=True)


def groups(model: nn.Module) -> list:
    return [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]


def shard(model: nn.Module, offload: fl.OffloadPolicy | None, mesh: object = None) -> nn.Module:
    for block in model.blocks:
        fl.fully_shard(block, mesh, offload_policy=offload)
    fl.fully_shard(model, mesh, offload_policy=offload)
    return model


def check_packed(model: nn.Module, label: str) -> list[int]:
    """Every host tensor inside its group's buffer, at 64-byte-aligned offsets, the buffer exactly their
    aligned bytes, the registered shards views of it; the buffers' addresses."""
    addresses = []
    for group in groups(model):
        tensors = [t for p in group.params if (t := host_tensor(p)) is not None]
        arena = group.host_arena
        assert arena is not None and arena.pinning == "none", (label, group)
        assert arena.nbytes == sum(-(-t.nbytes // 64) * 64 for t in tensors), label
        start = arena.buffer.data_ptr()
        assert sorted(t.data_ptr() - start for t in tensors) == sorted(
            sum(-(-u.nbytes // 64) * 64 for u in tensors[:i]) for i in range(len(tensors))
        ), label
        for param in group.params:
            if host_tensor(param) is not None:
                local = param.sharded_param._local_tensor
                assert local.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr(), label
        addresses.append(start)
    return addresses


def scenario_packed_and_stepped_in_place(rank: int, ws: int) -> None:
    """Full offload and optimizer_only: packed at fully_shard, the same buffers after three AdamW steps, and
    the values in them are the parameters' (bit for bit a run without offload's, on the shards they show)."""
    for offload, label in ((FULL, "full"), (MASTERS, "optimizer_only")):
        torch.manual_seed(0)
        model, plain = tiny_gpt(), tiny_gpt()
        plain.load_state_dict(model.state_dict())
        shard(model, offload)
        shard(plain, None)
        before = check_packed(model, label)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain)]
        for step in range(3):
            for m, opt in zip((model, plain), opts):
                gpt_loss(m, gpt_batch(step, rank)).backward()
                opt.step()
                opt.zero_grad()
        assert check_packed(model, label) == before, "the buffers are the groups' for their life"
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(full(a), full(b)), (label, name)


def scenario_meta_init_then_to_empty(rank: int, ws: int) -> None:
    """Built on meta, nothing is packed; to_empty renews the shards and they are packed then; uneven rows
    (a rank with fewer rows than the others) pack too."""
    for offload, label in ((FULL, "full"), (MASTERS, "optimizer_only")):
        with torch.device("meta"):
            model = UnevenMLP()
        shard(model, offload)
        assert all(group.host_arena is None for group in groups(model)), label
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        reference = UnevenMLP()
        model.load_state_dict(reference.state_dict())
        check_packed(model, label)
        mlp_loss(model, mlp_batch(0, rank)).backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(full(a), b), label


def scenario_planner_counts_the_buffers(rank: int, ws: int) -> None:
    """The planner's host memory of full offload under AdamW is the runtime's buffers, their gradients, two
    state tensors and a 4-byte step counter per parameter, to the byte."""
    model = shard(tiny_gpt(), FULL)
    config = fl.FSDPConfig.model_validate(
        {"wrap": [{"match": {"class": "Block"}}], "offload": {"device": "cpu", "pin_memory": False}}
    )
    estimate = fl.estimate_memory(tiny_gpt, config, world_size=ws, device="cpu", method="analytic")
    packed = sum(group.host_arena.nbytes for group in groups(model))
    shards = sum(t.nbytes for group in groups(model) for p in group.params if (t := host_tensor(p)) is not None)
    steps = 4 * len(list(model.parameters()))
    assert estimate.host_exact_bytes == packed + 3 * shards + steps, (estimate.host_exact_bytes, packed, shards)


def test_host_arena_on_two_ranks() -> None:
    spawn_checks(
        2, scenario_packed_and_stepped_in_place, scenario_meta_init_then_to_empty, scenario_planner_counts_the_buffers
    )


def test_pinning_falls_back_in_order() -> None:
    """No CUDA: plain memory. Registering refused: torch's pinned allocator; that failing too: pageable, with
    the one warning of [Note: pinning fails]."""
    assert host_arena.exact_host_bytes(1000, pin=True)[1] == "none"
    refusing = mock.Mock(cudaHostRegister=mock.Mock(return_value=1))
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        with mock.patch.object(torch.cuda, "cudart", return_value=refusing):
            with mock.patch.object(host_arena, "host_buffer", return_value=torch.zeros(1000, dtype=torch.uint8)) as fb:
                buffer, pinning = host_arena.exact_host_bytes(1000, pin=True)
    refusing.cudaHostRegister.assert_called_once_with(mock.ANY, 1000, 0)
    fb.assert_called_once_with((1000,), torch.uint8, pin=True)
    assert (buffer.nbytes, pinning) == (1000, "none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: page-locking host memory is a driver call")
def test_registered_at_exact_size_on_cuda() -> None:
    buffer, pinning = host_arena.exact_host_bytes(3 * 2**20 + 64, pin=True)
    assert pinning == "registered" and buffer.is_pinned() and buffer.nbytes == 3 * 2**20 + 64
    device = torch.arange(buffer.numel(), device="cuda").to(torch.uint8)
    buffer.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, device.cpu())


def test_gradient_buffer_reused_only_when_free() -> None:
    """The group's reduced-gradient host buffer: the same one every step once nothing holds it; while a
    gradient (a view) still holds it, a buffer of its own for that step, and the kept one untouched."""

    class Key:  # stands for the group's first parameter (the buffers are kept by it, weakly)
        pass

    key = (Key(),)
    first = host_arena.host_grad_buffer(key, 100, torch.float32, pin=False)
    assert first.numel() == 100 and host_arena.host_grad_buffer(key, 100, torch.float32, pin=False) is first
    first.fill_(7.0)
    grad = first[10:20]  # a sharded gradient viewing it
    other = host_arena.host_grad_buffer(key, 100, torch.float32, pin=False)
    assert other.data_ptr() != first.data_ptr() and torch.equal(grad, torch.full((10,), 7.0))
    del grad
    assert host_arena.host_grad_buffer(key, 100, torch.float32, pin=False) is first
    assert host_arena.host_grad_buffer(key, 60, torch.float32, pin=False).numel() == 60  # the group changed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned shards and gradients on the host")
def test_offloaded_group_pins_shards_and_gradients_once_on_cuda() -> None:
    spawn_checks(1, _pinned_once)


def _pinned_once(rank: int, ws: int) -> None:
    torch.cuda.set_device(0)
    model = shard(tiny_gpt().cuda(), fl.CPUOffloadPolicy(), fl.init_mesh(device_type="cuda"))
    for group in groups(model):
        assert group.host_arena.pinning == "registered" and group.host_arena.buffer.is_pinned()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    for step in range(3):
        gpt_loss(model, tuple(t.cuda() for t in gpt_batch(step, rank))).backward()
        seen.append([p.grad._local_tensor.untyped_storage().data_ptr() for p in model.parameters()])
        assert all(p.grad._local_tensor.is_pinned() for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert seen[0] == seen[1] == seen[2], "each group's gradient buffer, reused every step"
