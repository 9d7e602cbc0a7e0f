"""A fast optimizer step on the host: torch's fused CPU Adam/AdamW kernel for CPU-offloaded parameters.

With ``CPUOffloadPolicy`` the sharded parameters, their gradients and the optimizer state live on the host
and ``optimizer.step()`` runs there. torch's Adam and AdamW pick the per-parameter for-loop for CPU tensors
(``foreach`` is for CUDA): about ten ops per parameter, each dispatched through DTensor. The fused CPU kernel
(``fused=True``, torch >= 2.4) does the whole update in one pass over memory and one dispatch per step.

``fast_host_step(optimizer)`` switches an existing Adam/AdamW to that kernel for its host parameters, keeping
its state; see [Note: fused CPU kernel layouts] for the one thing the kernel gets wrong and how it is kept
away from it, and docs/offload.md for the decisions and the measured speed. ``step_in_backward(model,
optimizer_factory)`` (opt-in) steps each group's parameters inside backward, as soon as their reduced
gradients land, and frees those gradients at once; groups on the host step on the runtime's host-step thread
while backward goes on ([Note: host steps off backward's thread] in ``host/steps.py``).

[Note: fused CPU kernel layouts]
torch's CPU ``_fused_adam_``/``_fused_adamw_`` checks no strides (torch 2.11 and 2.13; the CUDA kernel
refuses mismatched ones, pytorch#106951): it is right only when the parameter, its gradient and its state
are each non-overlapping and dense, with the same strides. Otherwise it is silently wrong: a (5, 3) view of
a (5, 4) buffer, or a contiguous parameter with a transposed gradient, moves by values off by 0.3-0.6 after
three steps at lr 0.1. fsdp2lite makes such a shard: ``Shard(1)`` with uneven chunks leaves the last rank a
``(rows, k)`` view of its ``(rows, k + pad)`` padded shard, and ``zeros_like`` gives its Adam state contiguous
strides. So before every step ``_FusedStepHooks`` (a step pre-hook) checks each fused group's host parameters:
one that is not dense, or whose gradient or state has other strides (a shard as above, a gradient assigned by
hand, a state loaded with other strides), is stepped on the for-loop for that step, in a group of its own that
the post-hook removes again. The groups' structure never changes, so it is the same on every rank (only the
last rank may hold such a shard) and in every checkpoint; ``fast_host_step`` warns once about the shards it
finds.

[Note: fused steps and version counters]
The fused kernel updates the parameters in place without bumping their version counters (torch 2.11 and 2.13:
``param._version`` is unchanged by a fused step, two higher after a for-loop step). fsdp2lite's runtime learns
that the shards changed from those counters: ZeRO-1/2's resident parameters are all-gathered again, HFSDP's
stepped pieces gathered back, ``optimizer_only``'s device shards refreshed from the host masters, each only
when a version moved. With a fused step they never do, and the next forward runs on the old weights (0.05 off
after 4 steps at lr 1e-2 for ZeRO-1/2). So the post-hook bumps the version of every host parameter the fused
kernel stepped (``torch.autograd.graph.increment_version``), as the for-loop's in-place ops would have.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp2lite.module import FSDPModule

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)  # exact types: AdamW subclasses Adam on recent torch
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # Adam's per-parameter tensors, shaped as the param


def fast_host_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Run ``optimizer``'s host (CPU) parameters through torch's fused CPU Adam/AdamW kernel; return it.

    For ``torch.optim.Adam`` or ``torch.optim.AdamW``: every param group with parameters on the host gets
    ``fused=True`` and ``foreach=False``; its hyperparameters and state are kept (the state's tensors are the
    same objects, so a checkpoint loads as before). A group that mixes host parameters with parameters the
    kernel cannot take on the host (device parameters, complex ones) is split: the host floating-point
    parameters stay in the group, now fused; the others move to a new group appended at the end, with the
    same hyperparameters and the group's old ``fused``/``foreach``. Existing group indices keep their meaning.
    A host shard the kernel would update wrongly is stepped on the for-loop instead, step by step
    ([Note: fused CPU kernel layouts]), and after each step the versions of the parameters the kernel stepped are
    bumped, so ZeRO-1/2, HFSDP and ``optimizer_only`` see the new shards ([Note: fused steps and version counters]).

    Everything is checked before anything changes. What cannot be sped up is left as it is, with one
    ``UserWarning`` naming it: another optimizer class (SGD, a subclass of AdamW, ...), a group with
    ``differentiable=True``, an optimizer with no host parameters, and a group that would need a split while
    an LR scheduler already holds one learning rate per group (call ``fast_host_step`` before making it).
    Calling it again changes nothing. ``optimizer._step_supports_amp_scaling`` is left as it was, so a
    ``GradScaler`` unscales the gradients itself, for fused and other groups alike.

    Raises ``TypeError`` when ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fast_host_step takes a torch.optim.Optimizer (Adam or AdamW), got {type(optimizer).__name__}")
    if type(optimizer) not in ADAM_TYPES:
        _warn(optimizer, ["every group (only torch.optim.Adam and AdamW have the fused CPU kernel)"])
        return optimizer
    plans, left_out = _plan(optimizer)
    for plan in plans:
        _apply(optimizer, plan)
    if any(_has_host_params(group) and group.get("fused") for group in optimizer.param_groups):
        _FusedStepHooks.install(optimizer)
    if left_out:
        _warn(optimizer, left_out)
    return optimizer


@dataclass(frozen=True)
class _GroupPlan:
    """One param group's change: its ``fused`` parameters stay and switch, its ``rest`` move to a new group."""

    index: int
    fused: list[torch.Tensor]
    rest: list[torch.Tensor]


def _plan(optimizer: torch.optim.Optimizer) -> tuple[list[_GroupPlan], list[str]]:
    """Every group's change, and what is left out and why. Changes nothing."""
    plans: list[_GroupPlan] = []
    left_out: list[str] = []
    has_scheduler = hasattr(optimizer.step, "_wrapped_by_lr_sched") or any(
        "initial_lr" in group for group in optimizer.param_groups
    )  # an LR scheduler wraps step and sets initial_lr per group: it holds one lr per group from then on
    for index, group in enumerate(optimizer.param_groups):
        left_out.extend(
            f"param_groups[{index}][{position}] {_describe(p)} (its local shard is not dense: stepped on the "
            "for-loop, [Note: fused CPU kernel layouts] in fsdp2lite/offload/host_step.py)"
            for position, p in enumerate(group["params"])
            if _on_host(p) and torch.is_floating_point(p) and _dense_strides(_local(p)) is None
        )
        fused = [p for p in group["params"] if _on_host(p) and torch.is_floating_point(p)]
        if not fused or (group.get("fused") and not group.get("foreach")):
            continue  # nothing for the kernel here, or already on it
        if group.get("differentiable"):
            left_out.append(f"param_groups[{index}] (differentiable=True: the fused kernel has no autograd)")
            continue
        chosen = {id(p) for p in fused}
        rest = [p for p in group["params"] if id(p) not in chosen]
        left_out.extend(
            f"param_groups[{index}][{position}] {_describe(p)} (dtype {p.dtype}: the kernel takes floating point)"
            for position, p in enumerate(group["params"])
            if _on_host(p) and not torch.is_floating_point(p)
        )
        if rest and has_scheduler:
            left_out.append(
                f"param_groups[{index}] (mixes {len(fused)} host parameters with {len(rest)} others, and an LR "
                "scheduler already holds one learning rate per group: call fast_host_step before making it)"
            )
            continue
        plans.append(_GroupPlan(index, fused, rest))
    if not any(_has_host_params(group) for group in optimizer.param_groups):
        left_out.append("every group (no parameter is on the host: fast_host_step speeds up CPU-offloaded steps)")
    return plans, left_out


def _apply(optimizer: torch.optim.Optimizer, plan: _GroupPlan) -> None:
    """Switch one group to the fused kernel; its other parameters into a new group with its old settings."""
    group = optimizer.param_groups[plan.index]
    if plan.rest:
        settings = {key: value for key, value in group.items() if key != "params"}
        optimizer.param_groups.append({**settings, "params": plan.rest})  # the dict add_param_group makes
        group["params"] = plan.fused
    group["fused"] = True
    group["foreach"] = False  # torch refuses fused and foreach both True


def _dense_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of the dims longer than 1 if ``tensor`` is non-overlapping and dense, else None.

    Dense: its elements fill ``numel`` consecutive slots. E.g. (5, 3) strides (3, 1): yes, (3, 1); its
    transpose (3, 5) strides (1, 3): yes, (1, 3); a (5, 3) slice of a (5, 4) buffer, strides (4, 1): no.
    """
    if tensor.numel() == 0:
        return ()
    dims = [(stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1]
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            return None
        expected *= size
    return tuple(stride for stride, _ in dims)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the attribute the runtime sets: ``to_local()`` costs an autograd call on
    every step), else the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def _on_host(param: torch.Tensor) -> bool:
    return param.device.type == "cpu"


def _has_host_params(group: dict[str, Any]) -> bool:
    return any(_on_host(p) for p in group["params"])


def _describe(param: torch.Tensor) -> str:
    kind = "DTensor" if isinstance(param, DTensor) else "tensor"
    return f"{kind} {tuple(param.shape)} {str(param.dtype).removeprefix('torch.')}"


def _warn(optimizer: torch.optim.Optimizer, left_out: list[str]) -> None:
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    warnings.warn(f"fast_host_step: {name} keeps torch's default step for " + "; ".join(left_out), stacklevel=3)


class _FusedStepHooks:
    """Step pre- and post-hook: for one step, a fused group's host parameters whose layouts the kernel would
    get wrong move to a for-loop group of their own ([Note: fused CPU kernel layouts]); after the step, the
    versions of the parameters the kernel stepped are bumped ([Note: fused steps and version counters])."""

    moved: list[tuple[dict[str, Any], list[torch.Tensor], dict[str, Any]]]  # (group, its params, loop group)

    def __init__(self) -> None:
        self.moved = []

    @classmethod
    def install(cls, optimizer: torch.optim.Optimizer) -> None:
        """Register the hooks on ``optimizer``, unless it has them."""
        registered: Iterable[object] = getattr(optimizer, "_optimizer_step_pre_hooks", {}).values()
        if any(isinstance(hook, cls) for hook in registered):
            return
        hooks = cls()
        optimizer.register_step_pre_hook(hooks)
        optimizer.register_step_post_hook(hooks.after_step)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.restore(optimizer)  # a step that raised left its loop groups behind
        for group in list(optimizer.param_groups):
            if not group.get("fused"):
                continue
            wrong = [p for p in group["params"] if not _layouts_match(optimizer, p)]
            if not wrong:
                continue
            loop = {**group, "params": wrong, "fused": False, "foreach": False}
            moved = {id(p) for p in wrong}
            self.moved.append((group, group["params"], loop))
            group["params"] = [p for p in group["params"] if id(p) not in moved]
            optimizer.param_groups.append(loop)

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Bump the versions of the parameters the fused kernel stepped, then put the moved parameters back."""
        for group in optimizer.param_groups:
            if group.get("fused"):  # the for-loop groups' in-place ops bumped their own
                for param in group["params"]:
                    if param.grad is not None and _on_host(param):
                        torch.autograd.graph.increment_version(param)
        self.restore(optimizer)

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the moved parameters back in their groups, in their order, and drop the loop groups."""
        for group, params, loop in reversed(self.moved):
            group["params"] = params
            optimizer.param_groups[:] = [g for g in optimizer.param_groups if g is not loop]
        self.moved = []


def _layouts_match(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """True unless ``param`` is on the host with a gradient, and it is not dense, or its gradient or state
    tensors have other strides (compared on the dims longer than 1)."""
    grad = param.grad
    if grad is None or not _on_host(param):
        return True
    local = _local(param)
    state = optimizer.state.get(param, {})
    others = [_local(grad), *(_local(state[key]) for key in STATE_KEYS if key in state)]
    if local.is_contiguous() and all(other.stride() == local.stride() for other in others):
        return True  # the common case, without the slower check below
    dense = _dense_strides(local)
    return dense is not None and all(_dense_strides(other) == dense for other in others)


@dataclass
class StepInBackward:
    """What ``step_in_backward`` set up: one optimizer per fsdp2lite group, stepped from backward."""

    optimizers: list[torch.optim.Optimizer]  # one per group with trainable parameters, in model.modules() order
    overlap: bool | None  # host groups step on a thread of their own while backward goes on (None: off a CPU mesh)
    handles: list[RemovableHandle] = field(default_factory=list)  # the post-accumulate-grad hooks

    def remove(self) -> None:
        """Unregister the hooks: backward leaves gradients in ``.grad`` again; the optimizers keep their state."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def step_in_backward(
    model: nn.Module,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    overlap: bool | None = None,
) -> StepInBackward:
    """Step each fsdp2lite group of ``model`` inside backward, as soon as its reduced gradients are in ``.grad``.

    ``optimizer_factory(params)`` makes one optimizer per group (e.g. ``lambda ps: fast_host_step(
    torch.optim.AdamW(ps, lr=3e-4))``) over that group's trainable parameters; a hook on each sharded parameter
    (``register_post_accumulate_grad_hook``, which fsdp2lite calls once the group's reduced gradients are all in
    ``.grad``) steps the group's optimizer and sets its gradients to None: torch's "optimizer step in backward"
    recipe, one step per group instead of per parameter. No group's gradients outlive its step, and under CPU
    offload one pinned host buffer, the largest group's, takes every group's gradients in turn ([Note: host
    gradient buffers] in ``_runtime/pinned.py``).

    ``overlap``: whether a group whose shards are on the host steps on a worker thread while backward goes on to
    the next groups ([Note: host steps off backward's thread] in ``host/steps.py``). ``None`` (the
    default): where backward runs on a device, i.e. CPU offload from a CUDA mesh, so the device keeps running the
    backward while the host steps instead of waiting for each step; on a CPU mesh the step and the backward would
    share the same cores, so they take turns. ``True``: on any mesh (a CPU job with cores to spare). ``False``:
    always in backward's own thread. ``loss.backward()`` returns once every group has stepped, either way, with
    the same values; an error raised by a step is raised from it.

    Do not call ``step()`` yourself; there is no gradient clipping across groups, since no group waits for the
    others. Microbatches with gradient sync off reduce nothing, so they step nothing; the synchronising one
    steps. ``model`` must be the root ``fsdp2lite.FSDPModule``, between steps. Every optimizer is made before any
    hook is registered; ``StepInBackward.remove()`` unregisters the hooks.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(f"step_in_backward takes the root fsdp2lite.FSDPModule, got {type(model).__name__}")
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"step_in_backward: overlap must be True, False or None (off a CPU mesh), got {overlap!r}")
    groups = _group_params(model)
    optimizers = [_make_optimizer(optimizer_factory, params, index) for index, params in enumerate(groups)]
    handles = [
        param.register_post_accumulate_grad_hook(_GroupStep(optimizer, overlap))
        for optimizer, params in zip(optimizers, groups, strict=True)
        for param in params
    ]
    return StepInBackward(optimizers, overlap, handles)


def _group_params(root: nn.Module) -> list[list[nn.Parameter]]:
    """Each fsdp2lite module's own trainable parameters (not a nested module's), in ``root.modules()`` order."""
    seen: set[int] = set()
    groups = []
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        nested = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}  # fmt: skip
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in nested | seen]
        seen.update(id(p) for p in params)
        if params:
            groups.append(params)
    return groups


def _make_optimizer(
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer], params: list[nn.Parameter], index: int
) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if held != {id(p) for p in params}:
        raise ValueError(
            f"optimizer_factory(params) must make an optimizer over exactly the {len(params)} parameters it is "
            f"given (group {index}); it holds {len(held)}, {len(held - {id(p) for p in params})} of them others"
        )
    return optimizer


class _GroupStep:
    """Post-accumulate-grad hook: step a group's optimizer over the gradients that have landed, then free them.
    The group's first hook steps all of it; the others find their gradient gone. ``runs_off_thread`` lets the
    runtime call it on its host-step thread ([Note: host steps off backward's thread])."""

    optimizer: torch.optim.Optimizer
    runs_off_thread: bool | None  # None: where the mesh's device is not the host

    def __init__(self, optimizer: torch.optim.Optimizer, overlap: bool | None) -> None:
        self.optimizer = optimizer
        self.runs_off_thread = overlap

    def __call__(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
