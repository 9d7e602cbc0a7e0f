"""The host engine: what runs on the host beside the sharding runtime, outside its core ([Note: the host engine]
in ``_runtime/seams.py``).

``engine.py``    ``HostEngine``, the one object the runtime calls (its ``HostSide``): made by ``fully_shard``
``grad_pool.py`` the pinned pool reduced gradients land in under CPU offload
``steps.py``     ``step_in_backward``'s host steps, on a worker thread of their own
``nvme.py``      optimizer state on NVMe, streamed group by group at each step

The arrows run downward: ``api`` -> ``host`` -> ``_runtime``; the runtime never imports this package. The public
names built on it are in ``fsdp2lite.offload``.
"""

from __future__ import annotations

from fsdp2lite.host.engine import HostEngine

__all__ = ["HostEngine"]
