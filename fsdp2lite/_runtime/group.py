"""One communication group: the parameters of one ``fully_shard`` call.

A group is all-gathered as one collective before it is used and reduce-scattered as one collective
after its backward. It owns the phase logic; ``state.py`` decides *when* each phase runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..mesh import MeshInfo
from .collectives import (
    AllGatherResult,
    ReduceScatterResult,
    copy_out_all_gather,
    finish_reduce_scatter,
    issue_all_gather,
    issue_reduce_scatter,
    wait_all_gather,
)
from .param import FSDPParam
from .states import ShardedState, TrainingState


class FSDPParamGroup:
    """The parameters of one fully_shard call and their collectives."""

    name: str  # module path from the root ("" for the root), set at lazy init
    params: tuple[FSDPParam, ...]
    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo
    reshard_after_forward_requested: bool | None  # the user's value; None = decided by the root
    reshard_after_forward: bool  # effective value, resolved at lazy init
    reshard_after_backward: bool
    requires_gradient_sync: bool
    gradient_divide_factor: float | None  # None: the shard group size (an average)
    sharded_state: ShardedState
    training_state: TrainingState
    needs_post_backward: bool  # pre-backward ran and post-backward has not yet, this step
    all_gather_result: AllGatherResult | None  # an all-gather issued and not yet copied out
    reduce_scatter_result: ReduceScatterResult | None  # a reduce-scatter issued and not yet applied

    def __init__(
        self,
        params: tuple[FSDPParam, ...],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        reshard_after_forward: bool | None,
    ) -> None:
        self.name = type(modules[0]).__name__
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.reshard_after_forward_requested = reshard_after_forward
        self.reshard_after_forward = bool(reshard_after_forward)
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.gradient_divide_factor = None
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.needs_post_backward = False
        self.all_gather_result = None
        self.reduce_scatter_result = None

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.name or '<root>'}, {len(self.params)} params)"

    # ---- unshard / reshard ----------------------------------------------------------------
    def reset_sharded_params(self) -> None:
        for param in self.params:
            param.reset_sharded_param()

    def unshard(self) -> None:
        """Issue the all-gather unless the group is unsharded or one is already in flight."""
        if self.sharded_state is ShardedState.UNSHARDED or self.all_gather_result is not None:
            return
        info = self.mesh_info
        dtype = self.params[0].param_dtype  # one dtype per group, checked by fully_shard
        self.all_gather_result = issue_all_gather(
            self.params, info.shard_group, info.shard_size, info.shard_rank, dtype
        )

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather: copy out and register the unsharded parameters."""
        result = self.all_gather_result
        if result is None:
            return
        self.all_gather_result = None
        copy_out_all_gather(wait_all_gather(result), self.params, self.mesh_info.shard_size)
        for param in self.params:
            param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters (waiting first for an all-gather still in flight)."""
        self.wait_for_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        for param in self.params:
            param.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    # ---- phases ---------------------------------------------------------------------------
    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()

    def post_forward(self, grad_enabled: bool) -> None:
        # Without autograd no backward can follow, so nothing is worth keeping unsharded.
        if self.reshard_after_forward or not grad_enabled:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def pre_backward(self) -> None:
        self.training_state = TrainingState.PRE_BACKWARD
        self.needs_post_backward = True
        self.unshard()
        self.wait_for_unshard()

    def post_backward(self) -> None:
        """Reshard, then reduce-scatter the unsharded grads (unless gradient sync is off)."""
        self.training_state = TrainingState.POST_BACKWARD
        self.needs_post_backward = False
        if self.reshard_after_backward:
            self.reshard()
        if not self.requires_gradient_sync:
            for param in self.params:
                param.stash_unsharded_grad()  # kept unsharded until a backward with sync on
            return
        self.finish_reduce_scatter()  # a second use of the group in one step: apply the first
        params: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        for param in self.params:
            grad = param.take_unsharded_grad() if param.requires_grad else None
            if grad is not None:
                params.append(param)
                grads.append(grad)
        if not params:
            return
        info = self.mesh_info
        dtype = params[0].reduce_dtype  # one dtype per group, checked by fully_shard
        self.reduce_scatter_result = issue_reduce_scatter(
            tuple(params), tuple(grads), info.shard_group, info.shard_size, dtype
        )

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and accumulate into the sharded grads."""
        result = self.reduce_scatter_result
        if result is None:
            return
        factor = self.gradient_divide_factor or float(self.mesh_info.shard_size)
        finish_reduce_scatter(result, factor)
        self.reduce_scatter_result = None  # frees the flat buffers: [Note: buffer lifetime]

    def finalize_backward(self) -> None:
        """End of backward: reduce what autograd never handed us, apply reductions, go idle."""
        if self.needs_post_backward:
            self.post_backward()
        self.finish_reduce_scatter()
        if self.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def reset(self, drop_unsharded_grads: bool) -> None:
        """Drop per-step state after an exception: finish in-flight work, reshard, go idle.

        ``drop_unsharded_grads`` when the exception hit during backward: the unsharded gradients
        then hold a partial, unusable sum. After a forward exception they are kept (they hold the
        microbatches accumulated with gradient sync off).
        """
        self.finish_reduce_scatter()
        self.reshard()
        if drop_unsharded_grads:
            for param in self.params:
                param.take_unsharded_grad()  # discarded: a partial sum from the failed backward
        self.needs_post_backward = False
        self.training_state = TrainingState.IDLE

    @property
    def device(self) -> torch.device:
        return self.params[0].device
