"""What ``FSDPModule``'s setters change on a group between steps: ``GroupControls``, one frozen record the group's
phases read and ``FSDPParamGroup.set_controls`` replaces whole (the one writer after construction).

Settings that choose how the group communicates (``set_reshard_after_forward``, ``set_comm_policy``, a custom
collective, a reduce-scatter group, ``set_requires_all_reduce``) are not controls: each re-chooses a form and has
its own setter (choices.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupControls:
    """A group's per-step switches, as the public setters of the same names leave them (torch's defaults)."""

    requires_gradient_sync: bool = True  # False: gradients accumulate unsharded, no reduce-scatter
    reshard_after_backward: bool = True  # False: the unsharded parameters stay after backward
    unshard_in_backward: bool = True  # False: backward never all-gathers this group (its backward needs no values)
    reduce_scatter_unused_params: bool = False  # reduce zeros for parameters that got no gradient this backward
    gradient_divide_factor: float | None = None  # None: the data-parallel size (an average)
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # called on the reduced flat gradient
    all_reduce_hook_stream: torch.cuda.Stream | None = None  # CUDA: where the hook runs
    reduce_scatter_max_input_buffers: int = 1  # reduce-scatter inputs alive at once when overlapping (>= 1)
