"""Host buffers of CPU offload: pinned when asked (at their exact size where the driver allows), pageable when
pinning fails, and the pool the reduced gradients land in.

[Note: pinning fails]
Pinning page-locks host memory so that copies to and from a CUDA device run asynchronously; it can fail
where a board or driver limits locked memory (pytorch#157146, axolotl#2409), or when the host is short of
it. A job that asked for pinned buffers then keeps going on pageable memory instead of dying: the copies
become synchronous (slower offload, the same values), and one warning says so, with the bytes and the
error, the first time it happens in the process.

[Note: host gradient buffers]
Under CPU offload a group's reduced gradients are copied to the host in one piece, and its sharded gradients
are views of that host buffer (``accumulate_sharded_grads`` in reduce.py). The buffers come from one pool
per root, ``Comm.host_grads``, made like the groups' shard buffers (``exact_host_bytes``: registered with the
driver at exactly their bytes, [Note: one host buffer per group] in host_arena.py). A buffer is free when
nothing but the pool holds its storage (its use count is the one it had when made): every gradient that
viewed it was set to None, so no one can read what the next copy overwrites. A request takes the smallest
free buffer that is big enough; when none is, the free ones (all too small) are dropped and a buffer of
exactly the bytes asked for is made. So:
- gradients kept until ``optimizer.step()``, ``zero_grad()`` between steps: each group holds its buffer from
  its reduction to the step, so the pool keeps one per group, the same group taking the same one every step
  (the exact fit goes first, ties by age): page-locked gradient bytes are the model's shard bytes, exact;
- ``fsdp2lite.step_in_backward``: a group's gradients are dropped by its step, before the next group's
  reduction, so one buffer, the largest group's size, serves them all: page-locked gradient bytes fall from
  the model's shard bytes to the largest group's (torch pins one allocator block per gradient, rounded up to
  a power of two, and keeps every block cached);
- gradients still held at a reduction (accumulated without ``zero_grad``, or ``zero_grad(set_to_none=False)``):
  the reduction lands in another buffer of the pool and is added into them; the pool grows by the buffers in
  use at once, no more.
Reuse is safe on CUDA: a buffer's last reader is the host (the optimizer step, after the end of backward
waited on the copy; ``step_in_backward``'s step, after it waited on the group's copy event), so the next
copy into it is queued after every read of it has finished. ``step_in_backward`` steps offloaded groups on a
thread of their own ([Note: host steps off backward's thread] in host_steps.py): a request that finds no free
buffer waits for those steps first, since each frees its group's buffer; so stepping off backward's thread
still needs one buffer, not one per step in flight.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_warned = False


def host_buffer(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pin: bool, zero: bool = False) -> torch.Tensor:
    """A host tensor of ``shape`` and ``dtype`` (zeroed with ``zero``): pinned when ``pin`` and pinning works,
    else pageable ([Note: pinning fails])."""
    make = torch.zeros if zero else torch.empty
    if pin:
        try:
            return make(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            _warn_once(torch.Size(shape).numel() * dtype.itemsize, exc)
    return make(shape, dtype=dtype)


def _warn_once(nbytes: int, exc: RuntimeError) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    warnings.warn(
        f"fsdp2lite: pinning {nbytes:,} bytes of host memory for CPU offload failed ({reason}); using pageable "
        "memory instead: host-device copies become synchronous (slower offload, the same values). Raise the "
        "locked-memory limit (ulimit -l) or pass CPUOffloadPolicy(pin_memory=False) to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


def exact_host_bytes(nbytes: int, pin: bool) -> tuple[torch.Tensor, str]:
    """``nbytes`` of host memory (uint8) and how it is pinned: registered with the driver at exactly that size
    when ``pin`` and CUDA allow, else torch's pinned allocator, else pageable ([Note: one host buffer per group]
    in host_arena.py)."""
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


def use_count(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage (every view holds one); -1 where torch does not say."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return -1 if counter is None else int(counter(tensor.untyped_storage()._cdata))


@dataclass(eq=False)
class PooledBuffer:
    """One buffer of a ``HostGradPool``: its bytes, whether it was asked pinned and how it was, and the use
    count of its storage when nothing but the pool holds it."""

    raw: torch.Tensor  # (nbytes,) uint8
    pin: bool
    pinning: str  # as exact_host_bytes says: "registered", "allocator" or "none"
    free_count: int  # -1: torch cannot count uses, so the buffer is never reused

    def is_free(self) -> bool:
        return self.free_count >= 0 and use_count(self.raw) == self.free_count


class HostGradPool:
    """The host buffers a root's reduced gradients land in ([Note: host gradient buffers])."""

    buffers: list[PooledBuffer]  # oldest first
    wait_for_readers: Callable[[], bool] | None  # waits for the host steps still reading buffers; True if any were

    def __init__(self, wait_for_readers: Callable[[], bool] | None = None) -> None:
        self.buffers = []
        self.wait_for_readers = wait_for_readers

    def take(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A ``(numel,)`` host tensor of ``dtype`` that nothing else holds: the smallest free buffer that fits,
        or, once the host steps in flight have finished and freed theirs, still none, a new one of exactly its
        bytes (pinned when ``pin``; the free ones too small dropped first)."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)  # holds no buffer: an empty view would keep one from reuse
        free, fits = self._free(nbytes, pin)
        if not fits and self.wait_for_readers is not None and self.wait_for_readers():
            free, fits = self._free(nbytes, pin)  # [Note: host steps off backward's thread] in host_steps.py
        if fits:
            chosen = min(fits, key=lambda buffer: buffer.raw.nbytes)  # the first of equal sizes: the oldest
        else:
            self.buffers = [buffer for buffer in self.buffers if buffer not in free]
            raw, pinning = exact_host_bytes(nbytes, pin)
            chosen = PooledBuffer(raw, pin, pinning, use_count(raw))
            self.buffers.append(chosen)
        return chosen.raw[:nbytes].view(dtype)

    def _free(self, nbytes: int, pin: bool) -> tuple[list[PooledBuffer], list[PooledBuffer]]:
        """The free buffers of ``pin``'s kind, and those of them with room for ``nbytes``."""
        free = [buffer for buffer in self.buffers if buffer.pin == pin and buffer.is_free()]
        return free, [buffer for buffer in free if buffer.raw.nbytes >= nbytes]

    def nbytes(self, pinning: str | None = None) -> int:
        """Bytes the pool holds (of one pinning: "registered", "allocator" or "none")."""
        return sum(b.raw.nbytes for b in self.buffers if pinning is None or b.pinning == pinning)
