"""One host buffer per offloaded group, of its exact size ([Note: one host buffer per group]): every host shard
(full offload) or master (``optimizer_only``) is a view of it, packed again when ``to_empty`` renews them,
stepped in place every step; pinned by registering exactly its bytes on CUDA, with torch's allocator and then
pageable memory as the fallbacks; owned by the group's host storage, which also copies the reduced gradients to
the host ([Note: host storage]). One spawn of 2 gloo ranks; a gpu test checks the pinning itself."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss, tiny_gpt
from _parity import full

import fsdp2lite as fl
from fsdp2lite._runtime import pinned
from fsdp2lite._runtime.host_arena import host_tensor
from fsdp2lite._runtime.host_masters import HostSync
from fsdp2lite._runtime.host_storage import HostShards
from fsdp2lite._runtime.seams import ReducedGrads
from fsdp2lite._runtime.shard_home import DeviceHome, HostHome
from fsdp2lite.host import grad_pool

FULL = fl.CPUOffloadPolicy(pin_memory=False)
MASTERS = fl.CPUOffloadPolicy(pin_memory=False, optimizer_only=True)


def groups(model: nn.Module) -> list:
    return [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]


def shard(model: nn.Module, offload: fl.OffloadPolicy | None, mesh: object = None) -> nn.Module:
    for block in model.blocks:
        fl.fully_shard(block, mesh, offload_policy=offload)
    fl.fully_shard(model, mesh, offload_policy=offload)
    return model


def seeded(make: Any) -> nn.Module:
    """``make()`` after seeding torch: two calls give the same weights."""
    torch.manual_seed(0)
    return make()


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
    per_group = [sum(t.nbytes for p in group.params if (t := host_tensor(p)) is not None) for group in groups(model)]
    in_backward = estimate.host_exact_bytes - sum(per_group) + max(per_group)  # one gradient buffer, the largest
    assert estimate.host_bytes_step_in_backward == in_backward, (estimate.host_bytes_step_in_backward, per_group)
    memory = fl.offload.host_memory(model)  # what the runtime holds, read back: the packed buffers
    assert (memory.shards, memory.own_buffers, memory.gradients) == (packed, 0, 0)  # CPU mesh: reduced in place
    assert (memory.pinned, memory.registered, memory.offloaded_groups) == (0, 0, len(groups(model)))


def scenario_host_memory_without_offload(rank: int, ws: int) -> None:
    """No offload: nothing on the host; optimizer_only: the masters' buffers; a module fully_shard never saw:
    refused by name."""
    assert fl.offload.host_memory(shard(tiny_gpt(), None)) == fl.offload.HostMemory(0, 0, 0, 0, 0, 0)
    model = shard(tiny_gpt(), MASTERS)
    masters = fl.offload.host_memory(model)
    assert masters.shards == sum(group.host_arena.nbytes for group in groups(model)) > 0
    assert masters.total == masters.shards and masters.offloaded_groups == len(groups(model))
    with pytest.raises(TypeError, match="host_memory takes a model sharded by fsdp2lite.fully_shard; Linear"):
        fl.offload.host_memory(nn.Linear(2, 2))


def scenario_offload_is_a_storage(rank: int, ws: int) -> None:
    """Where shards live is chosen once ([Note: shard home], [Note: host storage]): full offload gives every
    parameter a host home and its group one ``HostShards``, the owner of the group's buffer; optimizer_only a
    ``HostSync`` holding one; no offload a device home and no storage. On a CPU mesh the reduced gradients are on
    the host already: ``after_reduce`` hands them back as they are."""
    plain, offloaded, masters = shard(tiny_gpt(), None), shard(tiny_gpt(), FULL), shard(tiny_gpt(), MASTERS)
    for group in groups(plain):
        assert group.storages == () and group.host_arena is None
        assert all(type(p.home) is DeviceHome and p.device.type == "cpu" for p in group.params)
    for group in groups(offloaded):
        assert [type(s) for s in group.storages] == [HostShards]
        assert group.storages[0].arena is group.host_arena is not None
        assert all(isinstance(p.home, HostHome) and p.grads_on_host for p in group.params)
    for group in groups(masters):
        assert [type(s) for s in group.storages] == [HostSync]
        assert group.storages[0].host.arena is group.host_arena is not None
        assert all(type(p.home) is DeviceHome for p in group.params)
    flat = torch.ones(4)
    reduced = groups(offloaded)[0].storages[0].after_reduce(ReducedGrads(flat, None), reads_now=False)
    assert reduced.flat is flat and reduced.copy_event is None


class RecordingStorage:
    """A group storage that moves the reduced gradients into tensors of its own and records its two points."""

    keeps_unsharded = False

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.moved = calls, []

    def before_gather(self) -> bool:
        return False

    def gathered(self) -> None:
        return None

    def on_reset(self, renewed: bool) -> None:
        return None

    def invalidate(self) -> None:
        return None

    def after_reduce(self, reduced: ReducedGrads, reads_now: bool) -> ReducedGrads:
        self.calls.append("after_reduce")
        self.moved.append(reduced.flat.clone())
        return ReducedGrads(self.moved[-1], None)

    def end_backward(self) -> None:
        self.calls.append("end_backward")


def scenario_after_reduce_point(rank: int, ws: int) -> None:
    """``after_reduce`` sees a reduction's final gradients (averaged, after the all-reduce hook) and decides
    where they are stored: the sharded gradients are views of what it returns; ``end_backward`` follows every
    reduction of the backward, once ([Note: group storage])."""
    torch.manual_seed(0)
    model, reference = tiny_gpt(), tiny_gpt()
    reference.load_state_dict(model.state_dict())
    shard(model, None)
    shard(reference, None)
    root = model._fsdp_state.group
    calls: list[str] = []
    storage = RecordingStorage(calls)
    assert root.storages == ()
    root.storages = (storage,)  # a storage of its own kind, where group_storages would put one
    model.set_all_reduce_hook(lambda output: calls.append("all_reduce_hook"))
    for step in range(2):
        calls.clear()
        for m in (model, reference):
            gpt_loss(m, gpt_batch(step, rank)).backward()
        assert calls == ["all_reduce_hook", "after_reduce", "end_backward"], calls
        moved = storage.moved[-1].untyped_storage().data_ptr()
        for p in root.params:
            assert p.sharded_param.grad._local_tensor.untyped_storage().data_ptr() == moved, p.fqn
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(full(a.grad), full(b.grad)), (step, name)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)  # the next gradients are new ones: views of the next moved output


def test_host_arena_on_two_ranks() -> None:
    spawn_checks(
        2,
        scenario_packed_and_stepped_in_place,
        scenario_meta_init_then_to_empty,
        scenario_planner_counts_the_buffers,
        scenario_host_memory_without_offload,
        scenario_offload_is_a_storage,
        scenario_after_reduce_point,
    )


def test_host_gradient_copy_and_its_wait() -> None:
    """From a device (CUDA's logic, its tensors and event stood in for): one copy into a host buffer of the
    engine's pool, non-blocking with an event kept when pinned and nothing reads it at once, blocking otherwise;
    ``end_backward`` waits on the last event once ([Note: host storage])."""
    buffer = mock.Mock(is_pinned=mock.Mock(return_value=True))
    buffer.copy_.return_value = buffer
    group = mock.Mock(params=(), host=mock.Mock(grad_buffer=mock.Mock(return_value=buffer)))
    host = HostShards(group, pin=True)
    flat = mock.Mock(numel=mock.Mock(return_value=6), dtype=torch.float32, device=torch.device("cuda", 0))
    with mock.patch.object(torch.cuda, "Event") as event_class:
        blocking = host.after_reduce(ReducedGrads(flat, None), reads_now=True)
        assert blocking == ReducedGrads(buffer, None) and host.copy_event is None
        buffer.copy_.assert_called_with(flat, non_blocking=False)
        copied = host.after_reduce(ReducedGrads(flat, None), reads_now=False)
    group.host.grad_buffer.assert_called_with(6, torch.float32, True)
    buffer.copy_.assert_called_with(flat, non_blocking=True)
    event = event_class.return_value
    event.record.assert_called_once_with()
    assert copied == ReducedGrads(buffer, event) and host.copy_event is event
    host.end_backward()
    host.end_backward()
    event.synchronize.assert_called_once_with()
    assert host.copy_event is None


def test_pinning_falls_back_in_order() -> None:
    """No CUDA: plain memory. Registering refused: torch's pinned allocator; that failing too: pageable, with
    the one warning of [Note: pinning fails]."""
    assert pinned.exact_host_bytes(1000, pin=True)[1] == "none"
    refusing = mock.Mock(cudaHostRegister=mock.Mock(return_value=1))
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        with mock.patch.object(torch.cuda, "cudart", return_value=refusing):
            with mock.patch.object(pinned, "host_buffer", return_value=torch.zeros(1000, dtype=torch.uint8)) as fb:
                buffer, pinning = pinned.exact_host_bytes(1000, pin=True)
    refusing.cudaHostRegister.assert_called_once_with(mock.ANY, 1000, 0)
    fb.assert_called_once_with((1000,), torch.uint8, pin=True)
    assert (buffer.nbytes, pinning) == (1000, "none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: page-locking host memory is a driver call")
def test_registered_at_exact_size_on_cuda() -> None:
    buffer, pinning = pinned.exact_host_bytes(3 * 2**20 + 64, pin=True)
    assert pinning == "registered" and buffer.is_pinned() and buffer.nbytes == 3 * 2**20 + 64
    device = torch.arange(buffer.numel(), device="cuda").to(torch.uint8)
    buffer.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, device.cpu())


def test_gradient_pool_reuses_free_buffers_only() -> None:
    """[Note: host gradient buffers]: kept gradients (a view of a buffer) keep it from being handed out again;
    once dropped, the same buffer comes back; a request no free buffer fits drops the free ones and makes one
    of exactly its bytes; the exact fit goes first among free buffers."""
    pool = grad_pool.HostGradPool()
    first = pool.take(100, torch.float32, pin=False)
    first.fill_(7.0)
    grad = first[10:20]  # a sharded gradient viewing it
    second = pool.take(100, torch.float32, pin=False)
    assert second.data_ptr() != first.data_ptr() and torch.equal(grad, torch.full((10,), 7.0))
    assert pool.nbytes() == 800 and pool.nbytes("none") == 800 and pool.nbytes("registered") == 0
    del first, grad, second
    assert pool.take(100, torch.float32, pin=False).numel() == 100 and pool.nbytes() == 800  # reused
    bigger = pool.take(300, torch.float32, pin=False)  # both free ones too small: dropped, one exact made
    assert bigger.numel() == 300 and pool.nbytes() == 1200
    del bigger
    small = pool.take(50, torch.float64, pin=False)  # the one free buffer serves a smaller request, any dtype
    assert (small.numel(), small.dtype, pool.nbytes()) == (50, torch.float64, 1200)
    held = pool.take(1200 // 4, torch.float32, pin=False)  # the 1200-byte one is held by ``small``: a new one
    assert pool.nbytes() == 2400 and held.data_ptr() != small.data_ptr()
    pinned_ask = pool.take(10, torch.float32, pin=True)  # never one made for the other pin setting
    assert pool.nbytes() == 2440 and pinned_ask.numel() == 10
    assert pool.take(0, torch.float32, pin=False).numel() == 0 and pool.nbytes() == 2440  # nothing taken


def test_gradient_pool_serves_groups_like_the_two_schedules() -> None:
    """Groups of 400, 1000 and 400 bytes, three steps each: gradients kept to the step (all held at once)
    need one buffer per group, each group its own every step; gradients dropped as each group steps
    (``step_in_backward``) need one buffer, the largest group's size."""
    sizes = (100, 250, 100)  # fp32 elements

    kept = grad_pool.HostGradPool()
    owners = []
    for _ in range(3):
        grads = [kept.take(n, torch.float32, pin=False) for n in sizes]
        owners.append([g.data_ptr() for g in grads])
        del grads  # zero_grad()
    assert owners[0] == owners[1] == owners[2] and len(set(owners[0])) == 3 and kept.nbytes() == 1800

    stepped = grad_pool.HostGradPool()
    for _ in range(3):
        for n in sizes:
            grad = stepped.take(n, torch.float32, pin=False)
            grad.fill_(1.0)
            del grad  # the group's optimizer stepped it and set it to None
    assert stepped.nbytes() == 1000 and len(stepped.buffers) == 1


def test_gradient_pool_waits_for_the_host_steps_before_growing() -> None:
    """``step_in_backward`` off backward's thread: the step of the group reduced last may still hold its buffer
    when the next group's gradients need one. The pool then waits for the host steps (which free it) and reuses
    it; it makes a new buffer only when that wait freed nothing that fits ([Note: host steps off backward's
    thread])."""
    in_flight: list[torch.Tensor] = []  # gradients a host step still reads
    waits: list[int] = []

    def wait_for_readers() -> bool:
        waits.append(len(in_flight))
        had = bool(in_flight)
        in_flight.clear()  # the steps finished: their gradients set to None
        return had

    pool = grad_pool.HostGradPool(wait_for_readers)
    in_flight.append(pool.take(250, torch.float32, pin=False))  # the pool is empty: waits (nothing), makes one
    for n in (100, 250, 100):  # each group's buffer is still being stepped when the next one's is asked for
        in_flight.append(pool.take(n, torch.float32, pin=False))
    assert waits == [0, 1, 1, 1] and len(pool.buffers) == 1 and pool.nbytes() == 1000
    bigger = pool.take(300, torch.float32, pin=False)  # waited, the one buffer freed but too small: a new one
    assert waits[-1] == 1 and bigger.numel() == 300 and pool.nbytes() == 1200 and len(pool.buffers) == 1
    kept = pool.take(10, torch.float32, pin=False)  # held by ``bigger`` outside any step: the wait frees nothing
    assert waits[-1] == 0 and pool.nbytes() == 1240 and kept.data_ptr() != bigger.data_ptr()


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: gradients copied to pinned host buffers")
def test_step_in_backward_pins_one_gradient_buffer_on_cuda() -> None:
    spawn_checks(1, _one_gradient_buffer)


def _one_gradient_buffer(rank: int, ws: int) -> None:
    """[Note: host gradient buffers] on CUDA: stepping in backward, every group's gradients land in one registered
    buffer of the largest group's bytes, with the steps on the host-step thread ([Note: host steps off backward's
    thread]: the pool waits for them) and in backward's thread (``overlap=False``) alike, and the losses and
    parameters are those of one optimizer stepped after backward (the kept-gradients schedule, one buffer per
    group)."""
    torch.cuda.set_device(0)
    mesh = fl.init_mesh(device_type="cuda")
    kept = shard(seeded(tiny_gpt).cuda(), fl.CPUOffloadPolicy(), mesh)
    stepped = shard(seeded(tiny_gpt).cuda(), fl.CPUOffloadPolicy(), mesh)  # the same weights
    serial = shard(seeded(tiny_gpt).cuda(), fl.CPUOffloadPolicy(), mesh)
    opt = torch.optim.AdamW(kept.parameters(), lr=1e-2)
    fl.step_in_backward(stepped, lambda params: torch.optim.AdamW(params, lr=1e-2))
    fl.step_in_backward(serial, lambda params: torch.optim.AdamW(params, lr=1e-2), overlap=False)
    for step in range(3):
        batch = tuple(t.cuda() for t in gpt_batch(step, rank))
        loss = gpt_loss(kept, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for model in (stepped, serial):
            other = gpt_loss(model, batch)
            other.backward()
            assert torch.equal(loss, other), step
    for a, b, c in zip(kept.parameters(), stepped.parameters(), serial.parameters(), strict=True):  # local: whole
        assert torch.equal(a.to_local(), b.to_local()) and torch.equal(a.to_local(), c.to_local())
    largest = max(sum(p.padded_numel for p in group.params) * 4 for group in groups(stepped))
    for model in (stepped, serial):
        pool = groups(model)[0].host.grads
        assert [(b.raw.nbytes, b.pinning) for b in pool.buffers] == [(largest, "registered")]
    memory = fl.offload.host_memory(stepped)
    assert (memory.gradients, memory.own_buffers) == (largest, 0)
    assert memory.pinned == memory.registered == memory.shards + largest
    total = sum(sum(p.padded_numel for p in group.params) * 4 for group in groups(kept))
    assert groups(kept)[0].host.grads.nbytes("registered") == total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: asynchronous copies to pinned host memory")
def test_offloaded_gradients_accumulate_after_their_copy_lands_on_cuda() -> None:
    spawn_checks(1, _accumulated_on_cuda)


def _accumulated_on_cuda(rank: int, ws: int) -> None:
    """Two backwards without ``zero_grad``: the second reduction is added into the kept host gradients on the
    host, so its copy must have landed first (a non-blocking copy would be read half-written). The sums equal
    the same model's without offload, accumulated on the device."""
    torch.cuda.set_device(0)
    mesh = fl.init_mesh(device_type="cuda")
    offloaded = shard(seeded(tiny_gpt).cuda(), fl.CPUOffloadPolicy(), mesh)
    resident = shard(seeded(tiny_gpt).cuda(), None, mesh)  # the same weights
    for step in range(2):
        batch = tuple(t.cuda() for t in gpt_batch(step, rank))
        gpt_loss(offloaded, batch).backward()
        gpt_loss(resident, batch).backward()
    for a, b in zip(offloaded.parameters(), resident.parameters(), strict=True):  # one rank: local is whole
        assert a.grad.to_local().device.type == "cpu"
        assert torch.equal(a.grad.to_local(), b.grad.to_local().cpu())
