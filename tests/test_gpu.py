"""The CUDA paths (NCCL, device buffers, pinned host shards). Marked ``gpu``: skipped without CUDA.

World size 1 with NCCL in this process: the same sharding code path as many ranks (one code path for
every world size), on a real GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import TINY_GPT, gpt_batch, gpt_loss
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.models import GPT

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def nccl_pg() -> Iterator[None]:
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=DEVICE)
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_device(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in batch)


def shard(model: nn.Module, **kwargs: object) -> nn.Module:
    for block in model.blocks:
        fl.fully_shard(block, **kwargs)  # type: ignore[arg-type]
    fl.fully_shard(model, **kwargs)  # type: ignore[arg-type]
    return model


def test_parity_with_plain_model_on_cuda() -> None:
    torch.manual_seed(0)
    ref = GPT(TINY_GPT).to(DEVICE)
    model = shard(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    for step in range(3):
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor) and p.device == DEVICE
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_matches_torch_fully_shard_on_cuda() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ours = GPT(TINY_GPT).to(DEVICE)
    theirs = copy.deepcopy(ours)
    shard(ours, mp_policy=fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32"))
    for block in theirs.blocks:
        torch_fully_shard(block, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    torch_fully_shard(theirs, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(5):
        losses = []
        for m, opt in zip((ours, theirs), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 2e-3, (step, losses)


def test_cpu_offload_on_cuda() -> None:
    torch.manual_seed(0)
    ref = GPT(TINY_GPT).to(DEVICE)
    model = shard(copy.deepcopy(ref).cpu(), offload_policy=fl.CPUOffloadPolicy(pin_memory=True))
    for name, p in model.named_parameters():
        assert p.to_local().device.type == "cpu" and p.to_local().is_pinned(), name
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    for step in range(3):
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            if m is model:
                for name, p in m.named_parameters():
                    assert p.grad.to_local().device.type == "cpu", name
            opt.step()  # the offloaded model's optimizer steps on the host
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_local(), q.detach().cpu(), rtol=1e-4, atol=1e-5, msg=name)
