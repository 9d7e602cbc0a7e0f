"""``FSDPModule``: what a module becomes under ``fully_shard`` (its class is swapped in place to a
subclass), with the controls users call (``unshard``, ``reshard``, ``set_*``), ``UnshardHandle`` and
``register_fsdp_forward_method``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule  # public: to be recognised as FSDP2

from ._runtime.group import FSDPParamGroup
from ._runtime.hooks import FSDPState
from ._runtime.post_forward import check_post_forward, is_rank_count
from ._runtime.root import SharedComm
from ._runtime.states import Role

# [Note: torch's FSDPModule]
# fsdp2lite's FSDPModule subclasses torch's public FSDPModule class, so ``isinstance(m,
# torch.distributed.fsdp.FSDPModule)`` holds and tools take fsdp2lite modules for FSDP2 ones (Accelerate
# leaves a sharded model alone, transformers and Lightning drive it through the public methods). Every
# method torch's class defines is overridden here; the two torch-private ones torch's own functions call
# are answered too: ``_get_fsdp_state()`` returns a view with ``_pre_forward``/``_post_forward`` (torch's
# ``register_fsdp_forward_method`` wraps methods with them), and ``_set_unshard_async_op`` refuses
# clearly. Code that reaches deeper into torch's private state (``FSDPMemTracker``, the pipelining
# schedules' manual post-backward through torch's ``fully_shard.state``) does not work on fsdp2lite
# modules: README, "Differences from torch's fully_shard".


class _ForwardHooksView:
    """The two methods of torch's private FSDP state that torch's ``register_fsdp_forward_method`` calls."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state
        self._opened: list[bool] = []  # per nested call: whether it opened a pass

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        opened, args, kwargs = self._state.begin_forward_method(module, args, kwargs)
        self._opened.append(opened)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        opened = self._opened.pop() if self._opened else False
        return self._state.end_forward_method(output) if opened else output


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule(_TorchFSDPModule):
    """Mixin swapped into a module's class by ``fully_shard``; its methods steer the runtime.

    A subclass of torch's ``FSDPModule`` so that tools recognise fsdp2lite modules as FSDP2 ones
    (Accelerate adopts a sharded model, Lightning and transformers check it); every method is ours,
    none of torch's FSDP code runs ([Note: torch's FSDPModule])."""

    _fsdp_state: FSDPState
    _orig_cls_mro_index = 3  # FSDP<Name>, FSDPModule (ours), FSDPModule (torch's), <Name>

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A new instance made from an FSDP class (``nn.Sequential`` slicing calls ``self.__class__(...)``)
        is of the original class, unsharded, as torch's: the state belongs to the sharded instance only."""
        original = cls.__mro__[cls._orig_cls_mro_index]
        instance = original.__new__(original)
        instance.__init__(*args, **kwargs)
        return instance

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refused, as torch's refuses it: the shards are bound to process groups."""
        raise NotImplementedError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported (FSDP does not support deepcopy): "
            "copy the model before fully_shard, or move state with state_dict()/load_state_dict()"
        )

    def _get_fsdp_state(self) -> _ForwardHooksView:
        """What torch's own ``register_fsdp_forward_method`` calls (``_pre_forward``/``_post_forward``):
        a view onto fsdp2lite's state. torch's private state (its param groups) does not exist here."""
        return _ForwardHooksView(self._fsdp_state)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch-private: fsdp2lite's prefetch issues all-gathers ahead."""
        raise NotImplementedError(
            "_set_unshard_async_op is torch-private FSDP2 state with no fsdp2lite equivalent; forward prefetch "
            "(set_forward_prefetch_depth on the root) issues all-gathers ahead instead"
        )

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's group now (e.g. ahead of use); ``async_op`` returns a handle."""
        group = self._fsdp_state.group
        if group is not None:
            group.reset_sharded_params()
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters (ZeRO-1/2's kept ones too); the DTensor parameters are
        registered again."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard(free=True)  # a resident (ZeRO-1/2) group's storage too

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn the gradient reduce-scatter off (grads accumulate unsharded) or back on."""
        check_bool("requires_gradient_sync", requires_gradient_sync)
        self._set_controls(recurse, requires_gradient_sync=requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        """Free (True), keep (False) or shrink to k-rank shards (int k) the unsharded parameters
        between forward and backward. An int creates process groups: call it on every rank."""
        check_reshard_after_forward(reshard_after_forward, allow_none=False)
        groups = list(self._groups(recurse))
        for group in groups if is_rank_count(reshard_after_forward) else ():  # every group checked before any changes
            check_post_forward(reshard_after_forward, group.mesh_info.shard_size, group.params)
        for group in groups:
            group.set_reshard_after_forward(reshard_after_forward)  # checked above, once

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: skip (False) the all-reduce across replicas; reduce-scattered sums are kept and added
        into the next all-reduce, so accumulating microbatches this way loses nothing."""
        check_bool("requires_all_reduce", requires_all_reduce)
        for group in self._groups(recurse):
            group.forms.set_requires_all_reduce(requires_all_reduce)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters after backward (False), e.g. across accumulation steps.

        With False the parameters stay unsharded until ``reshard()`` or a backward with True, so
        reshard before ``optimizer.step()``: the step updates the shards, not the unsharded copies.
        """
        check_bool("reshard_after_backward", reshard_after_backward)
        self._set_controls(recurse, reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups as soon as this module's group is unsharded in forward
        (replaces the recorded-order prefetch for this module)."""
        group = self._own_group("set_modules_to_forward_prefetch")
        group.set_prefetch(_prefetch_groups(modules), group.backward_prefetch)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups as soon as this module's group is unsharded in backward
        (replaces the reverse-order prefetch for this module)."""
        group = self._own_group("set_modules_to_backward_prefetch")
        group.set_prefetch(group.forward_prefetch, _prefetch_groups(modules))

    def set_forward_prefetch_depth(self, depth: int) -> None:
        """On the root: how many groups forward all-gathers ahead in the recorded order (default 1 on
        CPU, 0 on CUDA; see docs/design.md)."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"forward prefetch depth must be an int >= 0, got {depth!r}")
        self._set_root_setting("forward_prefetch_depth", depth)

    def set_overlap_reduce_scatter(self, overlap: bool) -> None:
        """On the root: wait each reduce-scatter one group later, overlapping the next group's backward
        (True; default on CUDA), or right after issuing it, saving a block's worth of memory (False;
        default on CPU). See docs/design.md."""
        check_bool("overlap", overlap)
        self._set_root_setting("overlap_reduce_scatter", overlap)

    def set_late_backward_prefetch(self, late: bool) -> None:
        """On the root: in backward, all-gather the next group once this group's reduce-scatter is
        issued (True; default on CPU: one block-sized buffer less at the peak) or at this group's
        pre-backward, overlapping its backward compute (False; default on CUDA). See docs/design.md."""
        check_bool("late", late)
        self._set_root_setting("late_backward_prefetch", late)

    def _set_root_setting(self, name: str, value: object) -> None:
        """Store a root setting on this state (read at lazy init) and on its live context, if any."""
        state = self._fsdp_state
        if state.role is Role.NESTED:
            raise ValueError(f"set_{name} is a root setting; {type(self).__name__} is not the root")
        state.schedule_overrides[name] = value
        if state.root_context is not None:
            setattr(state.root_context, name, value)

    def _set_step_setting(self, name: str, value: object) -> None:
        """A RootContext field any module may set (as torch's shared state context): on the live context,
        or, before lazy init, kept on this state for lazy init to hand to the root's context."""
        state = self._fsdp_state
        if state.root_context is not None:
            setattr(state.root_context, name, value)
        else:
            state.step_settings[name] = value

    def _set_controls(self, recurse: bool, **changes: Any) -> None:
        """Set per-step switches (checked by the caller) on this module's group, and its descendants' when
        ``recurse`` (``GroupControls``, the group's one record of them)."""
        for group in self._groups(recurse):
            group.set_controls(dataclasses.replace(group.controls, **changes))

    def _own_group(self, method: str) -> FSDPParamGroup:
        group = self._fsdp_state.group
        if group is None:
            raise ValueError(f"{method}: {type(self).__name__} owns no parameters, so it has no group to prefetch from")
        return group

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the coming backward is the last of this step (default True). Microbatching with
        gradient sync on: set False before all but the last microbatch's backward; their end of
        backward leaves reductions in flight (overlapping the next microbatch's forward) instead of
        waiting for them. The sharded gradients are complete after a backward with True. Applies to the
        whole model under the root (lazy init decides the root; before it, set it on the root)."""
        check_bool("is_last_backward", is_last_backward)
        self._set_step_setting("is_last_backward", is_last_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: never all-gather this module's group in backward (nor prefetch it), for a group whose
        backward needs no parameter values (an embedding: its weight gradient needs only the indices).
        Its gradients are still reduced. Wrong for a group that does need them (e.g. a Linear)."""
        check_bool("unshard_in_backward", unshard_in_backward)
        self._set_controls(False, unshard_in_backward=unshard_in_backward)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Call ``hook(reduced)`` once per backward on this module's group's reduced gradient: the
        flat reduce-scatter output (HSDP: the all-reduce output) as it will be stored, averaged over the
        data-parallel ranks (as torch's); it may change it in place (e.g. a custom replica all-reduce). ``stream``
        (CUDA, not with HSDP): run the hook there instead of on the compute stream."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook takes a callable hook(tensor) -> None, got {type(hook).__name__}")
        group = self._own_group("set_all_reduce_hook")
        if stream is not None:
            if not isinstance(stream, torch.cuda.Stream):
                raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
            if group.mesh_info.device.type != "cuda":
                raise ValueError(
                    "set_all_reduce_hook(stream=...) needs a CUDA mesh; this group is on a "
                    f"'{group.mesh_info.device.type}' mesh: pass no stream"
                )
            if group.mesh_info.replicate_group is not None:
                raise ValueError(
                    "set_all_reduce_hook(stream=...) cannot be set with HSDP: the hook runs after the replica "
                    "all-reduce, on its stream"
                )
        group.set_controls(dataclasses.replace(group.controls, all_reduce_hook=hook, all_reduce_hook_stream=stream))

    def set_post_optim_event(self, event: torch.Event) -> None:
        """CUDA: the next root pre-forward's all-gathers wait on ``event`` (recorded after
        ``optimizer.step()``) instead of on everything queued on the compute stream, so unrelated work
        queued after the step does not delay them. Used once, then dropped: set a new event each step."""
        if not isinstance(event, torch.Event | torch.cuda.Event):
            raise TypeError(
                f"set_post_optim_event takes a torch.Event (or torch.cuda.Event), got {type(event).__name__}"
            )
        group = self._own_group("set_post_optim_event")
        if group.mesh_info.device.type != "cuda":
            raise ValueError(
                f"set_post_optim_event orders CUDA streams; this model is on a '{group.mesh_info.device.type}' mesh, "
                "where collectives already follow the optimizer step in program order: drop the call"
            )
        self._set_step_setting("post_optim_event", event)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce zeros for parameters of a group that got no gradient in a backward, so ranks that used
        different parameters of one group (experts of a mixture-of-experts layer, conditional branches)
        lay out the same reduce-scatter and their gradients average as with DDP's
        ``find_unused_parameters``. Default False: a parameter without a gradient is left out, which
        is only right when every rank leaves out the same ones. The group itself must run forward and
        backward on every rank: its reduce-scatter is issued when its backward ends, in the same order
        everywhere."""
        check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        self._set_controls(recurse, reduce_scatter_unused_params=reduce_scatter_unused_params)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the shard group size (the average)."""
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise TypeError(f"gradient divide factor must be a number, got {factor!r} ({type(factor).__name__})")
        if not 0 < factor < math.inf:
            raise ValueError(f"gradient divide factor must be a positive, finite number, got {factor!r}")
        self._set_controls(False, gradient_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's earlier name for ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted, and always in effect: fsdp2lite reduces with SUM only and divides afterwards."""
        check_bool("enable", enable)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatter input buffers may be alive at once when reduce-scatters overlap backward
        compute (``set_overlap_reduce_scatter``; on by default on CUDA): before a group allocates its input,
        the oldest reduce-scatters in flight are finished until fewer than this many remain. 1 (default)
        finishes the previous one first; more buffers trade memory (a block's gradients each) for fewer
        waits when communication is slower than the compute that hides it."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be an int >= 1, got {max_input_buffers}")
        self._set_controls(recurse, reduce_scatter_max_input_buffers=max_input_buffers)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this module's all-gather through ``comm``, torch's ``AllGather`` protocol:
        ``comm.allocate(size, dtype=, device=)`` makes the output buffer and
        ``comm(output_tensor=, input_tensor=, group=, async_op=)`` gathers (returns a Work or None)."""
        _check_custom_comm("set_custom_all_gather", comm)
        self._own_group("set_custom_all_gather").forms.set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this module's reduce-scatter through ``comm``, torch's ``ReduceScatter`` protocol:
        ``comm.allocate(size, dtype=, device=)`` makes the input and output buffers and
        ``comm(output_tensor=, input_tensor=, group=, op=, async_op=)`` reduces (op is always SUM)."""
        _check_custom_comm("set_custom_reduce_scatter", comm)
        self._own_group("set_custom_reduce_scatter").forms.set_custom_reduce_scatter(comm)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own over the same ranks (True), so it can progress while
        an all-gather runs on the shard group, or back on the shard group (False). Collective: call it on
        every rank of the mesh."""
        check_bool("enable", enable)
        created: dict[tuple[int, ...], Any] = {}
        for group in self._groups(recurse):
            group.forms.set_separate_reduce_scatter_group(enable, created)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """torch: buffers from the process group's allocator (NCCL). False is accepted; True raises."""
        check_bool("enable", enable)
        if enable:
            raise NotImplementedError(_unsupported_comm_memory("set_allocate_memory_from_process_group_for_comm", self))

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """torch: allocate communication buffers in symmetric memory (NCCL). Not in fsdp2lite: raises,
        naming what the mesh is (see the README's differences from torch's fully_shard)."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: backend must be 'NCCL', got {backend!r}")
        raise NotImplementedError(_unsupported_comm_memory("set_symm_mem_for_comm", self))

    def reset_iter_state(self) -> None:
        """Recover after an exception mid-step: finish in-flight work, reshard, clear step state.

        Call it on the root. After an exception in backward the partial unsharded gradients are
        dropped (zero the sharded ones with the optimizer and redo the step); after one in
        forward, gradients accumulated with sync off are kept.
        """
        context = self._fsdp_state.root_context
        if context is None:
            return  # never ran forward: nothing to reset
        context.reset()

    def _groups(self, recurse: bool) -> Iterator[FSDPParamGroup]:
        modules: Iterable[nn.Module] = self.modules() if recurse else (self,)  # type: ignore[attr-defined,assignment]
        seen: set[int] = set()
        for module in modules:
            state = getattr(module, "_fsdp_state", None)
            if state is None or state.group is None or id(state) in seen:
                continue
            seen.add(id(state))
            yield state.group

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: keys and shapes are checked against the model
        first, so a state dict that does not fit raises (RuntimeError, as torch's) before any value is
        copied, naming every offending key."""
        _check_state_dict_fits(self, state_dict, strict)  # type: ignore[arg-type]
        return super(_TorchFSDPModule, self).load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]  # past torch's class

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """After ``to``/``to_empty``/``cuda``, point the DTensors back at padded shards."""
        result = super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]  # past torch's class
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reset_sharded_params()
        return result


def _check_custom_comm(method: str, comm: Any) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} takes an object with allocate(size, *, dtype, device) and __call__ (torch's "
            f"torch.distributed.fsdp AllGather/ReduceScatter protocol), got {type(comm).__name__}"
        )


def _unsupported_comm_memory(method: str, module: Any) -> str:
    groups = list(module._groups(recurse=False))
    device = groups[0].mesh_info.device.type if groups else "unknown"
    return (
        f"{method}: fsdp2lite allocates communication buffers with the device's own allocator; process-group "
        f"and symmetric-memory allocation (CUDA/NCCL only) are not implemented. This module's mesh is '{device}'"
    )


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (e.g. pipeline stages' model chunks) share one communication context: on CUDA
    the same side streams (no memory fragmented across stream pools), one host engine (gradient pool, host-step
    worker), the trace recorder of the first. Call it before their first forward."""
    if not isinstance(modules, list | tuple):
        raise TypeError(f"share_comm_ctx takes a list of FSDPModules, got {type(modules).__name__}")
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx takes FSDPModules (fully_shard applied), got {type(module).__name__}")
    shared = SharedComm()
    for module in modules:
        module._fsdp_state.shared_comm = shared


def _check_state_dict_fits(module: nn.Module, state_dict: Any, strict: bool) -> None:
    """What ``load_state_dict`` would reject, found before it copies anything: missing and unexpected
    keys (``strict``) and shape mismatches (global shapes: a DTensor or a full tensor fits)."""
    from collections.abc import Mapping

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict expects a mapping of names to tensors, got {type(state_dict).__name__}")
    expected: dict[str, torch.Size | None] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in sub._parameters.items():
            if param is not None:
                expected[dot + name] = param.shape
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                expected[dot + name] = buffer.shape
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            expected[dot + "_extra_state"] = None
    problems = []
    if strict:
        missing = [key for key in expected if key not in state_dict]
        unexpected = [key for key in state_dict if key not in expected]
        if missing:
            problems.append(f"Missing key(s) in state_dict: {', '.join(missing)}")
        if unexpected:
            problems.append(f"Unexpected key(s) in state_dict: {', '.join(unexpected)}")
    for key, shape in expected.items():
        value = state_dict.get(key)
        if shape is not None and isinstance(value, torch.Tensor) and value.shape != shape:
            problems.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                f"the shape in current model is {tuple(shape)}"
            )
    if problems:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__} (nothing was loaded):\n\t"
            + "\n\t".join(problems)
        )


def _prefetch_groups(modules: Any) -> tuple[FSDPParamGroup, ...]:
    if not isinstance(modules, list | tuple):
        raise TypeError(f"expected a list of FSDPModules, got {type(modules).__name__}")
    groups = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"prefetch targets must be modules fully_shard was applied to, got {type(module).__name__}")
        if module._fsdp_state.group is None:
            raise ValueError(f"{type(module).__name__} owns no parameters: nothing to prefetch")
        groups.append(module._fsdp_state.group)
    return tuple(groups)


def check_bool(name: str, value: Any) -> None:
    """A user-facing flag must be a real bool (not 0/1 or a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_reshard_after_forward(value: Any, allow_none: bool = True) -> None:
    """True, False, an int k, or (where the root decides) None."""
    if (value is None and allow_none) or isinstance(value, bool | int):
        return
    raise TypeError(
        "reshard_after_forward must be True, False, an int k (reshard to groups of k ranks)"
        f"{' or None (root False, others True)' if allow_none else ''}, got {value!r} ({type(value).__name__})"
    )
