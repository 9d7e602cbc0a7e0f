"""One host buffer per offloaded group, of its exact size: the host shards (or masters) of CPU offload.

[Note: one host buffer per group]
Under ``CPUOffloadPolicy`` each parameter's padded shard lives on the host (``optimizer_only``: each trainable
parameter's master). Pinned one by one through torch's caching host allocator, every block is rounded up to a
power of two (pytorch#150517): a 1B model's shards can take 1.3-1.7x their bytes of page-locked memory, which
the OS can neither swap nor give to anything else. So once a group's parameters exist (at ``fully_shard``, and
again whenever ``to_empty``, ``module.to`` or an assigning load renewed them) their host tensors are packed
into one buffer, each at a 64-byte-aligned offset, and the parameters adopt views of it:
- pinned (``pin_memory`` on a CUDA mesh) by registering exactly those bytes with the driver
  (``cudaHostRegister``), not through the caching allocator, so page-locked memory is the shards' bytes plus
  at most 63 bytes of alignment per parameter; unregistered when the buffer is dropped;
- where registering fails, torch's pinned allocator takes the one buffer instead (one rounding for the group,
  not one per parameter), and where pinning fails too, pageable memory with one warning ([Note: pinning fails]);
- on a CPU mesh nothing is pinned: the buffer is plain memory, packed the same way (one code path).
The buffer is the group's for its life: the optimizer steps into it, the all-gather copies out of it, every
step. Hooked parameters (a tensor subclass with all-gather hooks, such as NF4) and HFSDP's replica-sharded ones
keep buffers of their own.

The reduced gradients' host buffer (one per group, the sharded gradients are views of it) is made the same
way, once, and reused by every backward that finds nothing else holding it (``zero_grad()`` set the
gradients to None): its storage's use count is the one it had when made. A backward that finds it still held
(gradients kept, accumulated, or referenced elsewhere) gets a buffer of its own from the pinned allocator for
that step, as before, so no value anyone can still read is ever overwritten.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .host_masters import HostMasterParam
from .param import FSDPParam
from .pinned import host_buffer

FSDPParamGroup = Any  # the group (group.py imports this module: no import back)

ALIGN = 64  # bytes: every dtype's alignment, and a cache line


@dataclass(frozen=True)
class HostArena:
    """A group's host buffer and how it was pinned."""

    buffer: torch.Tensor  # (nbytes,) uint8: every packed parameter's host tensor is a view of it
    pinning: str  # "registered" (exact bytes), "allocator" (torch's pinned allocator), or "none"

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


def host_tensor(param: FSDPParam) -> torch.Tensor | None:
    """The host tensor of ``param`` that the group's buffer holds, or None (not offloaded, hooked, HFSDP)."""
    if type(param) is HostMasterParam:
        return param.host_padded
    if type(param) is FSDPParam and param.offload_to_cpu and param.extension is None:
        return param.padded_shard
    return None


def pack_host_shards(group: FSDPParamGroup, arena: HostArena | None) -> HostArena | None:
    """``arena`` if every host tensor of ``group`` is still in it; else a new buffer holding them all (the
    parameters adopting its views), or None when the group has none on the host ([Note: one host buffer per group])."""
    members = [(param, tensor) for param in group.params if (tensor := host_tensor(param)) is not None]
    if not members or any(tensor.device.type != "cpu" for _, tensor in members):
        return None  # not offloaded, or not materialized yet (meta): packed once to_empty made them
    if arena is not None and all(_inside(tensor, arena.buffer) for _, tensor in members):
        return arena
    offsets, total = [], 0
    for _, tensor in members:
        offsets.append(total)
        total += -(-tensor.nbytes // ALIGN) * ALIGN
    buffer, pinning = exact_host_bytes(total, members[0][0].pin_memory)
    for (param, tensor), offset in zip(members, offsets):
        view = buffer.narrow(0, offset, tensor.nbytes).view(tensor.dtype).view(tensor.shape)
        _adopt(param, view.copy_(tensor))
    return HostArena(buffer, pinning)


@dataclass(frozen=True)
class GradBuffer:
    """A group's reduced-gradient host buffer: its bytes, the typed view handed out, and the storage's use
    count when nothing else holds it."""

    raw: torch.Tensor
    typed: torch.Tensor
    free_count: int
    pinning: str  # as HostArena's


_grad_buffers: weakref.WeakKeyDictionary[Any, GradBuffer] = weakref.WeakKeyDictionary()  # by the group's first param


def grad_buffer(group: FSDPParamGroup) -> GradBuffer | None:
    """``group``'s reduced-gradient host buffer, once a backward made it (benchmarks and tests read it)."""
    return _grad_buffers.get(group.params[0])


def host_grad_buffer(params: tuple[FSDPParam, ...], numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A ``(numel,)`` host buffer for a group's reduced gradients: the group's own, exact and pinned when asked,
    when nothing holds it any more; else one of the pinned allocator's for this step only."""
    kept = _grad_buffers.get(params[0])
    if kept is not None and kept.typed.numel() == numel and kept.typed.dtype == dtype:
        if _use_count(kept.typed) == kept.free_count:
            return kept.typed
        return host_buffer((numel,), dtype, pin)  # still held: never overwrite what someone can read
    raw, pinning = exact_host_bytes(numel * dtype.itemsize, pin)
    typed = raw.view(dtype)
    _grad_buffers[params[0]] = GradBuffer(raw, typed, _use_count(typed), pinning)
    return typed


def _use_count(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage (every view holds one); -1 where torch does not say (never reused)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return -1 if counter is None else int(counter(tensor.untyped_storage()._cdata))


def exact_host_bytes(nbytes: int, pin: bool) -> tuple[torch.Tensor, str]:
    """``nbytes`` of host memory (uint8) and how it is pinned: registered with the driver at exactly that size
    when ``pin`` and CUDA allow, else torch's pinned allocator, else pageable ([Note: one host buffer per group])."""
    if not pin or nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8), "none"
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if _register(buffer):
        return buffer, "registered"
    buffer = host_buffer((nbytes,), torch.uint8, pin=True)  # warns once when pinning fails: [Note: pinning fails]
    return buffer, "allocator" if buffer.is_pinned() else "none"


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer``'s bytes in place (``cudaHostRegister``); unlocked when it is dropped."""
    try:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
    except (AttributeError, RuntimeError, OSError):
        return False
    if int(error) != 0:
        return False
    weakref.finalize(buffer, _unregister, cudart, buffer.untyped_storage(), buffer.data_ptr())
    return True


def _unregister(cudart: Any, storage: Any, pointer: int) -> None:
    cudart.cudaHostUnregister(pointer)  # ``storage`` rides along: the bytes outlive their registration
    del storage


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
    same = tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return same and start <= tensor.data_ptr() <= end  # <=: a tensor of no bytes may sit at the end


def _adopt(param: FSDPParam, view: torch.Tensor) -> None:
    """Point ``param`` (and its registered DTensor) at ``view``, its host tensor's new home."""
    if isinstance(param, HostMasterParam):
        param.host_padded = view
        param.local_view = view.narrow(param.shard_dim, 0, param.local_rows)
    else:
        param._adopt_padded_shard(view)
    param.sharded_param._local_tensor = param.local_view  # type: ignore[attr-defined]
