"""All-gather extension hooks under CPU offload (issue 30, item 1): a hooked parameter's padded shard lives
on the host, and each all-gather calls the pre hook on its copy on the compute device ([Note: offloaded
hooked parameters]). torchao's NF4 (QLoRA) against torch's ``fully_shard`` with the same
``CPUOffloadPolicy``, bit for bit; trainable hooked weights (hooks set after ``fully_shard``) against DDP,
their sharded gradients on the host. On CPU the compute device is the host, so the device copy is the
shard itself: these tests hold the math and the placement, the CUDA copy path needs a GPU run."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _parity import full
from test_extensions import LoRALinear
from test_extensions_newer import identity_hooks, patch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp2lite as fl

RTOL, ATOL = 1e-5, 1e-6


def _qlora_model(shard: Any, offload: Any) -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(LoRALinear(128, 256), nn.ReLU(), LoRALinear(256, 128))
    for block in (model[0], model[2], model):
        shard(block, mesh=cpu_mesh(), offload_policy=offload)
    return model


def check_nf4_qlora_offload_against_torch(rank: int, world_size: int) -> None:
    """NF4 base weights offloaded: the sharded NF4 local tensors are on the host, and losses, the adapters'
    sharded grads (also on the host) and their values equal torch's fully_shard bit for bit every step."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    mine = _qlora_model(fl.fully_shard, fl.CPUOffloadPolicy(pin_memory=False))
    theirs = _qlora_model(torch_fully_shard, TorchCPUOffloadPolicy(pin_memory=False))
    for layer in (mine[0], mine[2]):
        local = layer.weight.to_local()
        assert type(local) is NF4Tensor and local.device.type == "cpu", (type(local), local.device)
        assert local.quantized_data.device.type == "cpu"  # the inner tensors too
    inner = {  # NF4's codes, scales and lookup table, by storage
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for layer in (mine[0], mine[2])
        for name in ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")
        for t in [getattr(layer.weight.to_local(), name)]
    }
    memory = fl.offload.host_memory(mine)
    assert memory.own_buffers == sum(inner.values()) > 0  # NF4 shards keep buffers of their own
    arenas = [m._fsdp_state.group.host_arena for m in (mine[0], mine[2])]
    assert memory.shards == sum(arena.nbytes for arena in arenas) > 0  # the adapters, packed
    assert (memory.gradients, memory.pinned, memory.offloaded_groups) == (0, 0, 2)  # CPU: nothing pinned
    models = (mine, theirs)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    losses: list[list[float]] = [[], []]
    for step in range(3):
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()
        for index, model in enumerate(models):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            losses[index].append(loss.item())
        trainable = [[(n, p) for n, p in m.named_parameters() if p.requires_grad] for m in models]
        for (name, a), (_, b) in zip(*trainable):
            assert a.grad.to_local().device.type == "cpu", name
            assert torch.equal(a.grad.to_local(), b.grad.to_local()), f"step {step} grad {name}"
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, a), (_, b) in zip(*trainable):
            assert torch.equal(a.to_local(), b.to_local()), f"step {step} {name}"
    assert losses[0] == losses[1], losses  # bit for bit: the same bytes gathered, the same kernels
    assert losses[0][-1] < losses[0][0]  # the adapters learn


def check_trainable_hooked_offload_like_ddp(rank: int, world_size: int) -> None:
    """Trainable weights gathered through hooks set after fully_shard, offloaded, uneven rows: the pre hook
    is called at every all-gather, training matches DDP, and the sharded weights and grads are on the host."""
    torch.manual_seed(4)
    ref = nn.Sequential(nn.Linear(16, 37), nn.ReLU(), nn.Linear(37, 5))
    twin = DDP(copy.deepcopy(ref))
    model = copy.deepcopy(ref)
    offload = fl.CPUOffloadPolicy(pin_memory=False)
    for block in (model[0], model[2], model):
        fl.fully_shard(block, mesh=cpu_mesh(), offload_policy=offload)
    counter = {"a": 0}
    for layer in (model[0], model[2]):
        patch_hooks(layer.weight._local_tensor, *identity_hooks(counter, "a"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, twin)]
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        losses = [m(x).pow(2).mean() for m in (model, twin)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL, msg=f"step {step}")
        for (name, mine), theirs in zip(model.named_parameters(), twin.module.parameters()):
            assert mine.to_local().device.type == "cpu" and mine.grad.to_local().device.type == "cpu", name
            torch.testing.assert_close(full(mine.grad), theirs.grad, rtol=RTOL, atol=ATOL, msg=f"{step} {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, mine), theirs in zip(model.named_parameters(), twin.module.parameters()):
        torch.testing.assert_close(full(mine.detach()), theirs.detach(), rtol=RTOL, atol=ATOL, msg=name)
    assert counter == {"a": 12}, counter  # 2 weights x (forward + backward) x 3 steps


def test_hooked_parameters_with_cpu_offload_world2() -> None:
    checks = [check_trainable_hooked_offload_like_ddp]
    try:
        import torchao  # noqa: F401
    except ImportError:
        pass  # test_extensions.py::test_nf4_needs_torchao says so
    else:
        checks.append(check_nf4_qlora_offload_against_torch)
    spawn_checks(2, *checks)


@pytest.mark.usefixtures("single_rank_pg")
def test_cpu_offload_takes_hooked_parameters_at_fully_shard() -> None:
    """Once refused ("CPU offload is on"): now sharded onto the host, the shard still the subclass."""
    from _quant_weight import QuantWeight, quantize_linears

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    quantize_linears(model)
    fl.fully_shard(model[0], offload_policy=fl.CPUOffloadPolicy(pin_memory=False))
    local = model[0].weight.to_local()
    assert type(local) is QuantWeight and local.device.type == "cpu"
    assert model[0](torch.randn(3, 16)).shape == (3, 32)


@pytest.mark.usefixtures("single_rank_pg")
def test_a_policy_file_offloads_the_nf4_base(tmp_path: Any) -> None:
    """QLoRA's frozen NF4 base offloaded because the YAML policy file says so (``offload: {device: cpu}``):
    each wrapped layer's NF4 shard on the host, and a step trains the adapters."""
    pytest.importorskip("torchao", reason="torchao is not installed: pip install -e '.[dev]' (the NF4 check)")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    path = tmp_path / "qlora.yaml"
    path.write_text("offload: {device: cpu, pin_memory: false}\nwrap:\n  - match: {class: LoRALinear}\n")
    torch.manual_seed(5)
    model = nn.Sequential(LoRALinear(128, 256), nn.ReLU(), LoRALinear(256, 128))
    fl.apply_config(model, fl.FSDPConfig.from_yaml(path))
    for layer in (model[0], model[2]):
        local = layer.weight.to_local()
        assert type(local) is NF4Tensor and local.quantized_data.device.type == "cpu"
    before = model[0].b.detach().clone()
    model(torch.randn(4, 128).bfloat16()).float().pow(2).mean().backward()
    assert model[0].weight.grad is None and model[0].b.grad.to_local().device.type == "cpu"
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    assert not torch.equal(model[0].b.detach(), before)
