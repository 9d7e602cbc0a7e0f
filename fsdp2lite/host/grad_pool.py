"""The host buffers a root's reduced gradients land in under CPU offload: one pool per root, reused step after
step.

[Note: host gradient buffers]
Under CPU offload a group's reduced gradients are copied to the host in one piece, and its sharded gradients are
views of that host buffer (the group's host storage's ``after_reduce``, [Note: host storage] in
_runtime/host_storage.py). The buffers come from one
pool per root, the host engine's ``HostGradPool``, made like the groups' shard buffers (``exact_host_bytes``:
registered with the driver at exactly their bytes, [Note: one host buffer per group] in _runtime/host_arena.py).
A buffer is free when nothing but the pool holds its storage (its use count is the one it had when made): every
gradient that viewed it was set to None, so no one can read what the next copy overwrites. A request takes the
smallest free buffer that is big enough; when none is, the free ones (all too small) are dropped and a buffer of
exactly the bytes asked for is made.
So:
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
thread of their own ([Note: host steps off backward's thread] in steps.py): a request that finds no free
buffer waits for those steps first, since each frees its group's buffer; so stepping off backward's thread
still needs one buffer, not one per step in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsdp2lite._runtime.pinned import exact_host_bytes, use_count


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
            free, fits = self._free(nbytes, pin)  # [Note: host steps off backward's thread] in steps.py
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
