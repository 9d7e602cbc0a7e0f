"""Per-call state: the hooks that drive a group through a step, lazy root init, the end-of-backward callback.

When each phase runs:
    pre-forward hook   -> (root: lazy init) -> group.pre_forward (unshard); a _PostBackward node is put
                          on the inputs so that its backward tells us when the group's grads are done
    post-forward hook  -> group.post_forward (reshard unless kept); a hook on the outputs' grads
    output grad ready  -> pre-backward: queue the root's end-of-backward callback once, unshard
    inputs' grad ready -> post-backward: reshard, reduce-scatter
    end of backward    -> RootContext.finalize_backward: post-backward for groups autograd skipped,
                          wait for every reduction, reshard, go idle

[Note: recompute]
Activation checkpointing (use_reentrant=False) re-runs a module's forward inside backward, after the
group's pre-backward hook has unsharded it (the hook fires on the output grad, before the nodes that
need the saved tensors). The forward hooks then do nothing: the group is already unsharded and must
stay so for its backward. The recompute may also stop early, skipping post-forward hooks, so the
end-of-backward callback clears the per-forward bookkeeping.

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

[Note: compile]
The forward hooks are wrapped in ``torch.compiler.disable``. A block compiled with ``block.compile()`` (or
``torch.compile``) then becomes one graph of its forward alone: Dynamo does not trace
``Module._call_impl``, and a hook that is itself disabled is skipped as a frame, with no graph break;
the hooks run eagerly around the compiled forward, which sees the unsharded parameters as ordinary
inputs (the same Parameter objects every step, so nothing recompiles). Traced instead, the hooks would
break the graph at every collective and recompile per block.

[Note: group pass]
A call on a list of modules makes one group, used in one pass: the first of its modules to start
forward unshards it and routes that module's inputs through _PostBackward; the group's post-forward
runs when every module of the list has finished forward (so modules called one after another share
one all-gather). A module of the list that never runs in the root's forward (torchtitan's
``[norm, output]`` with a chunked loss that calls ``output`` afterwards, or a module skipped this step)
would hold the pass open: the root's post-forward completes it, as the group's own post-forward would
(reshard per ``reshard_after_forward``, pre-backward hooked on the root's output). A later standalone
call of the other module (``model.output(chunk)``) opens a new pass, unsharding again if needed; it
stays open (the group unsharded) until the end of backward, and its gradients join the group's one
reduce-scatter when the group's backward ends.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..policies import MixedPrecisionPolicy
from .checks import (
    check_materialized,
    check_no_tie_across_groups,
    check_one_mesh,
    check_reduce_dtypes,
    check_root_settings,
)
from .comm import Comm, SharedComm
from .containers import cast_floating, map_tensors, tensors_in
from .group import FSDPParamGroup
from .states import TrainingState
from .trace import TraceRecorder

_FORWARD_METHOD = -1  # in pending_forward while a registered forward method runs (never a module id)


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

    states: list[FSDPState]  # root first, then the others in module order
    comm: Comm | None  # shared by every group; None when no group owns parameters
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
        self, states: list[FSDPState], schedule_overrides: dict[str, Any], shared: SharedComm | None = None
    ) -> None:
        self.states = states
        groups = self.groups()
        self.comm = None
        if groups:
            if shared is not None and shared.comm is None:
                shared.comm = Comm(groups[0].mesh_info.device)
            self.comm = shared.comm if shared is not None else Comm(groups[0].mesh_info.device)
        for group in groups:
            group.comm = self.comm  # type: ignore[assignment]
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
            if state.pending_forward - {_FORWARD_METHOD}:
                state.pending_forward.clear()
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
            if target.training_state is not TrainingState.POST_BACKWARD and target.unshard_in_backward:
                target.unshard()

    def _neighbours(self, group: FSDPParamGroup, depth: int, step: int) -> list[FSDPParamGroup]:
        if not self.order_recorded or group not in self.forward_order or depth < 1:
            return []
        index = self.forward_order.index(group)
        positions = (index + step * k for k in range(1, depth + 1))
        return [self.forward_order[i] for i in positions if 0 <= i < len(self.forward_order)]

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
            if group.offload_event is not None:
                # The one host wait of a step, CPU offload only: optimizer.step() reads the host grads.
                group.offload_event.synchronize()
                group.offload_event = None
        self._end_backward_pass()

    def _end_backward_pass(self) -> None:
        for state in self.states:
            state.pending_forward.clear()  # a recompute stopped early never ran its post-forward
        self.final_callback_queued = False
        if self.comm is not None:
            self.comm.host_steps.wait()  # return with every group stepped: [Note: host steps off backward's thread]

    def reset(self) -> None:
        """Recover from an exception mid-step (see ``FSDPParamGroup.reset``)."""
        backward_states = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
        in_backward = self.final_callback_queued or any(
            group.training_state in backward_states for group in self.groups()
        )
        if self.comm is not None:
            self.comm.host_steps.wait_quietly()  # no host step outlives the recovery
        for group in self.groups():
            group.reset(drop_unsharded_grads=in_backward)
        for state in self.states:
            state.pending_forward.clear()
        self.pending_reduce_scatters = []
        self.final_callback_queued = False


class _PostBackward(torch.autograd.Function):
    """Identity on a group's forward inputs; its backward runs once the group's grads are done."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


class FSDPState:
    """What one fully_shard call adds to its module(s): a group (if it owns parameters) and hooks."""

    modules: tuple[nn.Module, ...]
    group: FSDPParamGroup | None
    mp_policy: MixedPrecisionPolicy  # for casting forward inputs and outputs
    is_root: bool | None  # None until the first forward decides
    root_context: RootContext | None
    pending_forward: set[int]  # ids of this call's modules yet to finish forward in this pass
    schedule_overrides: dict[str, Any]  # as root: ScheduleDefaults fields the user set ([Note: prefetch])
    step_settings: dict[str, Any]  # RootContext fields set before lazy init (is_last_backward, post_optim_event)
    trace_recorder: TraceRecorder | None  # as root: handed to the shared Comm at lazy init
    wire_counts: dict[str, int] | None  # as root: fl.count_wire_bytes's record, handed to the Comm likewise
    shared_comm: SharedComm | None  # as root: a Comm shared with other roots (``share_comm_ctx``)

    def __init__(
        self, modules: tuple[nn.Module, ...], group: FSDPParamGroup | None, mp_policy: MixedPrecisionPolicy
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.is_root = None
        self.root_context = None
        self.pending_forward = set()
        self.schedule_overrides = {}
        self.step_settings = {}
        self.trace_recorder = None
        self.wire_counts = None
        self.shared_comm = None
        for module in modules:
            module.register_forward_pre_hook(_eager(self._pre_forward_hook), prepend=True, with_kwargs=True)
            module.register_forward_hook(_eager(self._post_forward_hook), prepend=False)
            module.register_state_dict_pre_hook(self._reshard_for_state_dict)
            module.register_load_state_dict_pre_hook(self._reshard_for_state_dict)

    def _reshard_for_state_dict(self, *_: Any) -> None:
        """state_dict()/load_state_dict() act on the shards: between steps (e.g. the root kept unsharded
        after a forward), reshard first so neither reads nor writes a soon-discarded unsharded copy."""
        if self.group is not None and self.group.training_state is TrainingState.IDLE:
            self.group.reshard()  # a backward still to come unshards again in its pre-backward

    # ---- lazy init --------------------------------------------------------------------------
    def lazy_init(self) -> None:
        """Make this state the root of every fully_shard state below its module."""
        root_module = self.modules[0]
        states: list[FSDPState] = [self]
        names: dict[int, str] = {}
        for name, module in root_module.named_modules():
            state = getattr(module, "_fsdp_state", None)
            if state is None:
                continue
            names.setdefault(id(state), name)
            if state is not self and state not in states:
                states.append(state)
        check_one_mesh(states, names)
        check_root_settings(states, names)
        check_no_tie_across_groups(states, names)
        for state in states:  # every check before any state changes: a failed first forward changes nothing
            if state.group is not None:
                check_materialized(state.group, names[id(state)])
                check_reduce_dtypes(state.group, names[id(state)])
        context = RootContext(states, self.schedule_overrides, self.shared_comm)
        if context.comm is not None:
            context.comm.recorder = self.trace_recorder
            context.comm.wire = self.wire_counts
        if self.trace_recorder is not None:
            self.trace_recorder.schedule = context.schedule_settings()
        for state in (*states[1:], self):  # the root's own settings win
            for name, value in state.step_settings.items():
                setattr(context, name, value)
            state.step_settings.clear()
        for state in states:
            state.is_root = state is self
            state.root_context = context
            if state.group is not None:
                state.group.name = names[id(state)]
                state.init_group_for_root(state.group)

    def init_group_for_root(self, group: FSDPParamGroup) -> None:
        if group.reshard_after_forward_requested is None:
            # the root keeps its parameters (backward starts with it), every other group frees them
            group.reshard_after_forward = not self.is_root
        group.reset_sharded_params()

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self.group is not None and self.group.training_state is TrainingState.PRE_BACKWARD:
            return None  # activation-checkpoint recompute: see [Note: recompute]
        policy = self.mp_policy  # every module of the group casts its own inputs
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        if self.pending_forward:
            return args, kwargs  # a later module of this call's group: unsharded already ([Note: group pass])
        if self.is_root is None:
            self.lazy_init()  # before any bookkeeping: if it raises, nothing has changed
        self.pending_forward.update(id(m) for m in self.modules)
        return self._pre_forward(args, kwargs)

    def _pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.is_root is None:
            self.lazy_init()
        group = self.group
        if group is None:
            return args, kwargs
        context = self.root_context
        if context is not None and not context.order_recorded and group not in context.forward_order:
            context.forward_order.append(group)
        event = context.post_optim_event if context is not None and self.is_root else None
        if event is not None and group.comm.streams is not None:
            group.comm.wait_instead = event  # the user's event stands for the optimizer step
        try:
            group.pre_forward()
            if context is not None:
                context.prefetch_forward(group)  # after this group's copy-out freed its buffer
        finally:
            if event is not None and context is not None:
                group.comm.wait_instead = context.post_optim_event = None  # one step only, like torch's
        group.trace("forward")
        if torch.is_grad_enabled():
            return _attach_post_backward(self, args, kwargs)
        return args, kwargs

    def run_forward_method(self, module: nn.Module, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A method registered with ``register_fsdp_forward_method`` (e.g. ``generate``), run between
        the group's pre- and post-forward work like ``forward`` is. Forwards it calls on the same
        module run inside that one pass: a marker in ``pending_forward`` keeps their post-forward
        hooks from closing it, so the parameters stay unsharded until the method returns."""
        opened, args, kwargs = self.begin_forward_method(module, args, kwargs)
        output = method(*args, **kwargs)
        return self.end_forward_method(output) if opened else output

    def begin_forward_method(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, tuple[Any, ...], dict[str, Any]]:
        """Open a forward-method pass (False: already inside one of this group, nothing to do)."""
        if self.pending_forward or (self.group is not None and self.group.training_state is TrainingState.PRE_BACKWARD):
            return False, args, kwargs
        pre = self._pre_forward_hook(module, args, kwargs)
        if pre is not None:
            args, kwargs = pre
        self.pending_forward.add(_FORWARD_METHOD)
        return True, args, kwargs

    def end_forward_method(self, output: Any) -> Any:
        """Close the pass ``begin_forward_method`` opened: cast the output, post-forward."""
        self.pending_forward.clear()
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        return self._post_forward(output)

    def _post_forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.group is not None and self.group.training_state is TrainingState.PRE_BACKWARD:
            return None  # activation-checkpoint recompute: see [Note: recompute]
        if self.mp_policy.output_dtype is not None:  # every module of the group casts its own output
            output = cast_floating(output, self.mp_policy.output_dtype)
        if id(module) not in self.pending_forward:
            return output
        self.pending_forward.discard(id(module))
        if self.pending_forward:
            return output
        return self._post_forward(output)

    def _post_forward(self, output: Any) -> Any:
        if self.is_root and self.root_context is not None:
            self.root_context.finish_forward_pass(output)
        self.post_forward_group(output)
        return output

    def post_forward_group(self, output: Any) -> None:
        """The group's post-forward: reshard (per ``reshard_after_forward``) and hook its pre-backward on
        the gradient of ``output`` (this pass's output; for a pass completed by the root, the root's)."""
        group = self.group
        if group is None:
            return
        grad_enabled = torch.is_grad_enabled()
        group.post_forward(grad_enabled)
        if grad_enabled:
            tensors = [t for t in tensors_in(output) if t.requires_grad]  # [Note: tensor containers]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")

    # ---- backward ---------------------------------------------------------------------------
    def _pre_backward(self, _grad: torch.Tensor) -> None:
        if self.root_context is not None:
            self.root_context.queue_final_callback()
        if self.group is not None:
            self.group.pre_backward()
            if self.root_context is not None and not self.root_context.late_backward_prefetch:
                self.root_context.prefetch_backward(self.group)  # overlaps this group's backward
            self.group.trace("backward")

    def post_backward(self) -> None:
        """The group's gradients are all computed: reshard, reduce-scatter, pipeline the previous one."""
        group = self.group
        if group is None or not group.needs_post_backward:
            return
        context = self.root_context
        if context is not None:
            context.finish_pending_reduce_scatter(keep=group.reduce_scatter_max_input_buffers - 1)
        group.post_backward()
        if context is not None:
            if context.late_backward_prefetch:
                context.prefetch_backward(group)  # overlaps this group's reduce-scatter: [Note: prefetch]
            context.track_reduce_scatter(group)


def _eager(hook: Any) -> Any:
    """``hook`` as a function torch.compile never traces: [Note: compile]."""
    return torch.compiler.disable(hook, recursive=True)


def _attach_post_backward(
    state: FSDPState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Route the inputs that need grad through ``_PostBackward`` (others need no node)."""
    tensors = [t for t in tensors_in((args, kwargs)) if t.requires_grad]  # [Note: tensor containers]
    if not tensors:
        return args, kwargs  # the end-of-backward callback does this group's post-backward
    routed = iter(_PostBackward.apply(state, *tensors))
    return map_tensors(lambda t: next(routed) if t.requires_grad else t, (args, kwargs))
