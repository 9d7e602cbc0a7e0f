"""The host side of CPU offload: what runs on the CPU while the parameters' shards live there.

``fast_host_step(optimizer)``: the optimizer step of CPU-offloaded parameters on torch's fused CPU Adam/AdamW
kernel (``host_step.py``; docs/offload.md).
"""

from __future__ import annotations

from fsdp2lite.offload.host_step import fast_host_step

__all__ = ["fast_host_step"]
