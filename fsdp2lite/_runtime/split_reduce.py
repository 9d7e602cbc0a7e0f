"""Per-parameter mixed precision's reduction: one reduce-scatter per reduce dtype, in one group.

[Note: per-parameter mixed precision]
``fully_shard(..., mp_overrides={"*norm*": MixedPrecisionPolicy(param_dtype=torch.float32)})`` (or a policy
file's ``precision_overrides`` rules) gives the matching parameters of a group a policy of their own: a
LayerNorm or a MoE router computes in fp32 while the rest of the block computes in bf16. The group stays one
group (one pre-forward, one all-gather per use): its parameters gather in two dtypes, which the byte form
already does in one collective ([Note: byte all-gather] in gather.py). Only the reduction must change: a
reduce-scatter sums one dtype, so ``SplitReduce`` lays the gradients out per reduce dtype and runs the
group's own form (native, in place on gloo, all-to-all) once per dtype, each part in its own dtype:

    params w1 (bf16 compute, bf16 reduce), norm (fp32, fp32), w2 (bf16, bf16); 2 ranks
    part bf16: [w1 | w2] -> reduce-scatter in bf16     part fp32: [norm] -> reduce-scatter in fp32
    finish: each part waited; the slots joined in one flat buffer in the widest dtype (fp32), in
    part order (w1, w2, norm): the order the result's parameters carry, so the division, the all-reduce
    hook and the sharded gradients run as for any group

Per step that is one all-gather and k reduce-scatters per group for k reduce dtypes (torch's ``fully_shard``
takes one group per dtype: k all-gathers and k reduce-scatters, pytorch#196626). The division by the
data-parallel size runs on the joined output, in the widest dtype. A group without overrides never gets
this form. A 2-D (HSDP) mesh with several reduce dtypes is refused by ``fully_shard``: the step across
replicas runs on the joined output, in one dtype.
"""

from __future__ import annotations

import torch

from .comm import Comm
from .param import FSDPParam
from .reduce import ReduceForm, ReduceScatterResult
from .trace import Meters


class SplitReduce(ReduceForm):
    """A group whose parameters reduce in several dtypes: ``inner`` (the form the group would use) once per
    reduce dtype ([Note: per-parameter mixed precision])."""

    def __init__(self, inner: ReduceForm) -> None:
        super().__init__(inner.ranks, inner.collective)
        self.inner = inner

    def issue(
        self, params: tuple[FSDPParam, ...], grads: list[torch.Tensor], comm: Comm, meters: Meters
    ) -> ReduceScatterResult:
        """Issue one reduction per reduce dtype (in order of first appearance); the result's parameters are
        in part order, and its parts finish in ``finish``."""
        by_dtype: dict[torch.dtype, tuple[list[FSDPParam], list[torch.Tensor]]] = {}
        for param, grad in zip(params, grads):
            part = by_dtype.setdefault(param.reduce_dtype, ([], []))
            part[0].append(param)
            part[1].append(grad)
        grads.clear()  # each part's list now holds the only references: freed at its copy-in
        if len(by_dtype) == 1:  # this backward's gradients (the trainable ones) reduce in one dtype
            (part_params, part_grads), *_ = by_dtype.values()
            return self.inner.issue(tuple(part_params), part_grads, comm, meters)
        parts = tuple(self.inner.issue(tuple(ps), gs, comm, meters) for ps, gs in by_dtype.values())
        ordered = tuple(param for part in parts for param in part.params)
        first = parts[0]
        return ReduceScatterResult(
            first.reduce_scatter_output, first.reduce_scatter_input, ordered, None, event=None, form=self, parts=parts
        )

    def finish(self, result: ReduceScatterResult, comm: Comm) -> torch.Tensor:
        """Each part finished by the inner form, joined into one ``(group_numel,)`` buffer in the widest dtype."""
        outputs = [part.form.finish(part, comm) for part in result.parts]
        wide = outputs[0].dtype
        for output in outputs[1:]:
            wide = torch.promote_types(wide, output.dtype)
        return torch.cat([output.to(wide) for output in outputs])


def split_if_mixed(params: tuple[FSDPParam, ...], form: ReduceForm) -> ReduceForm:
    """``form``, or ``SplitReduce`` around it when the group's parameters run under several policies."""
    if len({param.policy for param in params}) > 1:
        return SplitReduce(form)
    return form
