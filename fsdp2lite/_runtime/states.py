"""The state machines of the runtime: their states, and the transitions of the sharded one.

``TrainingState`` says which phase of a step a group is in; ``Role`` whether a call's state is its model's root;
``ShardedState`` where a group's parameters currently live (one state for the group and its parameters).
``ShardedState`` changes only in ``ShardedStates.to_unsharded`` / ``to_sharded`` / ``to_sharded_post_forward`` (the
machine each group holds as ``states``), each of which checks the state it leaves and raises naming both.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .gather import Regather
    from .param import FSDPParam
    from .seams import GroupStorage


class TrainingState(Enum):
    """Phase of the current step, per group."""

    IDLE = auto()  # between steps, or after the end-of-backward callback
    FORWARD = auto()  # between pre-forward and post-forward
    PRE_BACKWARD = auto()  # unsharded for backward; the group's gradients are being computed
    POST_BACKWARD = auto()  # gradients taken and reduced; waiting for the end of backward


class Role(Enum):
    """What one ``fully_shard`` call's state is in its model, decided by the first forward (the root's lazy init)."""

    UNDECIDED = auto()  # no forward yet: the outermost state to run forward becomes the root
    ROOT = auto()  # the outermost: owns the RootContext its tree shares
    NESTED = auto()  # under a root


class ShardedState(Enum):
    """Where a group's parameters live."""

    SHARDED = auto()  # only the padded local shard exists; modules hold the DTensor parameters
    SHARDED_POST_FORWARD = auto()  # also a chunk over a smaller group, kept for backward (int reshard)
    UNSHARDED = auto()  # full parameters allocated and registered on the modules


class StatesOwner(Protocol):
    """What the sharded-state machine reads of its group, at each transition."""

    params: tuple[FSDPParam, ...]
    storages: tuple[GroupStorage, ...]
    keeps_unsharded: bool


class ShardedStates:
    """The sharded-state machine of one group (the group holds it as ``states``): where its parameters live
    (``current``), and while resharded to the post-forward group the regather for backward; its transitions are the
    only writers of the three, each checking the state it leaves."""

    current: ShardedState
    regather: Regather | None  # while resharded to the post-forward group: its all-gather for backward
    post_forward_kept: Regather | None  # a byte group's slots, kept at copy-out for its post-forward reshard

    def __init__(self, group: StatesOwner) -> None:
        self.group = group
        self.current = ShardedState.SHARDED
        self.regather = self.post_forward_kept = None

    def __repr__(self) -> str:
        return repr(self.group)

    def to_unsharded(self, kept: Regather | None = None) -> None:
        """SHARDED or SHARDED_POST_FORWARD -> UNSHARDED: the filled unsharded parameters on the modules
        (``kept``: what a byte group keeps for its post-forward regather)."""
        self._leave(ShardedState.UNSHARDED, ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD)
        for param in self.group.params:
            param.unsharded.to_unsharded()
        self.regather = None  # consumed: [Note: buffer lifetime]
        self.post_forward_kept = kept
        self.current = ShardedState.UNSHARDED
        for storage in self.group.storages:
            storage.gathered()

    def to_sharded(self, keep: bool) -> None:
        """UNSHARDED or SHARDED_POST_FORWARD -> SHARDED: the DTensors on the modules, the unsharded storage
        freed (``keep``: a resident group's stays); or SHARDED -> SHARDED freeing a resident group's storage."""
        allowed: tuple[ShardedState, ...] = (ShardedState.UNSHARDED, ShardedState.SHARDED_POST_FORWARD)
        if self.group.keeps_unsharded and not keep:
            allowed = (*allowed, ShardedState.SHARDED)
        self._leave(ShardedState.SHARDED, *allowed)
        for param in self.group.params:
            param.unsharded.to_sharded(keep)
        self.regather = self.post_forward_kept = None
        self.current = ShardedState.SHARDED

    def to_sharded_post_forward(self, regather: Regather) -> None:
        """UNSHARDED -> SHARDED_POST_FORWARD: only this rank's chunks over the post-forward group kept."""
        self._leave(ShardedState.SHARDED_POST_FORWARD, ShardedState.UNSHARDED)
        for param in self.group.params:
            param.unsharded.to_sharded()
        self.regather, self.post_forward_kept = regather, None
        self.current = ShardedState.SHARDED_POST_FORWARD

    def _leave(self, target: ShardedState, *allowed: ShardedState) -> None:
        """Check that the group may go to ``target`` from where it is (an internal invariant)."""
        if self.current not in allowed:
            raise RuntimeError(
                f"{self.group}: cannot go from {self.current.name} to {target.name} "
                f"(only from {', '.join(state.name for state in allowed)})"
            )
