"""Which device a job computes on ([Note: device rule] in fsdp2lite/mesh.py): the process group's
backend decides, not whether the machine has a GPU. These run the same on machines with and without
CUDA, which is the point: a gloo job is a CPU job everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp2lite as fl
from fsdp2lite.mesh import device_type_for_backend


@pytest.mark.parametrize(
    ("backend", "preferred", "cuda_available", "expected"),
    [
        ("gloo", None, True, "cpu"),  # a gloo job on a GPU machine is a CPU job
        ("gloo", "cuda", True, "cpu"),
        ("cpu:gloo", None, True, "cpu"),
        ("mpi", None, True, "cpu"),
        ("nccl", None, False, "cuda"),
        ("cpu:gloo,cuda:nccl", None, True, "cuda"),
        ("CPU:GLOO, CUDA:NCCL", None, True, "cuda"),
        ("fake", "cpu", True, "cpu"),  # any-device backends follow the parameters
        ("fake", None, True, "cuda"),
        ("fake", None, False, "cpu"),
    ],
)
def test_device_type_for_backend(backend: str, preferred: str | None, cuda_available: bool, expected: str) -> None:
    assert device_type_for_backend(backend, preferred, cuda_available) == expected


def _step(model: nn.Module) -> None:
    model(torch.randn(2, 8)).sum().backward()


@pytest.mark.usefixtures("single_rank_pg")
def test_gloo_job_with_offload_computes_on_cpu() -> None:
    """CPU offload with no mesh on a gloo group: a CPU mesh, host shards and host grads, whatever the
    machine has (on a GPU machine this used to pick CUDA and fail assigning the gradient)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    fl.fully_shard(model, offload_policy=fl.CPUOffloadPolicy(pin_memory=False))
    assert model[0].weight.device_mesh.device_type == "cpu"
    _step(model)
    for name, param in model.named_parameters():
        assert param.to_local().device.type == "cpu", name
        assert param.grad is not None and param.grad.to_local().device.type == "cpu", name
    assert fl.init_mesh().device_type == "cpu"


def test_fake_backend_follows_the_parameters() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = nn.Linear(8, 8)
        fl.fully_shard(model)
        assert model.weight.device_mesh.device_type == "cpu"
    finally:
        dist.destroy_process_group()
