"""torch's all-gather extension protocol: a parameter whose local tensor (a tensor subclass such as
torchao's NF4 or float8 weights) chooses what is all-gathered and how the unsharded tensor is rebuilt.

[Note: all-gather extension]
The subclass defines two methods, as with torch's ``fully_shard``:

    fsdp_pre_all_gather(mesh[, outer_size, outer_stride, module, mp_policy]) -> (inputs, metadata)
    fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (unsharded, inner_tensors) | None

Per unshard, ``pre`` is called on this rank's padded shard (torch calls it on the unpadded shard and requires
padded inputs back when the shard is uneven, which a hook with per-row scales cannot give); its ``inputs``
(plain tensors, or records of them: [Note: all-gather input records] in extension_inputs.py) join the group's
one collective as bytes ([Note: byte all-gather] in gather.py), so a group of NF4 weights and bf16 norms is
still one all-gather, and 1-byte dtypes (int8, float8) cross gloo as uint8. The gathered bytes land in this
parameter's own output buffers, one per input, ``(shard_size * numel,)`` in the input's dtype, made once and
kept across steps (their storage freed at reshard, given back at unshard). ``post`` then sees each output in
its gathered shape (``(shard_size * rows, *rest)`` for a plain tensor): the first time it builds the unsharded
tensor (torchao's NF4 builds it on those very buffers), later it refills it in place (``out=``), so the
Parameter object autograd and the modules hold stays the same. Dim-0 sharding only, no tensor parallelism or
quantized all-gather (each refused, naming the parameter); CPU offload is supported:
[Note: offloaded hooked parameters].

[Note: offloaded hooked parameters]
Under ``CPUOffloadPolicy`` the padded shard of a hooked parameter lives on the host like any other
(moved there by the subclass's own ``cpu()``, pinned by its own ``pin_memory()`` where the group pins:
torchao's NF4 moves and pins its inner tensors). At each all-gather from the sharded state the shard is
first copied to the compute device (the subclass's ``to(device, non_blocking=True)``; from pinned
memory an asynchronous copy), and the pre hook is called on that copy, as torch's ``fully_shard`` does:
a hook's metadata may record the device (NF4's does, and its post hook builds the unsharded tensor on
that device), so the hook must see a device tensor. On CUDA the copy, the hook and the copy-in run on
the ``all_gather_copy_in`` stream (``Comm.on``: after the compute stream's queued work; the copy is
allocated there and last read there, [Note: CUDA buffer lifetime]); on CPU the device is the host and
the copy is the shard itself. Gradients of a trainable hooked parameter are reduced and stored on the
host as every offloaded parameter's are (the group's ``HostShards``: [Note: host storage] in host_storage.py).

[Note: hooks looked up per all-gather]
As torch does, the hooks are looked up on the sharded parameter's local tensor (``param._local_tensor``)
at every all-gather from the sharded state: hooks defined by its class, or set on the tensor object after
``fully_shard`` (``local.fsdp_pre_all_gather = fn.__get__(local)``, torch's monkey-patching form) take
effect at the next all-gather, and removing them returns the parameter to the plain path. The look-up is
two attribute reads per parameter; only when the hooks' functions change is the signature read again
(1 or 5 arguments), the parameter's unsharded tensor made anew and the group's all-gather layout
re-derived. A hook bound to the local tensor is called as a method of the padded shard (the local
tensor is a view of its first rows), and hooks set on a local tensor that ``to_empty`` or
``load_state_dict(assign=True)`` replaced follow it to the new one.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.nn as nn

from .extension_inputs import PayloadLayout, check_pre_result, payload_layout
from .layout import ShardLayout

HOOK_NAMES = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def has_extension(local: torch.Tensor) -> bool:
    """Whether ``local`` defines torch's all-gather extension hooks (``fsdp_pre_all_gather``)."""
    return hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather")


def find_hooks(local: torch.Tensor) -> tuple[Any, Any]:
    """``local``'s (pre, post) hooks, from its class or set on the object; None where absent."""
    return getattr(local, "fsdp_pre_all_gather", None), getattr(local, "fsdp_post_all_gather", None)


def hook_key(hook: Any) -> Any:
    """What identifies a hook across look-ups: a method's function (each read makes a new bound method)."""
    return getattr(hook, "__func__", hook)


def bound_to(hook: Any, tensor: torch.Tensor) -> Any:
    """``hook`` called as a method of ``tensor`` when it is a method of a tensor (the local tensor's class
    or instance hook, called on the padded shard: [Note: hooks looked up per all-gather]); else as is."""
    if inspect.ismethod(hook) and isinstance(hook.__self__, torch.Tensor) and hook.__self__ is not tensor:
        return types.MethodType(hook.__func__, tensor)
    return hook


def carry_instance_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Hooks set on the object ``old`` (not its class) follow it to ``new``, which replaces it."""
    attributes = getattr(old, "__dict__", {})
    for name in HOOK_NAMES:
        if name in attributes:
            setattr(new, name, attributes[name])


class AllGatherExtension:
    """The hooks of one parameter's local tensor and the buffers its all-gather outputs live in."""

    fqn: str
    pre_key: Any  # hook_key of the pre hook this record was made for: another one means the hooks changed
    post_key: Any
    takes_mesh_only: bool  # the 1-argument form (torchao's NF4) rather than torch 2.6+'s 5-argument one
    metadata: Any  # what the last pre_all_gather returned beside its inputs, for post_all_gather
    layouts: list[PayloadLayout]  # per input, as pre_all_gather returned it
    group_size: int  # ranks of the last all-gather's inputs
    outputs: list[torch.Tensor]  # per input, (shard_size * numel,) in its dtype and gathered layout; kept
    staging: list[torch.Tensor | None]  # per input with outer > 1: its rank-major copy-out, until reassembled
    inner_tensors: tuple[torch.Tensor, ...]  # what post_all_gather said to free at reshard

    def __init__(self, local: torch.Tensor, fqn: str) -> None:
        pre, post = find_hooks(local)
        if pre is None or post is None:
            missing = "fsdp_post_all_gather" if pre is not None else "fsdp_pre_all_gather"
            raise ValueError(
                f"parameter '{fqn}' ({type(local).__name__}) defines only one of fsdp_pre_all_gather and "
                f"fsdp_post_all_gather (no {missing}); torch's all-gather extension needs both"
            )
        names = list(inspect.signature(pre).parameters)
        if len(names) not in (1, 5):
            raise ValueError(
                f"parameter '{fqn}' ({type(local).__name__}): fsdp_pre_all_gather({', '.join(names)}) takes "
                f"{len(names)} arguments; expected (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)"
            )
        self.fqn = fqn
        self.pre_key, self.post_key = hook_key(pre), hook_key(post)
        self.takes_mesh_only = len(names) == 1
        self.metadata = None
        self.layouts = []
        self.group_size = 1
        self.outputs = []
        self.staging = []
        self.inner_tensors = ()

    def same_hooks(self, pre: Any, post: Any) -> bool:
        """Whether ``pre`` and ``post`` (just looked up) are the hooks this record was made for."""
        return hook_key(pre) is self.pre_key and hook_key(post) is self.post_key

    def check_supported(
        self, shard_dim: int, tensor_parallel: bool, quantized: bool = False, aligned: bool = False
    ) -> None:
        """Such a parameter is sharded on dim 0, unaligned, without tensor parallelism, gathered exactly."""
        problem = None
        if aligned:  # its hook cuts only trailing padding: [Note: padded shard] in layout.py
            problem = "its shard is block-aligned (padding between ranks' rows)"
        elif shard_dim != 0:
            problem = f"shard_placement_fn chose Shard({shard_dim})"
        elif tensor_parallel:
            problem = "it is also tensor parallel"
        elif quantized:
            problem = "its group's CommPolicy quantizes the all-gather"
        if problem is not None:
            raise ValueError(
                f"parameter '{self.fqn}' defines torch's all-gather extension (fsdp_pre_all_gather), but {problem}: "
                "such parameters are sharded on dim 0, without tensor parallelism or a quantized all-gather"
            )

    def shard(self, data: torch.Tensor, mesh_info: Any, layout: ShardLayout) -> torch.Tensor:
        """This rank's padded shard (``layout``'s), made by the subclass's own ops (``torch.chunk``, ``new_zeros``,
        slicing, ``copy_``, as torch's fully_shard makes it), so the shard is a subclass tensor too."""
        chunks = torch.chunk(data.detach(), mesh_info.shard_size, dim=0)
        return self.pad(chunks[mesh_info.shard_rank] if layout.local_rows else chunks[0], layout)

    @staticmethod
    def to_host(padded: torch.Tensor, pin: bool) -> torch.Tensor:
        """CPU offload: ``padded`` on the host, pinned when ``pin``, by the subclass's own ``cpu()`` and
        ``pin_memory()`` ([Note: offloaded hooked parameters]); a meta shard stays on meta."""
        if padded.device.type == "meta":
            return padded
        host = padded.cpu()
        return host.pin_memory() if pin and not host.is_pinned() else host

    @staticmethod
    def to_device(padded: torch.Tensor, device: torch.device) -> torch.Tensor:
        """CPU offload: the host shard's copy on the compute ``device`` that the pre hook is called on
        (asynchronous from pinned memory; the shard itself when ``device`` is the host)."""
        return padded.to(device, non_blocking=True)

    @staticmethod
    def pad(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """``local``'s first ``local_rows`` rows in a zeroed tensor of the padded shard's shape, of the subclass."""
        padded = local.new_zeros(layout.padded_shape)
        rows = layout.local_rows
        if rows:
            padded[:rows].copy_(local[:rows])
        return padded

    def inputs(
        self,
        padded_shard: torch.Tensor,
        local: torch.Tensor,
        mesh: Any,
        shape: torch.Size,
        *,
        module: nn.Module,
        mp_policy: Any,
    ) -> list[torch.Tensor]:
        """This rank's all-gather inputs, flat (one view each), from the pre-all-gather hook looked up on
        the local tensor and called on the padded shard: every rank's inputs then have the same shapes, and
        under torch.chunk's layout the gathered rows are the parameter's followed by the padding, which the
        rebuild cuts off."""
        pre = bound_to(local.fsdp_pre_all_gather, padded_shard)  # type: ignore[attr-defined]
        if self.takes_mesh_only:
            result = pre(mesh)
        else:
            result = pre(mesh, shape, contiguous_stride(shape), module, mp_policy)
        payloads, self.metadata = check_pre_result(result, self.fqn)
        self.group_size = mesh.size()
        tensors, self.layouts = [], []
        for index, payload in enumerate(payloads):
            tensor, layout = payload_layout(payload, index, self.group_size, self.fqn)
            tensors.append(tensor.contiguous().view(-1))
            self.layouts.append(layout)
        self._prepare_outputs(self.group_size, tensors)
        return tensors

    def _prepare_outputs(self, group_size: int, inputs: list[torch.Tensor]) -> None:
        """One output buffer per input, made the first time (or when the hook's inputs change), given its
        storage back on later unshards ([Note: all-gather extension])."""
        if len(self.outputs) != len(inputs) or any(
            o.dtype != i.dtype or o.numel() != group_size * i.numel() for o, i in zip(self.outputs, inputs)
        ):
            self.outputs = [torch.empty(group_size * i.numel(), dtype=i.dtype, device=i.device) for i in inputs]
        for output in self.outputs:
            ensure_allocated(output)

    def output_views(self, group_size: int) -> list[torch.Tensor]:
        """Each input's copy-out target as ``(group_size, bytes per rank)`` uint8: its output buffer, or for
        an input gathered along an inner dim a staging buffer ([Note: all-gather input records] in
        extension_inputs.py)."""
        self.staging = [None] * len(self.outputs)
        views = []
        for index, (output, layout) in enumerate(zip(self.outputs, self.layouts)):
            target = output
            if layout.outer > 1 and group_size > 1:
                target = self.staging[index] = torch.empty_like(output)
            # .data: a version counter of its own, so a post hook's tensor viewing the output (autograd may
            # have saved it) does not see the refill as an in-place change
            views.append(target.data.view(torch.uint8).view(group_size, target.nbytes // group_size))
        return views

    def _reassemble(self) -> None:
        """Staged rank-major outputs into their outputs' gathered layout: one transposing copy each."""
        for output, staged, layout in zip(self.outputs, self.staging, self.layouts):
            if staged is not None:
                ranks = staged.view(self.group_size, layout.outer, -1)  # (ranks, outer, inner)
                output.data.view(layout.outer, self.group_size, -1).copy_(ranks.transpose(0, 1))
        self.staging = [None] * len(self.outputs)

    def unsharded(
        self, local: torch.Tensor, param_dtype: torch.dtype, orig_shape: torch.Size, current: nn.Parameter | None
    ) -> torch.Tensor | None:
        """Run post_all_gather on the gathered outputs: the first time, the new unsharded tensor (its
        padding rows cut off); after that, ``current`` refilled in place and None."""
        self._reassemble()
        gathered = tuple(o.view(layout.output_size) for o, layout in zip(self.outputs, self.layouts))
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        if current is not None:
            for tensor in self.inner_tensors:
                ensure_allocated(tensor)
            post(gathered, self.metadata, param_dtype, out=current)
            return None
        result = post(gathered, self.metadata, param_dtype)
        if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], torch.Tensor):
            raise ValueError(
                f"parameter '{self.fqn}': fsdp_post_all_gather must return (unsharded tensor, tensors to free), "
                f"got {type(result).__name__}"
            )
        unsharded, self.inner_tensors = result[0], tuple(result[1])
        if unsharded.shape[0] < orig_shape[0] or tuple(unsharded.shape[1:]) != tuple(orig_shape[1:]):
            raise ValueError(
                f"parameter '{self.fqn}': fsdp_post_all_gather returned shape {tuple(unsharded.shape)}, which "
                f"does not hold the parameter's {tuple(orig_shape)}"
            )
        return torch.as_strided(unsharded, orig_shape, contiguous_stride(orig_shape), 0)

    def reallocate(self) -> None:
        """Give the output buffers their storage back for a regather of the kept inputs (a post-forward
        group's), which reuses the last pre-all-gather's metadata: [Note: post-forward reshard]."""
        for output in self.outputs:
            ensure_allocated(output)

    def free(self) -> None:
        """Reshard: the output buffers and the tensors post_all_gather named give their memory back."""
        for tensor in (*self.outputs, *self.inner_tensors):
            tensor.untyped_storage().resize_(0)


def ensure_allocated(tensor: torch.Tensor) -> None:
    untyped = tensor.untyped_storage()
    nbytes = int((tensor.storage_offset() + tensor.numel()) * tensor.element_size())
    if untyped.size() < nbytes:
        untyped.resize_(nbytes)


def contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
