"""Whole sharding setups as data: a YAML file becomes an ``FSDPConfig`` (``schema``), its rules become
groups against a model (``plan``), and ``apply_config`` shards the model (``apply``); every problem is a
``Problem`` in one ``ConfigError`` (``errors``)."""

from __future__ import annotations

from .apply import apply_config, checkpoint_forward
from .errors import ConfigError, Problem
from .plan import GroupPlan, GroupPolicy, Plan, join_path, mesh_problems, plan_config, policy_problems
from .schema import (
    FSDPConfig,
    Match,
    MeshConfig,
    OffloadConfig,
    ReshardAfterForward,
    ScheduleConfig,
    ShardPlacementRule,
    WrapRule,
    problems_from,
)

__all__ = [
    "ConfigError",
    "FSDPConfig",
    "GroupPlan",
    "GroupPolicy",
    "Match",
    "MeshConfig",
    "OffloadConfig",
    "Plan",
    "Problem",
    "ReshardAfterForward",
    "ScheduleConfig",
    "ShardPlacementRule",
    "WrapRule",
    "apply_config",
    "checkpoint_forward",
    "join_path",
    "mesh_problems",
    "plan_config",
    "policy_problems",
    "problems_from",
]
