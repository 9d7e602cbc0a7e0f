"""``fully_shard`` and ``FSDPModule``: the public face of the runtime.

``fully_shard(module)`` takes the parameters of ``module`` that no nested ``fully_shard`` call owns,
shards each on dim 0 as a DTensor, makes them one communication group, registers the hooks and swaps
the module's class to a subclass of ``FSDPModule`` in place. Call it bottom-up: blocks first, root last.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._runtime.group import FSDPParamGroup, check_post_forward_dims, check_post_forward_size
from ._runtime.param import FSDPParam, ParamPlace, ParamPolicy
from ._runtime.state import FSDPState
from ._snapshot import ModuleSnapshot, all_modules
from .mesh import MeshInfo, backend_device_type, check_tp_mesh, default_mesh, mesh_info_for
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, cast_dtype

M = TypeVar("M", nn.Module, list[nn.Module])


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin swapped into a module's class by ``fully_shard``; its methods steer the runtime."""

    _fsdp_state: FSDPState

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
        """Free this module's unsharded parameters; the DTensor parameters are registered again."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn the gradient reduce-scatter off (grads accumulate unsharded) or back on."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        """Free (True), keep (False) or shrink to k-rank shards (int k) the unsharded parameters
        between forward and backward. An int creates process groups: call it on every rank."""
        _check_reshard_after_forward(reshard_after_forward, allow_none=False)
        groups = list(self._groups(recurse))
        for group in groups:  # every group checked before any changes
            group.check_reshard_after_forward(reshard_after_forward)
        for group in groups:
            group.set_reshard_after_forward(reshard_after_forward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: skip (False) the all-reduce across replicas; reduce-scattered sums are kept and added
        into the next all-reduce, so accumulating microbatches this way loses nothing."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters after backward (False), e.g. across accumulation steps.

        With False the parameters stay unsharded until ``reshard()`` or a backward with True, so
        reshard before ``optimizer.step()``: the step updates the shards, not the unsharded copies.
        """
        _check_bool("reshard_after_backward", reshard_after_backward)
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups as soon as this module's group is unsharded in forward
        (replaces the recorded-order prefetch for this module)."""
        self._own_group("set_modules_to_forward_prefetch").forward_prefetch = _prefetch_groups(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups as soon as this module's group is unsharded in backward
        (replaces the reverse-order prefetch for this module)."""
        self._own_group("set_modules_to_backward_prefetch").backward_prefetch = _prefetch_groups(modules)

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
        _check_bool("overlap", overlap)
        self._set_root_setting("overlap_reduce_scatter", overlap)

    def set_late_backward_prefetch(self, late: bool) -> None:
        """On the root: in backward, all-gather the next group once this group's reduce-scatter is
        issued (True; default on CPU: one block-sized buffer less at the peak) or at this group's
        pre-backward, overlapping its backward compute (False; default on CUDA). See docs/design.md."""
        _check_bool("late", late)
        self._set_root_setting("late_backward_prefetch", late)

    def _set_root_setting(self, name: str, value: object) -> None:
        """Store a root setting on this state (read at lazy init) and on its live context, if any."""
        state = self._fsdp_state
        if state.is_root is False:
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
        _check_bool("is_last_backward", is_last_backward)
        self._set_step_setting("is_last_backward", is_last_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: never all-gather this module's group in backward (nor prefetch it), for a group whose
        backward needs no parameter values (an embedding: its weight gradient needs only the indices).
        Its gradients are still reduced. Wrong for a group that does need them (e.g. a Linear)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Call ``hook(reduced)`` once per backward on this module's group's reduced gradient: the
        flat reduce-scatter output (HSDP: the all-reduce output), summed over the data-parallel ranks
        and not yet divided; it may change it in place (e.g. a custom replica all-reduce). ``stream``
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
        group.all_reduce_hook = hook
        group.all_reduce_hook_stream = stream

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
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the shard group size (the average)."""
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise TypeError(f"gradient divide factor must be a number, got {factor!r} ({type(factor).__name__})")
        if not 0 < factor < math.inf:
            raise ValueError(f"gradient divide factor must be a positive, finite number, got {factor!r}")
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = float(factor)

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
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """After ``to``/``to_empty``/``cuda``, point the DTensors back at padded shards."""
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reset_sharded_params()
        return result


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` (e.g. ``generate``) between the pre- and post-forward work, as
    ``forward`` is: its group is all-gathered before the method and resharded after it (per
    ``reshard_after_forward``), and forwards the method calls on the module run inside that one pass.
    A module that is not an ``FSDPModule`` is left alone (like torch's, so one script serves both)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_fsdp_forward_method takes an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        raise TypeError(f"method_name must be a str, got {type(method_name).__name__}")
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        methods = sorted(n for n in dir(type(module)) if not n.startswith("_") and callable(getattr(module, n, None)))
        hint = ", ".join(m for m in methods if m in ("generate", "forward", "encode", "decode")) or "forward"
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} (e.g. {hint})")
    state = module._fsdp_state

    @functools.wraps(method)
    def forward_method(*args: Any, **kwargs: Any) -> Any:
        return state.run_forward_method(module, method, args, kwargs)

    setattr(module, method_name, forward_method)


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


def _prefetch_groups(modules: Any) -> list[FSDPParamGroup]:
    if not isinstance(modules, list | tuple):
        raise TypeError(f"expected a list of FSDPModules, got {type(modules).__name__}")
    groups = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"prefetch targets must be modules fully_shard was applied to, got {type(module).__name__}")
        if module._fsdp_state.group is None:
            raise ValueError(f"{type(module).__name__} owns no parameters: nothing to prefetch")
        groups.append(module._fsdp_state.group)
    return groups


@functools.cache
def _fsdp_class(cls: type) -> type:
    """``FSDP<Name>(FSDPModule, <Name>)``, one per original class."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def fully_shard(
    module: M,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> M:
    """Shard ``module`` (or a list of modules, as one group) over ``mesh``; returns it, now an FSDPModule.

    Args:
        module: a module with a ``forward``, or a non-empty list of them forming one group.
        mesh: a 1D ``DeviceMesh``, or 2D ``(replicate, shard)`` for HSDP; None builds a 1D one over the
            default process group. Parameters that tensor parallelism already made DTensors on a
            sibling mesh (``mesh["tp"]`` beside ``mesh["dp"]``) are sharded over this one too.
        reshard_after_forward: free the unsharded parameters after forward (True), keep them until
            backward (False), keep a k-rank shard so backward all-gathers over k ranks (int k, a
            divisor of the shard group size), or None: False for the root, True for every other group.
        shard_placement_fn: ``fn(param) -> Shard(d) | None`` picks the dim each parameter is sharded
            on (``torch.chunk`` along it); None (or a None result) shards dim 0.
        mp_policy: dtypes of the all-gather/compute (param_dtype), the gradient reduction
            (reduce_dtype), outputs and inputs; None: no casts. Sharded parameters and their
            gradients keep the parameters' own dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded parameters and gradients on the host
            (the optimizer steps there); None or ``OffloadPolicy()``: no offload.
        ignored_params: parameters left unsharded and unreduced.
    """
    modules = _check_modules(module)
    _check_reshard_after_forward(reshard_after_forward)
    mp_policy, offload_policy = _resolve_policies(mp_policy, offload_policy)
    ignored = _check_ignored(ignored_params)
    owned = _collect_params(modules, ignored)
    mesh_info = _mesh_info(mesh, owned, isinstance(offload_policy, CPUOffloadPolicy))
    policy = _param_policy(mp_policy, offload_policy, mesh_info)
    _check_group_dtypes(owned, policy)
    _check_tp_params(owned, mesh_info)
    dims = _shard_dims(shard_placement_fn, owned)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        check_post_forward_size(reshard_after_forward, mesh_info.shard_size)
        if 1 < reshard_after_forward < mesh_info.shard_size:
            check_post_forward_dims(reshard_after_forward, [(fqn, dim) for (fqn, _, _), dim in zip(owned, dims)])
    snapshot = ModuleSnapshot(all_modules(modules))  # every check passed: from here on, all or nothing
    try:
        params = tuple(
            FSDPParam(param, fqn, tuple(ParamPlace(m, n) for m, n in places), mesh_info, policy, shard_dim=dim)
            for (fqn, param, places), dim in zip(owned, dims)
        )
        _accept_full_tensors_on_load(params)
        group = FSDPParamGroup(params, modules, mesh_info, reshard_after_forward) if params else None
        state = FSDPState(modules, group, mp_policy)
        for m in modules:
            m._fsdp_state = state  # type: ignore[assignment]
            m.__class__ = _fsdp_class(type(m))  # type: ignore[arg-type]  # classes are hashable
    except BaseException:
        snapshot.restore()
        raise
    return module


def _shard_dims(fn: Any, owned: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]) -> list[int]:
    """The dim each parameter is sharded on: ``fn(param)`` as ``Shard(d)``, or 0 for None."""
    if fn is None:
        return [0] * len(owned)
    if not callable(fn):
        raise TypeError(f"shard_placement_fn must be a callable param -> Shard(dim) | None, got {type(fn).__name__}")
    dims = []
    for fqn, param, places in owned:
        placement = fn(param)
        owner = type(places[0][0]).__name__
        if placement is None:
            dims.append(0)
            continue
        if not isinstance(placement, Shard) or isinstance(placement, _StridedShard):
            raise TypeError(
                f"shard_placement_fn returned {placement!r} for parameter '{fqn}' of {owner}; it must return "
                "Shard(dim) or None (Shard(0))"
            )
        shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape  # type: ignore[attr-defined]
        ndim = len(shape)
        if not -ndim <= placement.dim < ndim:
            raise ValueError(
                f"shard_placement_fn returned Shard({placement.dim}) for parameter '{fqn}' of {owner}, of shape "
                f"{tuple(shape)}: it has no dim {placement.dim}; valid: Shard(0) .. Shard({ndim - 1}) "
                f"(or -{ndim} .. -1)"
            )
        dims.append(placement.dim % ndim)
    return dims


def _check_tp_params(owned: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]], info: MeshInfo) -> None:
    """DTensor parameters (tensor parallel) must live on a sibling of the fully_shard mesh."""
    for fqn, param, places in owned:
        if isinstance(param, DTensor):
            problem = check_tp_mesh(info, param._spec)  # type: ignore[attr-defined]
            if problem is not None:
                raise ValueError(
                    f"parameter '{fqn}' of {type(places[0][0]).__name__} is a DTensor (tensor parallel?) but {problem}"
                )


def _accept_full_tensors_on_load(params: tuple[FSDPParam, ...]) -> None:
    """``load_state_dict`` takes plain full tensors too: a pre-hook on each module that holds a managed
    parameter replaces a full-shaped plain tensor by this rank's shard (DTensors pass through)."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, FSDPParam]]]] = {}
    for param in params:
        if param.tp_spec is not None:
            continue  # tensor parallel: a full tensor needs its tp piece first; load DTensors instead
        for place in param.places:
            by_module.setdefault(id(place.module), (place.module, []))[1].append((place.name, param))
    for module, entries in by_module.values():

        def shard_full(_module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any, entries=entries) -> None:
            for name, param in entries:
                value = state_dict.get(prefix + name)
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == param.orig_shape
                ):
                    state_dict[prefix + name] = param.shard_full_tensor(value)

        module.register_load_state_dict_pre_hook(shard_full)


# ---- input checks: each raises naming the offending value and what is allowed -------------------
def _check_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, list | tuple) else (module,)
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass a module or a non-empty list")
    seen: dict[int, int] = {}
    for index, m in enumerate(modules):
        if id(m) in seen:
            raise ValueError(
                f"fully_shard got the same {type(m).__name__} twice in its list (positions {seen[id(m)]} and "
                f"{index}); list each module once"
            )
        seen[id(m)] = index
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__[len('FSDP') :]}; "
                "each module can be sharded once"
            )
        if type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard cannot shard a {type(m).__name__}: it has no forward, so its hooks would "
                "never run. Shard its children instead, e.g. `for block in model.layers: fully_shard(block)`"
            )
    return modules


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _check_reshard_after_forward(value: Any, allow_none: bool = True) -> None:
    if (value is None and allow_none) or isinstance(value, bool | int):
        return
    raise TypeError(
        "reshard_after_forward must be True, False, an int k (reshard to groups of k ranks)"
        f"{' or None (root False, others True)' if allow_none else ''}, got {value!r} ({type(value).__name__})"
    )


def _resolve_policies(mp_policy: Any, offload_policy: Any) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy or None, got {type(mp_policy).__name__}")
    if offload_policy is None:
        offload_policy = OffloadPolicy()
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy or None, got {type(offload_policy).__name__}")
    return mp_policy, offload_policy


def _param_policy(mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy, mesh_info: MeshInfo) -> ParamPolicy:
    """The policies the parameters run under, now that the compute device is known (pinning needs CUDA)."""
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    if pin and mesh_info.device.type != "cuda":
        warnings.warn(
            f"CPUOffloadPolicy(pin_memory=True) on a '{mesh_info.mesh.device_type}' mesh: host shards are not "
            "pinned (pinning only speeds up copies to a CUDA device). Pass CPUOffloadPolicy(pin_memory=False) "
            "to silence this.",
            stacklevel=4,
        )
        pin = False
    return ParamPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype, offload_to_cpu=offload, pin_memory=pin)


def _check_group_dtypes(
    owned: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]], policy: ParamPolicy
) -> None:
    """One group is one flat all-gather buffer: its parameters must gather in one dtype."""
    gathered = {fqn: cast_dtype(p, policy.param_dtype) for fqn, p, _ in owned}
    if len(set(gathered.values())) > 1:
        listing = ", ".join(f"{fqn}: {dtype}" for fqn, dtype in gathered.items())
        raise ValueError(
            f"parameters of one fully_shard call must all-gather in one dtype, got {listing}; "
            "pass mp_policy=MixedPrecisionPolicy(param_dtype=...) or shard them in separate calls"
        )


def _check_ignored(ignored_params: Any) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, Iterable) or isinstance(ignored_params, torch.Tensor):
        raise TypeError(f"ignored_params must be a set of nn.Parameter, got {type(ignored_params).__name__}")
    ignored = list(ignored_params)
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got a {type(p).__name__}")
    return {id(p) for p in ignored}


def _walk(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """Modules under ``module`` that no nested fully_shard call owns (each once)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module.named_children():
        if isinstance(child, FSDPModule):
            continue
        yield from _walk(child, f"{prefix}{name}.", seen)


def _nested_params(modules: tuple[nn.Module, ...]) -> dict[int, str]:
    """id(original Parameter) -> name, for parameters that nested fully_shard calls took."""
    taken: dict[int, str] = {}
    for root in modules:
        for path, module in root.named_modules():
            state = getattr(module, "_fsdp_state", None)
            if state is None or state.group is None:
                continue
            for param in state.group.params:
                original = param.orig_param_ref()
                if original is not None:
                    taken[id(original)] = f"{path}.{param.fqn}" if path else param.fqn
    return taken


def _collect_params(
    modules: tuple[nn.Module, ...], ignored: set[int]
) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """The parameters this call owns, with every (module, name) place they are registered at."""
    owned: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    taken = _nested_params(modules)
    seen: set[int] = set()
    for index, root in enumerate(modules):
        root_prefix = f"[{index}]." if len(modules) > 1 else ""
        for prefix, module in _walk(root, root_prefix, seen):
            for name, param in module._parameters.items():
                if param is None or id(param) in ignored:
                    continue
                fqn = f"{prefix}{name}"
                _check_param(param, fqn, type(module).__name__, taken)
                entry = owned.setdefault(id(param), (fqn, param, []))
                entry[2].append((module, name))
    return list(owned.values())


def _check_param(param: nn.Parameter, fqn: str, owner: str, taken: dict[int, str]) -> None:
    if isinstance(param, DTensor) and getattr(param, "_fsdp2lite_sharded", False):
        raise ValueError(
            f"parameter '{fqn}' of {owner} is already sharded: fully_shard was applied to a module "
            "that encloses it first. Apply fully_shard bottom-up: submodules first, then the root"
        )
    if id(param) in taken:
        raise ValueError(
            f"parameter '{fqn}' of {owner} is tied to '{taken[id(param)]}', which a nested fully_shard "
            "call already sharded; tied parameters must be in one group: shard a module containing "
            "every use (or leave the tied modules to the enclosing call)"
        )
    if param.dim() == 0:
        raise ValueError(
            f"parameter '{fqn}' of {owner} is 0-dim (a scalar); fully_shard shards on dim 0. "
            "Make it shape (1,) or pass it in ignored_params"
        )


def _mesh_info(
    mesh: DeviceMesh | None, owned: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]], offload: bool
) -> MeshInfo:
    devices = {param.device for _, param, _ in owned}
    real = {d for d in devices if d.type != "meta"}
    if len({d.type for d in real}) > 1:
        raise ValueError(f"parameters of one fully_shard call must share a device type, got {sorted(map(str, real))}")
    if mesh is None:
        if real and not offload:
            device_type = next(iter(real)).type  # the parameters are where the job computes
        else:
            device_type = backend_device_type(next(iter(real)).type if real else None)  # [Note: device rule]
        mesh = default_mesh(device_type)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard(mesh=...) takes a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}"
        )
    allowed = {mesh.device_type, "meta"} | ({"cpu"} if offload else set())  # offload starts from host params
    for fqn, param, _ in owned:
        if param.device.type not in allowed:
            raise ValueError(
                f"parameter '{fqn}' is on {param.device} but the mesh is a '{mesh.device_type}' mesh; "
                f"move the module to {mesh.device_type} (or build it on the meta device) before "
                "fully_shard, or pass a mesh of its device type"
            )
    return mesh_info_for(mesh)
