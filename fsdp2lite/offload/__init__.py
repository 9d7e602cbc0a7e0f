"""The host side of CPU offload: what runs on the CPU while the parameters' shards live there.

``fast_host_step(optimizer)``: the optimizer step of CPU-offloaded parameters on torch's fused CPU Adam/AdamW
kernel; ``step_in_backward(model, optimizer_factory)``: each group stepped inside backward as its reduced
gradients land (``host_step.py``; docs/offload.md); ``nvme_stats(optimizer)``: the bytes on disk, in host
memory and moved per step of an optimizer whose state lives on NVMe (``CPUOffloadPolicy(optimizer="nvme")``);
``host_memory(model)``: the host memory offload holds for a model, pinned and not (``memory.py``).
"""

from __future__ import annotations

import torch

from fsdp2lite.host.nvme import NVMeStats, nvme_state
from fsdp2lite.offload.host_step import StepInBackward, fast_host_step, step_in_backward
from fsdp2lite.offload.memory import HostMemory, host_memory


def nvme_stats(optimizer: torch.optim.Optimizer) -> NVMeStats | None:
    """Where ``optimizer``'s NVMe state stands: its files, bytes reserved and held, host staging memory, bytes
    read and written (in all and by the last step); None before its first step or without NVMe state."""
    engine = nvme_state(optimizer)
    return None if engine is None else engine.stats()


__all__ = [
    "HostMemory",
    "NVMeStats",
    "StepInBackward",
    "fast_host_step",
    "host_memory",
    "nvme_stats",
    "step_in_backward",
]
