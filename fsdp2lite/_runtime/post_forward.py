"""``reshard_after_forward=k``: the values a group can take, and the k-rank group it reshards to after
forward.

[Note: post-forward reshard]
``reshard_after_forward=k`` (1 < k < shard size, k divides it): after forward each rank keeps its
torch.chunk piece of the parameters as if sharded over k ranks (its k-1 neighbours in the shard group
keep the others), so the backward all-gather runs over those k ranks only: less traffic and latency,
for (shard_size / k) times the sharded bytes held between forward and backward.

A group that all-gathers bytes (several dtypes, or torch's all-gather hooks) has no one-dtype unsharded
rows to chunk: each rank keeps instead shard_size / k consecutive slots of the forward's all-gather output
(its rank-major per-rank inputs, hook outputs included), and the k-rank regather puts every slot back in
place, so the copy-out, and a hook's ``fsdp_post_all_gather`` with the forward's metadata, run as after
the forward's all-gather (torch's ``fully_shard`` refuses an int for hooked parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

from ..mesh import MeshInfo
from .comm import Ranks
from .param import FSDPParam


def is_rank_count(value: Any) -> TypeGuard[int]:
    """``reshard_after_forward=k``'s k: an int that is not a bool (True and False are ints in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PostForwardReshard:
    """``reshard_after_forward`` decoded once, from a value already checked (``_plan.py``, or the setter's
    ``check_post_forward``): what a group does with its unsharded parameters after forward, and for a k-rank
    reshard the k ranks it keeps its chunks over."""

    requested: bool | int | None  # the user's value; None: the root keeps, every other group frees
    ranks: Ranks | None  # the k-rank group of a k-rank reshard (1 < k < shard size); None: all freed or all kept

    @classmethod
    def of(cls, value: bool | int | None, info: MeshInfo) -> PostForwardReshard:
        """Decode ``value`` for a group on ``info``'s mesh; an int k makes (or reuses) the k-rank process groups."""
        if not (is_rank_count(value) and 1 < value < info.shard_size):
            return cls(value, None)
        group, rank = info.post_forward_group(value)
        return cls(value, Ranks(group, value, rank))

    def frees(self, is_root: bool) -> bool:
        """Whether forward ends by freeing (or shrinking to k ranks) the unsharded parameters."""
        if self.requested is None:
            return not is_root  # the root keeps its parameters: backward starts with it
        return self.requested > 1 if is_rank_count(self.requested) else bool(self.requested)


def post_forward_size_problem(value: int, shard_size: int) -> tuple[str, str] | None:
    """Why ``reshard_after_forward=value`` cannot be (it must divide the shard group size), and the valid values;
    None when it can. ``fully_shard``'s plan (``_plan.py``) and ``set_reshard_after_forward`` ask this."""
    if value >= 1 and shard_size % value == 0:
        return None
    divisors = [k for k in range(1, shard_size + 1) if shard_size % k == 0]
    return (
        f"reshard_after_forward={value} must divide the shard group size ({shard_size})",
        f"valid values: {divisors} (1 behaves like False, {shard_size} like True), or True or False",
    )


def post_forward_dims_problem(value: int, dims: list[tuple[str, int]]) -> tuple[str, str] | None:
    """Resharding to k ranks after forward keeps dim-0 chunks: why parameters sharded on another dim
    (``(fqn, shard dim)``) cannot, naming them; None when none is."""
    other = [f"{fqn} (Shard({dim}))" for fqn, dim in dims if dim != 0]
    if not other:
        return None
    return (
        f"reshard_after_forward={value} reshards to groups of {value} ranks on dim 0, but these parameters are "
        f"sharded on another dim: {', '.join(other)}",
        "use True or False for this group, or shard them on dim 0",
    )


def post_forward_align_problem(value: int, align: int) -> tuple[str, str] | None:
    """Resharding to k ranks after forward keeps torch.chunk's k-rank chunks, which block-aligned shards
    (``ShardingPolicy(align=N)``, [Note: padded shard] in layout.py) are not: why it cannot, or None. The plan and
    ``set_reshard_after_forward`` ask this."""
    if align <= 1:
        return None
    return (
        f"reshard_after_forward={value} keeps torch.chunk's k-rank chunks, but ShardingPolicy(align={align}) pads "
        "this group's shards",
        "use True or False for this group, or align=1",
    )


def check_post_forward(value: int, shard_size: int, params: tuple[FSDPParam, ...]) -> None:
    """``set_reshard_after_forward(k)`` on a built group: ValueError when k cannot be (the plan's checks)."""
    problem = post_forward_size_problem(value, shard_size)
    if problem is None and 1 < value < shard_size:
        problem = post_forward_dims_problem(value, [(p.fqn, p.shard_dim) for p in params])
    if problem is None and 1 < value < shard_size:
        problem = post_forward_align_problem(value, max(p.layout.align for p in params))
    if problem is not None:
        raise ValueError(f"{problem[0]}; {problem[1]}")
