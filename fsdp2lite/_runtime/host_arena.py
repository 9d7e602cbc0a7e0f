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
The buffer is the group's for its life, held by its host storage ([Note: host storage] in host_storage.py): the
optimizer steps into it, the all-gather copies out of it, every step. Hooked parameters (a tensor subclass with
all-gather hooks, such as NF4) and HFSDP's replica-sharded ones keep buffers of their own.

The reduced gradients' host buffers are made the same exact way, but shared by the groups of a root rather
than one per group ([Note: host gradient buffers] in ``pinned.py``): with gradients kept until
``optimizer.step()`` that is one buffer per group as before; with them dropped as each group steps
(``fsdp2lite.step_in_backward``), one buffer the size of the largest group's gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .param import FSDPParam
from .pinned import exact_host_bytes
from .seams import GroupView

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
    return param.storage.host_tensor(param)


def pack_host_shards(group: GroupView, arena: HostArena | None, pin: bool) -> HostArena | None:
    """``arena`` if every host tensor of ``group`` is still in it; else a new buffer holding them all (the
    parameters adopting its views; pinned when ``pin``), or None when the group has none on the host
    ([Note: one host buffer per group])."""
    members = [(param, tensor) for param in group.params if (tensor := host_tensor(param)) is not None]
    if not members or any(tensor.device.type != "cpu" for _, tensor in members):
        return None  # not offloaded, or not materialized yet (meta): packed once to_empty made them
    if arena is not None and all(_inside(tensor, arena.buffer) for _, tensor in members):
        return arena
    offsets, total = [], 0
    for _, tensor in members:
        offsets.append(total)
        total += -(-tensor.nbytes // ALIGN) * ALIGN
    buffer, pinning = exact_host_bytes(total, pin)
    for (param, tensor), offset in zip(members, offsets):
        view = buffer.narrow(0, offset, tensor.nbytes).view(tensor.dtype).view(tensor.shape)
        param.adopt_host(view.copy_(tensor))
    return HostArena(buffer, pinning)


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
    same = tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return same and start <= tensor.data_ptr() <= end  # <=: a tensor of no bytes may sit at the end
