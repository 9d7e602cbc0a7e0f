"""Per-call state: the hooks that drive a group through a step, and the root's lazy init.

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

from typing import Any

import torch
import torch.nn as nn

from ..policies import MixedPrecisionPolicy
from .checks import (
    check_materialized,
    check_no_tie_across_groups,
    check_one_mesh,
    check_overrides_matched,
    check_reduce_dtypes,
    check_root_settings,
)
from .containers import cast_floating, map_tensors, tensors_in
from .group import FSDPParamGroup
from .module_casts import OverridePatterns
from .root import RootContext, SharedComm
from .states import Role, TrainingState
from .trace import TraceRecorder


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
    role: Role  # ROOT or NESTED once the first forward decides (the root's lazy init)
    root_context: RootContext | None
    pending_forward: set[int]  # ids of this call's modules yet to finish forward in this pass
    in_forward_method: bool  # a registered forward method is running: its pass stays open until it returns
    schedule_overrides: dict[str, Any]  # as root: ScheduleDefaults fields the user set ([Note: prefetch])
    step_settings: dict[str, Any]  # RootContext fields set before lazy init (is_last_backward, post_optim_event)
    trace_recorder: TraceRecorder | None  # as root: handed to the shared Meters at lazy init
    wire_counts: dict[str, int] | None  # as root: fl.count_wire_bytes's record, handed to the Meters likewise
    shared_comm: SharedComm | None  # as root: a Comm and host engine shared with other roots (``share_comm_ctx``)
    override_patterns: OverridePatterns  # the call's mp_overrides patterns, checked at the root's lazy init

    @property
    def is_root(self) -> bool:
        """This call's state is its model's root (False before the first forward decides)."""
        return self.role is Role.ROOT

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: FSDPParamGroup | None,
        mp_policy: MixedPrecisionPolicy,
        override_patterns: OverridePatterns | None = None,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.override_patterns = override_patterns or OverridePatterns()
        self.role = Role.UNDECIDED
        self.root_context = None
        self.pending_forward = set()
        self.in_forward_method = False
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

    def in_pass(self) -> bool:
        """A forward pass of this call is open: modules of its group yet to finish, or a forward method running."""
        return bool(self.pending_forward) or self.in_forward_method

    def end_pass(self) -> None:
        """Close this call's forward pass bookkeeping (its post-forward ran, or never will this step)."""
        self.pending_forward.clear()
        self.in_forward_method = False

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
        root_class = type(root_module).__name__.removeprefix("FSDP")  # fully_shard made its class FSDP<Name>
        check_overrides_matched([state.override_patterns for state in states], root_class)
        for state in states:  # every check before any state changes: a failed first forward changes nothing
            if state.group is not None:
                check_materialized(state.group, names[id(state)])
                check_reduce_dtypes(state.group, names[id(state)])
        context = RootContext(states, self.schedule_overrides, self.shared_comm)
        if context.meters is not None:
            context.meters.recorder = self.trace_recorder
            context.meters.wire = self.wire_counts
        if self.trace_recorder is not None:
            self.trace_recorder.schedule = context.schedule_settings()
        for state in (*states[1:], self):  # the root's own settings win
            for name, value in state.step_settings.items():
                setattr(context, name, value)
            state.step_settings.clear()
        for state in states:
            state.role = Role.ROOT if state is self else Role.NESTED
            state.root_context = context
            if state.group is not None:
                state.init_group_for_root(state.group, names[id(state)], context)

    def init_group_for_root(self, group: FSDPParamGroup, name: str, context: RootContext) -> None:
        # not None: the root has groups
        group.join_root(name, context.comm, context.host, context.meters, self.is_root)  # type: ignore[arg-type]
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
        if self.in_pass():
            return args, kwargs  # a later module of this call's group: unsharded already ([Note: group pass])
        if self.role is Role.UNDECIDED:
            self.lazy_init()  # before any bookkeeping: if it raises, nothing has changed
        self.pending_forward.update(id(m) for m in self.modules)
        return self._pre_forward(args, kwargs)

    def _pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
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
        module run inside that one pass: ``in_forward_method`` keeps their post-forward hooks from
        closing it, so the parameters stay unsharded until the method returns."""
        opened, args, kwargs = self.begin_forward_method(module, args, kwargs)
        output = method(*args, **kwargs)
        return self.end_forward_method(output) if opened else output

    def begin_forward_method(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, tuple[Any, ...], dict[str, Any]]:
        """Open a forward-method pass (False: already inside one of this group, nothing to do)."""
        if self.in_pass() or (self.group is not None and self.group.training_state is TrainingState.PRE_BACKWARD):
            return False, args, kwargs
        pre = self._pre_forward_hook(module, args, kwargs)
        if pre is not None:
            args, kwargs = pre
        self.in_forward_method = True
        return True, args, kwargs

    def end_forward_method(self, output: Any) -> Any:
        """Close the pass ``begin_forward_method`` opened: cast the output, post-forward."""
        self.end_pass()
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
        if self.in_pass():
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
        # [Note: tensor containers]; none: nothing flows back through this pass, so its backward never runs
        tensors = [t for t in tensors_in(output) if t.requires_grad] if grad_enabled else []
        group.post_forward(grad_enabled, backward_follows=bool(tensors))
        if len(tensors) == 1:  # one output (a block's): its own hook fires once per backward, as "any" would
            tensors[0].register_hook(self._pre_backward)
        elif tensors:
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
            context.finish_pending_reduce_scatter(keep=group.controls.reduce_scatter_max_input_buffers - 1)
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
