"""fsdp2lite: FSDP2-style per-parameter sharding on DTensor and c10d.

import fsdp2lite as fl
for block in model.blocks:
    fl.fully_shard(block)
fl.fully_shard(model)
"""

from __future__ import annotations

from ._runtime.extension_inputs import AllGatherInput
from .api import fully_shard
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, FSDPConfig, apply_config, plan_config
from .estimate import MemoryEstimate, estimate_memory
from .forward_pass import register_fsdp_forward_method
from .integrations import PatchReport, patch, unpatch
from .launch import init_process_group
from .mesh import init_mesh
from .module import FSDPModule, UnshardHandle, share_comm_ctx
from .offload import fast_host_step, step_in_backward
from .policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardingPolicy
from .trace import count_wire_bytes, record_trace
from .weights import WeightsReport, load_sharded_weights

__version__ = "0.1.0"

__all__ = [
    "AllGatherInput",
    "CPUOffloadPolicy",
    "CheckpointError",
    "CommPolicy",
    "ConfigError",
    "FSDPConfig",
    "FSDPModule",
    "MemoryEstimate",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PatchReport",
    "ShardingPolicy",
    "UnshardHandle",
    "WeightsReport",
    "__version__",
    "apply_config",
    "count_wire_bytes",
    "estimate_memory",
    "fast_host_step",
    "fully_shard",
    "init_mesh",
    "init_process_group",
    "load_checkpoint",
    "load_sharded_weights",
    "patch",
    "plan_config",
    "record_trace",
    "register_fsdp_forward_method",
    "save_checkpoint",
    "share_comm_ctx",
    "unpatch",
    "step_in_backward",
]
