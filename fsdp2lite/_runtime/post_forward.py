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

from .param import FSDPParam


def check_post_forward_size(value: int, shard_size: int) -> None:
    """An int reshard_after_forward must divide the shard group size; raises listing the valid ones."""
    if value < 1 or shard_size % value:
        divisors = [k for k in range(1, shard_size + 1) if shard_size % k == 0]
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size ({shard_size}); "
            f"valid values: {divisors} (1 behaves like False, {shard_size} like True)"
        )


def check_post_forward_dims(value: int, params: tuple[FSDPParam, ...] | list[tuple[str, int]]) -> None:
    """Resharding to k ranks after forward keeps dim-0 chunks: parameters sharded on another dim
    (``shard_placement_fn``) cannot; raises naming them. ``params``: FSDPParams or (fqn, shard dim)."""
    dims = [(p.fqn, p.shard_dim) if isinstance(p, FSDPParam) else p for p in params]
    other = [f"{fqn} (Shard({dim}))" for fqn, dim in dims if dim != 0]
    if other:
        raise ValueError(
            f"reshard_after_forward={value} reshards to groups of {value} ranks on dim 0, but these parameters "
            f"are sharded on another dim: {', '.join(other)}; use True or False for this group, or shard "
            "them on dim 0"
        )
