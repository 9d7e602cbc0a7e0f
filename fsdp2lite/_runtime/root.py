"""The root's shared context: the forward order, prefetching, reduce-scatter pipelining, the end of backward.

One ``RootContext`` per root, made by its lazy init over every ``FSDPState`` below it (``hooks.py``).

[Note: prefetch]
Forward: once a group is unsharded (its copy-out done, its all-gather buffer freed), the all-gathers of
the next ``forward_prefetch_depth`` groups in the recorded forward order are issued, so they run while
this group computes. Default depth: 1 on CPU (nothing else would start them early), 0 on CUDA (the
host runs ahead of the GPU, so the next pre-forward issues its all-gather early anyway).
Backward: each group prefetches the group before it in forward order, either at its pre-backward, so
the all-gather overlaps this group's backward compute (default on CUDA), or right after issuing its
reduce-scatter (``late_backward_prefetch``, default on CPU), so the all-gather overlaps the
reduce-scatter but never coexists with this group's whole gradients and its reduce-scatter buffer:
one block-sized buffer less at the backward peak, for less overlap where compute and gloo's thread
compete for the same cores anyway (benchmarks/results: params config).
A group's reduce-scatter can be waited only when the next group issues its own, so it overlaps the
backward compute in between (``overlap_reduce_scatter``); that holds its flat input buffer (a block's
worth) through that backward. Default: on for CUDA, where side streams make the overlap real; off for
CPU, where gloo's thread competes with compute for the same cores and torch's fully_shard also waits
at once, so the memory is worth more than the overlap (``set_overlap_reduce_scatter(True)`` turns it
on). Peak during forward (depth d >= 1): the group computing plus d in-flight all-gather buffers,
i.e. (d + 1) unsharded groups; the copy-out moment, 2 for d = 0.

[Note: microbatching]
``set_is_last_backward(False)`` marks the coming backwards as not the last of a step (microbatches with
gradient sync on): their end-of-backward callback still reduce-scatters what autograd never handed a
group and reshards, but leaves reductions in flight (the next backward's first post-backward, or the
last backward's end, waits for them) and waits on no side stream, so the last reduce-scatter of one
microbatch overlaps the next microbatch's forward. The sharded gradients are complete only after a
backward with ``set_is_last_backward(True)`` (the default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.autograd import Variable

from .comm import Comm
from .group import FSDPParamGroup
from .seams import HostSide
from .states import TrainingState
from .trace import Meters


class SharedComm:
    """One Comm, host engine and Meters for several roots (``share_comm_ctx``): the first root's lazy init sets them."""

    comm: Comm | None
    host: HostSide | None
    meters: Meters | None

    def __init__(self) -> None:
        self.comm = None
        self.host = None
        self.meters = None


class StateView(Protocol):
    """What the root's context and lazy init's checks read of each ``FSDPState`` (``hooks.py`` imports this
    module: no import back)."""

    group: FSDPParamGroup | None
    pending_forward: set[int]  # ids of the call's modules yet to finish forward in this pass
    schedule_overrides: dict[str, Any]

    def post_forward_group(self, output: Any) -> None: ...

    def end_pass(self) -> None: ...


class ScheduleDefaults(NamedTuple):
    """The root settings a device gets when the user sets none ([Note: prefetch])."""

    forward_prefetch_depth: int
    late_backward_prefetch: bool
    overlap_reduce_scatter: bool


def schedule_defaults(on_cuda: bool) -> ScheduleDefaults:
    """CPU has no kernel queue to run ahead with, so the next all-gather must be started explicitly
    (depth 1); CUDA side streams make a pipelined reduce-scatter a real overlap."""
    if on_cuda:
        return ScheduleDefaults(forward_prefetch_depth=0, late_backward_prefetch=False, overlap_reduce_scatter=True)
    return ScheduleDefaults(forward_prefetch_depth=1, late_backward_prefetch=True, overlap_reduce_scatter=False)


class RootContext:
    """State shared by every group under one root; owned by the root's FSDPState."""

    states: Sequence[StateView]  # root first, then the others in module order
    comm: Comm | None  # shared by every group; None when no group owns parameters
    host: HostSide | None  # the host engine, shared likewise ([Note: the host engine] in seams.py)
    meters: Meters | None  # the trace recorder and wire counts, shared likewise
    forward_order: list[FSDPParamGroup]  # groups in the order of the first forward
    order_recorded: bool
    final_callback_queued: bool
    forward_prefetch_depth: int  # groups all-gathered ahead in forward ([Note: prefetch])
    overlap_reduce_scatter: bool  # wait a reduce-scatter one group later (True) or at once ([Note: prefetch])
    late_backward_prefetch: bool  # prefetch in backward after the reduce-scatter (True) or at pre-backward
    pending_reduce_scatters: list[FSDPParamGroup]  # in flight, oldest first ([Note: prefetch])
    is_last_backward: bool  # False: the end of backward leaves reductions in flight ([Note: microbatching])
    post_optim_event: torch.Event | None  # CUDA: the next root pre-forward's all-gathers wait on it

    def __init__(
        self, states: Sequence[StateView], schedule_overrides: dict[str, Any], shared: SharedComm | None = None
    ) -> None:
        self.states = states
        groups = self.groups()
        self.comm = self.host = self.meters = None
        if groups:
            shared = shared or SharedComm()
            if shared.comm is None:
                shared.comm, shared.host, shared.meters = Comm(groups[0].mesh_info.device), groups[0].host, Meters()
                shared.host.measure_with(shared.meters)  # host steps traced by the root's recorder
            self.comm, self.host, self.meters = shared.comm, shared.host, shared.meters
        self.forward_order = []
        self.order_recorded = False
        self.final_callback_queued = False
        defaults = schedule_defaults(on_cuda=self.comm is not None and not self.comm.async_work)
        settings = defaults._replace(**schedule_overrides)  # the user's values over the device's defaults
        self.forward_prefetch_depth = settings.forward_prefetch_depth
        self.late_backward_prefetch = settings.late_backward_prefetch
        self.overlap_reduce_scatter = settings.overlap_reduce_scatter
        self.pending_reduce_scatters = []
        self.is_last_backward = True
        self.post_optim_event = None

    def groups(self) -> list[FSDPParamGroup]:
        return [state.group for state in self.states if state.group is not None]

    def schedule_settings(self) -> dict[str, Any]:
        """The settings in force and the device, for traces: what a reader needs to read the order."""
        device = self.comm.device.type if self.comm is not None else "none"
        return {key: getattr(self, key) for key in ScheduleDefaults._fields} | {"device": device}

    def finish_forward_pass(self, output: Any) -> None:
        """Root post-forward: the order is known now; complete the group passes some module of a list
        group never finished ([Note: group pass])."""
        self.order_recorded = True
        for state in reversed(self.states[1:]):  # innermost first, as their own post-forwards would run
            if state.pending_forward:  # modules of the pass that never finished forward
                state.end_pass()
                state.post_forward_group(output)

    # ---- the schedule ------------------------------------------------------------------------
    def prefetch_forward(self, group: FSDPParamGroup) -> None:
        """Start the all-gathers of the groups that run next in forward (after ``group`` is unsharded)."""
        targets = group.forward_prefetch
        if targets is None:
            targets = self._neighbours(group, self.forward_prefetch_depth, step=1)
        for target in targets:
            target.unshard()  # issue only: waited in its own pre-forward

    def prefetch_backward(self, group: FSDPParamGroup) -> None:
        """Start the all-gather of the group whose backward runs after ``group``'s (reverse forward order)."""
        targets = group.backward_prefetch
        if targets is None:
            targets = self._neighbours(group, 1, step=-1)
        for target in targets:
            if target.training_state is not TrainingState.POST_BACKWARD and target.controls.unshard_in_backward:
                if target.backward_follows:  # a group whose output needed no gradient has no backward
                    target.unshard()

    def _neighbours(self, group: FSDPParamGroup, depth: int, step: int) -> tuple[FSDPParamGroup, ...]:
        if not self.order_recorded or group not in self.forward_order or depth < 1:
            return ()
        index = self.forward_order.index(group)
        positions = (index + step * k for k in range(1, depth + 1))
        return tuple(self.forward_order[i] for i in positions if 0 <= i < len(self.forward_order))

    def finish_pending_reduce_scatter(self, keep: int = 0) -> None:
        """Before a group issues its reduce-scatter: finish the oldest still in flight (they overlapped
        backward compute) until ``keep`` remain, so at most ``keep + 1`` flat inputs are alive once the
        next is allocated ([Note: buffer lifetime]; ``keep`` is the issuing group's
        ``reduce_scatter_max_input_buffers - 1``). On CUDA the wait is the compute stream's."""
        while len(self.pending_reduce_scatters) > keep:
            self.pending_reduce_scatters.pop(0).finish_reduce_scatter()

    def track_reduce_scatter(self, group: FSDPParamGroup) -> None:
        """After ``group`` issued its reduce-scatter: keep it in flight until a later group's
        (``overlap_reduce_scatter``), or finish it at once."""
        if self.overlap_reduce_scatter:
            self.pending_reduce_scatters.append(group)
        else:
            group.finish_reduce_scatter()

    def queue_final_callback(self) -> None:
        if self.final_callback_queued:
            return
        self.final_callback_queued = True
        Variable._execution_engine.queue_callback(self.finalize_backward)

    def finalize_backward(self) -> None:
        """Runs once autograd has finished the whole backward pass."""
        # Reverse module order mirrors the backward; every rank walks the same list, so any
        # reduce-scatter issued here is issued in the same order on all ranks.
        if not self.is_last_backward:  # [Note: microbatching]
            for group in reversed(self.groups()):
                group.finish_backward_pass()
            self._end_backward_pass()
            return
        self.finish_pending_reduce_scatter()
        for group in reversed(self.groups()):
            group.finalize_backward()
        if self.comm is not None:
            self.comm.synchronize_side_streams()
        for group in self.groups():
            for storage in group.storages:
                storage.end_backward()  # CPU offload: the step's one host wait ([Note: host storage])
        self._end_backward_pass()

    def _end_backward_pass(self) -> None:
        for state in self.states:
            state.end_pass()  # a recompute stopped early never ran its post-forward
        self.final_callback_queued = False
        if self.host is not None:
            self.host.end_backward()  # return with every group stepped ([Note: the host engine], seams.py)

    def reset(self) -> None:
        """Recover from an exception mid-step (see ``FSDPParamGroup.reset``)."""
        backward_states = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
        in_backward = self.final_callback_queued or any(
            group.training_state in backward_states for group in self.groups()
        )
        if self.host is not None:
            self.host.abandon()  # no host step outlives the recovery
        for group in self.groups():
            group.reset(drop_unsharded_grads=in_backward)
        for state in self.states:
            state.end_pass()
        self.pending_reduce_scatters = []
        self.final_callback_queued = False
