"""The host engine: the one object the runtime calls for what runs on the host beside it ([Note: the host engine]
in ``_runtime/seams.py``): the pool reduced gradients land in under CPU offload (``grad_pool.py``) and the worker
that runs ``step_in_backward``'s host steps (``steps.py``); NVMe groups are handed to ``nvme.py``. One per root after
lazy init, shared by its groups.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fsdp2lite._runtime.seams import GroupView
from fsdp2lite._runtime.trace import Meters

from .grad_pool import HostGradPool
from .nvme import make_nvme_state
from .steps import HostSteps, run_post_accumulate_grad_hooks


class HostEngine:
    """Satisfies the runtime's ``HostSide``: host gradient buffers and host steps, with their trace."""

    meters: Meters | None  # the root's, after lazy init: its trace recorder records the host steps
    steps: HostSteps  # step_in_backward's host steps ([Note: host steps off backward's thread], steps.py)
    grads: HostGradPool  # CPU offload: where reduced gradients land ([Note: host gradient buffers], grad_pool.py)

    def __init__(self) -> None:
        self.meters = None
        self.steps = HostSteps(lambda: None if self.meters is None else self.meters.recorder)
        self.grads = HostGradPool(self.steps.wait)  # the steps free buffers: waited for before making one

    def keep_state_in_files(self, group: GroupView) -> None:
        make_nvme_state(group)  # [Note: optimizer state on NVMe]

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        self.steps.wait_for(params)

    def grad_buffer(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return self.grads.take(numel, dtype, pin)

    def run_grad_hooks(
        self, params: list[torch.Tensor], copy_event: torch.cuda.Event | None, group: str, device: torch.device
    ) -> None:
        run_post_accumulate_grad_hooks(params, copy_event, self.steps, group, device)

    def end_backward(self) -> None:
        self.steps.wait()

    def abandon(self) -> None:
        self.steps.wait_quietly()

    def measure_with(self, meters: Meters) -> None:
        self.meters = meters
