"""Optimizer state on NVMe (``CPUOffloadPolicy(optimizer="nvme", nvme_path=...)``, ``offload: {device: cpu,
optimizer: nvme, nvme_path: ...}``): bit for bit the same losses, parameters, gradients and state as in-memory
offload (AdamW for-loop and fused, SGD, full and optimizer_only offload), exact bytes read and written per
step, nothing shaped left in memory between steps, state_dict / load_state_dict / DCP resume, and every
refusal with nothing changed. One spawn of 2 gloo ranks; the files go to temporary directories."""

from __future__ import annotations

import copy
import os
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _dist import spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, tiny_gpt
from _parity import full
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.host import nvme
from fsdp2lite.offload import nvme_stats

IN_MEMORY = fl.CPUOffloadPolicy(pin_memory=False)


def on_nvme(path: str, **kwargs: object) -> fl.CPUOffloadPolicy:
    return fl.CPUOffloadPolicy(pin_memory=False, optimizer="nvme", nvme_path=path, **kwargs)


def shared_dir() -> str:
    """One temporary directory, the same on every rank (each rank makes its own file in it)."""
    directory = [tempfile.mkdtemp(prefix="fsdp2lite-nvme-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    return directory[0]


def make(offload: fl.CPUOffloadPolicy, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = tiny_gpt()
    for block in model.blocks:
        fl.fully_shard(block, offload_policy=offload)
    fl.fully_shard(model, offload_policy=offload)
    return model


def param_bytes(model: nn.Module) -> list[list[int]]:
    """Each fsdp2lite group's trainable parameters' local bytes on this rank."""
    groups = [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]
    return [[p.sharded_param._local_tensor.nbytes for p in g.params if p.sharded_param.requires_grad] for g in groups]


def local_bytes(model: nn.Module) -> list[int]:
    return [sum(sizes) for sizes in param_bytes(model)]


def shaped_state(opt: torch.optim.Optimizer) -> list[str]:
    return [key for state in opt.state.values() for key, value in state.items() if value.dim() > 0]


def step(model: nn.Module, opt: torch.optim.Optimizer, index: int, rank: int) -> torch.Tensor:
    loss = gpt_loss(model, gpt_batch(index, rank))
    loss.backward()
    opt.step()
    return loss


def scenario_bitwise_in_memory(rank: int, ws: int) -> None:
    """Four steps against in-memory offload, every step: losses, parameters, gradients (given back after the
    step), bytes read and written; after each step no shaped state is left in memory."""
    directory = shared_dir()
    cases = [
        ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2), {}, 2),
        ("AdamW fused", lambda ps: fl.fast_host_step(torch.optim.AdamW(ps, lr=1e-2)), {}, 2),
        ("AdamW amsgrad, optimizer_only", lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
         {"optimizer_only": True}, 3),
        ("SGD momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), {}, 1),
    ]  # fmt: skip
    for label, make_opt, extra, copies in cases:
        memory = make(fl.CPUOffloadPolicy(pin_memory=False, **extra))
        disk = make(on_nvme(directory, **extra))
        opts = [make_opt(m.parameters()) for m in (memory, disk)]
        state = sum(local_bytes(disk)) * copies
        skipped = 0  # bytes not read: written by hand
        for index in range(4):
            if index == 2 and label == "AdamW":  # state written by hand between steps is the state the step uses
                for o, m in zip(opts, (memory, disk)):
                    o.state[next(m.parameters())]["exp_avg"] = torch.zeros_like(next(m.parameters()))
            if index == 3:  # the trace: per group, the read it waited on, its step, its write
                losses = [step(memory, opts[0], index, rank)]
                with fl.record_trace(disk) as trace:
                    losses.append(step(disk, opts[1], index, rank))
                events = [(e.name, e.group) for e in trace.events if e.name.startswith(("nvme", "optimizer"))]
                order = [name for name, group in events if group == "blocks.0"]
                assert order == ["nvme_read_wait", "optimizer_step", "nvme_write_issue"], (label, events)
                assert len(events) == 3 * len(param_bytes(disk)), (label, events)  # every group, once
            else:
                losses = [step(m, o, index, rank) for m, o in zip((memory, disk), opts)]
            assert torch.equal(losses[0], losses[1]), (label, index)
            for (name, a), b in zip(memory.named_parameters(), disk.parameters()):
                assert torch.equal(full(a), full(b)), (label, index, name)
                assert torch.equal(full(a.grad), full(b.grad)), (label, index, name)
            stats = nvme_stats(opts[1])
            by_hand = next(disk.parameters())._local_tensor.nbytes if index == 2 and label == "AdamW" else 0
            skipped += by_hand
            assert (stats.step_bytes_read, stats.step_bytes_written) == (0 if index == 0 else state - by_hand, state)
            assert stats.state_bytes == state and stats.reserved_bytes >= state, label
            assert not shaped_state(opts[1]) and shaped_state(opts[0]), label
            for o in opts:
                o.zero_grad()
        assert stats.bytes_read == 3 * state - skipped and stats.bytes_written == 4 * state, label
        slot = max(sum(copies * (-(-size // 64) * 64) for size in sizes) for sizes in param_bytes(disk))
        assert stats.staging_bytes == 2 * slot, (label, stats.staging_bytes, slot)  # the largest group, twice
        assert stats.staging_bytes < state, label  # host memory: two groups' state, not the whole
        assert len(stats.files) == 1 and f"rank{rank}-" in os.path.basename(stats.files[0]), stats.files
        assert not os.path.exists(stats.files[0]), "unlinked once open: a crash leaves nothing behind"


def scenario_state_dict_and_dcp(rank: int, ws: int) -> None:
    """state_dict() holds the real state (and drops it again after), load_state_dict writes it out, and a DCP
    checkpoint saved under NVMe resumes on NVMe bit for bit an uninterrupted in-memory run."""
    directory, checkpoint = shared_dir(), shared_dir()
    memory, disk = make(IN_MEMORY), make(on_nvme(directory))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (memory, disk)]
    for index in range(2):
        for m, o in zip((memory, disk), opts):
            step(m, o, index, rank)
            o.zero_grad()
    saved = [o.state_dict()["state"] for o in opts]
    assert saved[0].keys() == saved[1].keys()
    for key, value in saved[0].items():
        for name, tensor in value.items():
            assert torch.equal(full(tensor), full(saved[1][key][name])), (key, name)
    assert not shaped_state(opts[1]), "dropped again after state_dict()"
    before = nvme_stats(opts[1])
    opts[1].load_state_dict(opts[1].state_dict())
    after = nvme_stats(opts[1])
    assert not shaped_state(opts[1]) and after.bytes_read == before.bytes_read + after.state_bytes
    assert after.bytes_written == before.bytes_written + after.state_bytes  # the load written out at once
    assert (after.step_bytes_read, after.step_bytes_written) == (before.step_bytes_read, before.step_bytes_written)
    model_state, optim_state = get_state_dict(disk, opts[1])
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    resumed = make(on_nvme(directory), seed=5)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=checkpoint)
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for index in range(2, 5):
        losses = [step(m, o, index, rank) for m, o in ((memory, opts[0]), (resumed, resumed_opt))]
        assert torch.equal(losses[0], losses[1]), index
        for o in (opts[0], resumed_opt):
            o.zero_grad()
    for a, b in zip(memory.parameters(), resumed.parameters()):
        assert torch.equal(full(a), full(b))
    assert not shaped_state(resumed_opt)
    again = make(on_nvme(directory), seed=6)  # a fresh optimizer loading a state dict before its first step:
    again.load_state_dict(memory.state_dict())  # the state stays in memory until that step uses it, then goes
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    again_opt.load_state_dict(copy.deepcopy(opts[0].state_dict()))  # load_state_dict shares the tensors
    losses = [step(m, o, 5, rank) for m, o in ((memory, opts[0]), (again, again_opt))]
    assert torch.equal(losses[0], losses[1]) and not shaped_state(again_opt)
    assert nvme_stats(again_opt).step_bytes_read == 0, nvme_stats(again_opt)
    for a, b in zip(memory.parameters(), again.parameters()):
        assert torch.equal(full(a), full(b)), (full(a) - full(b)).abs().max()


def scenario_refusals_change_nothing(rank: int, ws: int) -> None:
    """A path that is missing, not a directory or not writable: refused by fully_shard, the model untouched;
    a disk too small for the state: refused by the first step with the path and the bytes, before any
    parameter moves; the same step then runs once there is room. A closure is refused by name."""
    directory = shared_dir()
    afile = os.path.join(directory, "not-a-dir")
    open(afile, "w").close()
    for path, why in ((os.path.join(directory, "missing"), "does not exist"), (afile, "is not a directory")):
        model = UnevenMLP()
        state = 2 * -(-sum(p.numel() * 4 for p in UnevenMLP().parameters()) // ws)  # AdamW, this rank's share
        with pytest.raises(ValueError, match=rf"nvme_path '{path}' {why} \(it is to hold about {state:,} bytes"):
            fl.fully_shard(model, offload_policy=on_nvme(path))
        assert not isinstance(model, fl.FSDPModule) and not any(isinstance(p, DTensor) for p in model.parameters())
    with mock.patch.object(nvme.os, "access", return_value=False):
        with pytest.raises(ValueError, match="is not writable by this process"):
            fl.fully_shard(UnevenMLP(), offload_policy=on_nvme(directory))
    memory, disk = make(IN_MEMORY), make(on_nvme(directory))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (memory, disk)]
    for m in (memory, disk):
        gpt_loss(m, gpt_batch(0, rank)).backward()
    before = [full(p).clone() for p in disk.parameters()]
    needed = 2 * sum(local_bytes(disk))
    with mock.patch.object(nvme.shutil, "disk_usage", return_value=mock.Mock(free=1000)):
        with pytest.raises(
            ValueError, match=rf"nvme_path '{directory}' has 1,000 bytes free, .* needs {needed:,} bytes"
        ):
            opts[1].step()
    assert all(torch.equal(a, full(b)) for a, b in zip(before, disk.parameters()))
    assert all(p.grad is not None for p in disk.parameters()) and not opts[1].state
    for o in opts:
        o.step()
    for a, b in zip(memory.parameters(), disk.parameters()):
        assert torch.equal(full(a), full(b))
    with pytest.raises(ValueError, match=r"step\(closure\): optimizer state on NVMe steps group by group"):
        opts[1].step(lambda: gpt_loss(disk, gpt_batch(1, rank)))


def test_nvme_on_two_ranks() -> None:
    spawn_checks(2, scenario_bitwise_in_memory, scenario_state_dict_and_dcp, scenario_refusals_change_nothing)


def test_policy_and_policy_file() -> None:
    """The policy's and the policy file's fields, and their refusals, each naming what would be valid."""
    policy = fl.CPUOffloadPolicy(optimizer="nvme", nvme_path="/local/nvme")
    config = fl.FSDPConfig.model_validate(
        {"offload": {"device": "cpu", "optimizer": "nvme", "nvme_path": "/local/nvme"}}
    )
    assert config.offload.to_policy() == policy
    assert fl.FSDPConfig.model_validate({"offload": policy}).offload == config.offload
    with pytest.raises(ValueError, match="optimizer='nvme' keeps the optimizer state in files: give nvme_path"):
        fl.CPUOffloadPolicy(optimizer="nvme")
    with pytest.raises(ValueError, match="nvme_path='/x' is only read with optimizer='nvme'"):
        fl.CPUOffloadPolicy(nvme_path="/x")
    with pytest.raises(ValueError, match="optimizer: nvme streams the optimizer state through the host, but device"):
        fl.FSDPConfig.model_validate({"offload": {"optimizer": "nvme", "nvme_path": "/x"}})
    with pytest.raises(ValueError, match="Input should be 'cpu' or 'nvme'"):
        fl.FSDPConfig.model_validate({"offload": {"device": "cpu", "optimizer": "disk"}})
