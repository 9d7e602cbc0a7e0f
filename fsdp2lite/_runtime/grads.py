"""A parameter's unsharded gradient between autograd and its group's reduce-scatter.

Autograd writes ``unsharded_param.grad`` in the param dtype. With gradient sync on, post-backward takes
it for the group's one reduce-scatter; with sync off it is kept until a backward with sync on, summed in
the reduce dtype when that differs (bf16 params, fp32 reduce), so accumulation loses no precision.

[Note: one reduce dtype]
Every gradient of a group reaches the reduce-scatter in the group's reduce dtype, whichever path it came
by; gradients of several dtypes are one copy-in only once they share one (``_chunk_cat`` takes one
dtype; torch's fully_shard raises on the mix, pytorch#196996):

    accumulated with sync off            reduce dtype (summed there)
    tp-reduced (Partial -> Replicate)    reduce dtype ([Note: tensor-parallel gradient reduce])
    this backward's only                 param dtype: cast when the group's others are not in it
    zeros for an unused parameter        param dtype: the same (``set_reduce_scatter_unused_params``)

A group whose gradients are all in the param dtype is copied in as autograd wrote them: the copy-in
casts them in the same pass ([Note: hot path] in gather.py). A parameter that got no gradient in
some microbatch keeps nothing for it, so its sum, when it has one, is in the reduce dtype like the others.

[Note: tensor-parallel gradient reduce]
Under tensor parallelism ([Note: tensor parallel] in param.py) a gradient is a DTensor on the tp mesh,
possibly ``Partial`` where the parameter is ``Replicate`` (a norm weight under sequence parallelism); its
redistribute to the parameter's placements is an all-reduce over tp, a gradient reduction like the
reduce-scatter, so it runs in the reduce dtype too: the gradient is cast first (pytorch#190626; torch's
fully_shard did so only for accumulated gradients). With sync off the ``Partial`` sum is kept as a
DTensor and redistributed once, at the reducing backward: one tp all-reduce per step, not per microbatch.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec


class GradsOwner(Protocol):
    """What a parameter's gradients read of their ``param.FSDPParam`` (which imports this module: no import back)."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype  # dtype of the reduce-scatter, the tp all-reduce and accumulation with sync off
    tp_spec: DTensorSpec | None

    @property
    def unsharded_param(self) -> nn.Parameter | None: ...


class ParamGrads:
    """The gradients of one parameter (the parameter holds it as ``grads``): what it keeps between backwards
    and hands to the reduction."""

    accumulated_grad: torch.Tensor | None  # unsharded, in reduce_dtype, when it differs from param_dtype
    partial_reduced_grad: torch.Tensor | None  # HSDP, all-reduce off: replica-local sum, (padded_numel,)

    def __init__(self, param: GradsOwner) -> None:
        self.param = param
        self.accumulated_grad = self.partial_reduced_grad = None

    def _pop_autograd_grad(self) -> torch.Tensor | None:
        """This backward's gradient as autograd wrote it (a tp DTensor under TP), taken off the parameter."""
        unsharded = self.param.unsharded_param
        if unsharded is None or unsharded.grad is None:
            return None
        grad = unsharded.grad
        unsharded.grad = None
        return grad

    def _to_local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Under TP, this rank's tp piece at the parameter's tp placements, brought there in the reduce
        dtype ([Note: tensor-parallel gradient reduce]); a plain gradient as it is."""
        if not isinstance(grad, DTensor):
            return grad
        spec = self.param.tp_spec
        if spec is not None and tuple(grad.placements) != tuple(spec.placements):
            grad = cast(DTensor, grad.to(self.param.reduce_dtype)).redistribute(
                spec.mesh, spec.placements
            )  # Partial -> Replicate
        return grad._local_tensor  # type: ignore[attr-defined]

    def stash(self) -> None:
        """Gradient sync is off: keep this backward's gradient for the next synchronising one.

        In the param dtype autograd keeps accumulating into ``.grad``; when the reduce dtype differs
        the sum is kept in the reduce dtype instead (a tp DTensor under TP, reduced once at the end).
        """
        reduce_dtype = self.param.reduce_dtype
        if reduce_dtype == self.param.param_dtype:
            return
        grad = self._pop_autograd_grad()
        if grad is None:
            return  # no gradient this microbatch: the sum so far stays as it is
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self.accumulated_grad.add_(grad)

    def take(self) -> torch.Tensor | None:
        """The whole unsharded gradient to reduce (stashed sum + this backward's), detached, local."""
        grad = self._pop_autograd_grad()
        accumulated, self.accumulated_grad = self.accumulated_grad, None
        if accumulated is not None:
            if grad is not None:
                accumulated.add_(grad)
            grad = accumulated
        return None if grad is None else self._to_local_grad(grad)

    def drop(self) -> None:
        """Forget this backward's gradient and any stashed sum, with no communication (after a failure)."""
        self._pop_autograd_grad()
        self.accumulated_grad = None

    def clear(self) -> None:
        """Forget every kept sum, with no communication (the parameter's dtype changed: ``module.to``)."""
        self.accumulated_grad = self.partial_reduced_grad = None

    def keep_partial_reduced(self, padded_grad: torch.Tensor) -> None:
        """HSDP with the all-reduce off: add this reduce-scatter's replica-local sum to the kept one."""
        if self.partial_reduced_grad is None:
            self.partial_reduced_grad = padded_grad.clone()  # the flat output buffer is freed after this
        else:
            self.partial_reduced_grad.add_(padded_grad)

    def add_partial_reduced(self, padded_grad: torch.Tensor) -> torch.Tensor | None:
        """Before the all-reduce: fold the kept replica-local sums into this reduce-scatter's slot.

        Returns the folded tensor (or None) so the caller can keep it alive while a stream reads it.
        """
        partial, self.partial_reduced_grad = self.partial_reduced_grad, None
        if partial is not None:
            padded_grad.add_(partial)
        return partial


def to_one_dtype(grads: list[torch.Tensor], dtype: torch.dtype) -> None:
    """A group's gradients for its one copy-in, in place: left as they are when they share a dtype, else
    each cast to the reduce dtype ``dtype`` as it is replaced (fresh beside accumulated: [Note: one reduce dtype])."""
    if len({grad.dtype for grad in grads}) > 1:
        for index, grad in enumerate(grads):
            grads[index] = grad.to(dtype)
