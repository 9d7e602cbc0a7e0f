"""The two state machines of the runtime, as enums.

``TrainingState`` says which phase of a step a group is in; ``ShardedState`` says where a group's
parameters currently live (one state for the group and its parameters). ``ShardedState`` changes only in
the group's ``_to_unsharded`` / ``_to_sharded`` / ``_to_sharded_post_forward``, each of which checks the
state it leaves and raises naming both.
"""

from __future__ import annotations

from enum import Enum, auto


class TrainingState(Enum):
    """Phase of the current step, per group."""

    IDLE = auto()  # between steps, or after the end-of-backward callback
    FORWARD = auto()  # between pre-forward and post-forward
    PRE_BACKWARD = auto()  # unsharded for backward; the group's gradients are being computed
    POST_BACKWARD = auto()  # gradients taken and reduced; waiting for the end of backward


class ShardedState(Enum):
    """Where a group's parameters live."""

    SHARDED = auto()  # only the padded local shard exists; modules hold the DTensor parameters
    SHARDED_POST_FORWARD = auto()  # also a chunk over a smaller group, kept for backward (int reshard)
    UNSHARDED = auto()  # full parameters allocated and registered on the modules
