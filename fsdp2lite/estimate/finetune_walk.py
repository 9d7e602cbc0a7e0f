"""A LoRA or QLoRA step planned as it runs: each group's moments, with what is gathered, kept and in flight.

[Note: the fine-tuning walk]
A fine-tuning step's memory is the frozen base's shards and the adapters' state (always there), the groups
gathered at each moment, and the activations. The walk visits each group's moments in forward order, then in
backward order, and adds at each what the runtime holds then ([Note: traced moments] gives the activation side):

    static      every shard kept on the device, the adapters' optimizer state
    kept        groups resharded only after backward (reshard_after_forward false, or an int k: 1/k of it),
                from their forward to their backward; a group whose backward never runs until the step's end
    gathered    the group itself (its parameters in the compute dtype, NF4 weights as NF4)
    copy-out    at its pre-forward, its all-gather output beside the parameters made from it (none for a group
                of one parameter: the collective writes it in place); the hooked (NF4) parameters' own output
                buffers exist from the all-gather's issue
    prefetched  forward: the next ``forward_prefetch_depth`` groups' all-gathers in flight (issued after this
                group's copy-out); backward on CUDA (``late_backward_prefetch`` false): the previous group's
    gradients   backward: this group's unsharded gradients, the reduce-scatter still in flight (CUDA overlaps
                one), and the sharded gradients of every group whose backward ended
    activations the traced moment, with every block's saved activations at the whole model's depth (QLoRA: each
                matmul's dequantized weight and its temporaries are traced where they happen)

The peak is the largest moment, or the optimizer step (static, the sharded gradients, the optimizer's
temporaries). ``benchmarks/bench_founding.py`` checks it against what a real step allocates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from ..config import FSDPConfig, Plan
from .common import GroupBytes, MemoryEstimate, cached_plan
from .finetune import Finetune, nf4_bytes
from .finetune_trace import TRACED_BLOCKS, Trace, trace_finetune_step
from .host import offloaded_groups
from .plan_bytes import finetune_note, group_bytes, memory_terms, nf4_paths, padded_numel
from .reserved import from_ratio


@dataclass(frozen=True)
class Schedule:
    """What decides which all-gathers are in flight, resolved for the target device."""

    forward_prefetch_depth: int
    late_backward_prefetch: bool
    overlap_reduce_scatter: bool


@dataclass(frozen=True)
class GroupPlanBytes:
    """One group's bytes for the walk, on this rank."""

    unsharded: int  # gathered, in the compute dtype (NF4 as NF4)
    hooked: int  # its NF4 parameters' gathered bytes: their output buffers, allocated at the all-gather's issue
    direct: bool  # one dim-0 parameter, no hooks: the all-gather writes it in place (no copy-out)
    kept: int  # what it keeps from its forward to its backward: all (reshard false), 1/k (an int k), none
    grads: int  # its trainable parameters' unsharded gradients
    reduced: int  # its reduce-scatter input
    trainable: int  # its sharded gradients


@dataclass(frozen=True)
class Moment:
    name: str
    group: int | None
    breakdown: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.breakdown.values())


def walk(
    trace: Trace, groups: list[GroupPlanBytes], static: tuple[int, int], schedule: Schedule, optimizer_step: int
) -> list[Moment]:
    """Every moment of the step ([Note: the fine-tuning walk]); ``static``: (device shards, optimizer state);
    ``optimizer_step``: the optimizer's temporaries."""
    shards, state = static
    moments = []
    for position, index in enumerate(trace.order):
        moments += _forward_moments(trace, groups, position, index, schedule)
        moments += _backward_moments(trace, groups, position, index, schedule)
    moments = [Moment(m.name, m.group, {**m.breakdown, "params": shards, "optimizer": state}) for m in moments]
    sharded_grads = sum(g.trainable for g in groups)
    step = {"params": shards, "unsharded_params": 0, "grads": sharded_grads, "optimizer": state}
    moments.append(Moment("optimizer", None, {**step, "activations": 0, "comm_buffers": optimizer_step}))
    return moments


def _kept(trace: Trace, groups: list[GroupPlanBytes], position: int, backward: bool) -> int:
    """Groups gathered beside this moment's own: the root (gathered for the whole pass, forward and backward),
    those before it in forward order keeping theirs, and in backward those kept to the step's end."""
    order = trace.order
    before, traced, cut = set(order[:position]), set(order), set(trace.cut)
    own = order[position]
    total = 0
    for i, g in enumerate(groups):
        if i == own:
            continue
        if i in cut:  # blocks alike to the traced ones, all before the last traced block
            total += g.kept if trace.after_block(own) else 0
        elif i not in traced:
            total += g.unsharded
        elif i in before or (backward and g.kept and not _has_backward(trace, i)):
            total += g.kept
    return total


def _forward_moments(
    trace: Trace, groups: list[GroupPlanBytes], position: int, index: int, schedule: Schedule
) -> list[Moment]:
    """Its copy-out (its all-gather's output beside the parameters made from it) and its forward's peak (the
    next groups' all-gathers in flight); a run-by-run head: the loss's runs beside the decoder's output."""
    group = groups[index]
    kept = _kept(trace, groups, position, backward=False)
    upcoming = trace.order[position + 1 : position + 1 + schedule.forward_prefetch_depth]
    prefetched = sum(groups[i].unsharded + groups[i].hooked for i in upcoming)  # not gathered before
    extra = trace.extra_blocks * trace.saved_per_block if trace.after_block(index) else 0
    gathered = kept + group.unsharded
    if index == trace.head:
        loss = trace.decoder_output + extra + trace.head_run
        return [Moment("forward", index, _parts(gathered, 0, loss, prefetched))]
    moment = trace.moments[index]
    copy_out = 0 if group.direct else group.unsharded
    return [
        Moment("forward (copy-out)", index, _parts(gathered, 0, moment.before_forward + extra, copy_out)),
        Moment("forward", index, _parts(gathered, 0, moment.forward + extra, prefetched)),
    ]


def _backward_moments(
    trace: Trace, groups: list[GroupPlanBytes], position: int, index: int, schedule: Schedule
) -> list[Moment]:
    """Its backward's compute peak (gathered, activations, the later groups' sharded gradients and the
    reduce-scatter still in flight), and its post-backward (resharded: its unsharded gradients, their
    reduce-scatter input, the previous group's all-gather on CPU's late prefetch)."""
    group = groups[index]
    extra = trace.extra_blocks * trace.saved_per_block if trace.after_block(index) else 0
    if index == trace.head:
        tokens, width = trace.head_output
        peak = entering = trace.decoder_output + extra + trace.head_run + tokens * width
    else:
        moment = trace.moments[index]
        if moment.backward is None:
            return []
        peak, entering = moment.backward + extra, (moment.before_backward or 0) + extra
    kept = _kept(trace, groups, position, backward=True)
    previous = trace.order[position - 1] if position > 0 else None
    prefetched = 0
    if previous is not None and groups[previous].kept == 0 and _has_backward(trace, previous):
        prefetched = groups[previous].unsharded + groups[previous].hooked
    later = trace.order[position + 1 :]
    sharded_grads = sum(groups[i].trainable for i in later)
    in_flight = groups[later[0]].reduced if later and schedule.overlap_reduce_scatter else 0
    early = 0 if schedule.late_backward_prefetch else prefetched  # CUDA: issued at this group's pre-backward
    compute = _parts(kept + group.unsharded, sharded_grads, peak, early + in_flight)
    reduce = _parts(kept, sharded_grads + group.grads, entering, prefetched + group.reduced)
    return [Moment("backward", index, compute), Moment("backward (reduce-scatter)", index, reduce)]


def _has_backward(trace: Trace, index: int) -> bool:
    if index == trace.head:
        return True
    moment = trace.moments.get(index)
    return moment is not None and moment.backward is not None


def _parts(unsharded: int, grads: int, activations: int, buffers: int) -> dict[str, int]:
    """A moment's breakdown but for the static part (the walk adds the shards and the optimizer state)."""
    return {"unsharded_params": unsharded, "grads": grads, "activations": activations, "comm_buffers": buffers}


def group_plan_bytes(plan: Plan, groups: list[GroupBytes], shard: int, nf4: set[str]) -> list[GroupPlanBytes]:
    """Each plan group's bytes for the walk."""

    out = []
    for index, (group, spec, bytes_) in enumerate(zip(plan.groups, plan.specs, groups)):
        hooked = sum(nf4_bytes(padded_numel(p.param, shard, p.dim)) for p in spec.params if p.fqn in nf4)
        direct = len(spec.params) == 1 and spec.params[0].dim == 0 and not hooked
        reshard = group.policy.reshard_after_forward
        root = index == len(plan.groups) - 1
        if reshard == "auto":
            reshard = not root
        kept = 0 if reshard is True else bytes_.unsharded if reshard is False else bytes_.unsharded // int(reshard)
        out.append(
            GroupPlanBytes(
                bytes_.unsharded,
                hooked,
                direct,
                kept,
                bytes_.unsharded_grads,
                bytes_.reduced,
                bytes_.trainable,
            )
        )
    return out


def walk_estimate(
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig,
    world_size: int,
    rank: int,
    inputs_fn: Callable[[], Any] | None,
    batch: int,
    seq: int | None,
    optimizer: str,
    device: str,
    cache: dict[Any, Any],
    finetune: Finetune,
) -> MemoryEstimate:
    """``estimate_memory(method="analytic")`` for lora and qlora: the walk's largest moment ([Note: the
    fine-tuning walk]). ``cache`` holds the meta model (made by the caller) and each trace."""
    model = cache["model"]
    replicate, shard = config.mesh.resolve(world_size)
    plan = cached_plan(cache, model, config)
    nf4 = nf4_paths(model) if finetune.kind == "qlora" else set()
    terms, host = memory_terms(plan, (replicate, shard), nf4, optimizer, device)
    groups = group_bytes(plan, shard, nf4, pinned=device == "cuda")
    checkpointed = tuple(p for g in plan.groups if g.policy.activation_checkpointing for p in g.paths)
    memo = ("walk", config.mixed_precision.param_dtype, checkpointed, frozenset(nf4))
    if memo not in cache:
        cache[memo] = trace_finetune_step(model_fn, config, plan, inputs_fn, batch, seq, nf4)
    trace = cache[memo]
    offloaded = offloaded_groups(plan)
    plan_bytes = [
        replace(g, trainable=0) if i in offloaded else g
        for i, g in enumerate(group_plan_bytes(plan, groups, shard, nf4))
    ]
    moments = walk(trace, plan_bytes, (terms["S"], terms["O"]), _schedule(config, device), terms["T"])
    peak = max(moments, key=lambda m: m.total)
    phase = peak.name.split(" ")[0]
    label = None if peak.group is None else plan.specs[peak.group].label
    last = max(trace.blocks, key=trace.order.index) if trace.blocks else None
    recomputed = 0 if last is None else (trace.moments[last].backward or 0) - (trace.moments[last].before_backward or 0)
    terms = {"S": terms["S"], "O": terms["O"], "S_t": terms["S_t"], "A_b": trace.saved_per_block, "A_r": recomputed}
    notes = (
        f"peak = {peak.name} of {label or 'the step'} ([Note: the fine-tuning walk])",
        "terms: "
        + ", ".join(f"{key} {value:,}" for key, value in terms.items())
        + " (S shards, O optimizer state, S_t trainable shards, A_b a block's saved activations, A_r a block's "
        "backward working set)",
        finetune_note(finetune, plan, nf4),
        f"activations traced on fake tensors at {TRACED_BLOCKS} blocks, {trace.extra_blocks} more added at "
        f"{trace.saved_per_block:,} bytes each",
    )
    reserved = from_ratio(peak.total, phase) if device == "cuda" else None
    return MemoryEstimate(
        world_size, rank, peak.total, phase, label, dict(peak.breakdown), "analytic", device, notes,
        host_bytes=host.pinned, host_exact_bytes=host.exact, nvme_bytes=host.nvme,
        host_bytes_step_in_backward=host.pinned_in_backward, finetune=finetune.kind,
        reserved_bytes=reserved.reserved_bytes if reserved else 0,
        reserved_expandable_bytes=reserved.expandable_bytes if reserved else 0,
    )  # fmt: skip


def _schedule(config: FSDPConfig, device: str) -> Schedule:
    """The config's schedule with ``auto`` resolved for the target device (``_runtime.root.schedule_defaults``)."""
    from .._runtime.root import schedule_defaults

    defaults = schedule_defaults(on_cuda=device == "cuda")
    values = {
        key: getattr(defaults, key) if getattr(config.schedule, key) == "auto" else getattr(config.schedule, key)
        for key in ("forward_prefetch_depth", "late_backward_prefetch", "overlap_reduce_scatter")
    }
    return Schedule(**values)
