"""The host side of CPU offload: what runs on the CPU while the parameters' shards live there.

``fast_host_step(optimizer)``: the optimizer step of CPU-offloaded parameters on torch's fused CPU Adam/AdamW
kernel; ``step_in_backward(model, optimizer_factory)``: each group stepped inside backward as its reduced
gradients land (``host_step.py``; docs/offload.md).
"""

from __future__ import annotations

from fsdp2lite.offload.host_step import StepInBackward, fast_host_step, step_in_backward

__all__ = ["StepInBackward", "fast_host_step", "step_in_backward"]
