"""What one parameter is given at ``fully_shard``: the policies it runs under (``ParamPolicy``, resolved from
the call's MixedPrecisionPolicy and OffloadPolicy) and the places it is registered (``ParamPlace``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ParamPolicy:
    """The resolved policies one parameter runs under (from MixedPrecisionPolicy/OffloadPolicy)."""

    param_dtype: torch.dtype | None  # unsharded/all-gather dtype; None keeps the parameter's own
    reduce_dtype: torch.dtype | None  # reduce-scatter dtype; None uses the param dtype
    offload_to_cpu: bool  # sharded parameters and gradients live on CPU
    pin_memory: bool  # host shards and gradients pinned (only meaningful with CUDA)
    host_masters: bool = False  # optimizer_only: shards on the device, masters on the host ([Note: host masters])
    nvme_path: str | None = None  # optimizer state in files there between steps ([Note: optimizer state on NVMe])
    shard_align: int = 1  # each rank's padded rows a multiple of this ([Note: padded shard] in layout.py)


@dataclass(frozen=True)
class ParamPlace:
    """One place a parameter is registered: ``module.<name>`` (tied parameters have several)."""

    module: nn.Module
    name: str
