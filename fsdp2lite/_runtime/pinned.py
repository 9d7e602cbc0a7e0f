"""Host buffers of CPU offload: pinned when asked (at their exact size where the driver allows), pageable when
pinning fails. (The pool the reduced gradients land in is the host engine's: ``fsdp2lite/host/grad_pool.py``.)

[Note: pinning fails]
Pinning page-locks host memory so that copies to and from a CUDA device run asynchronously; it can fail
where a board or driver limits locked memory (pytorch#157146, axolotl#2409), or when the host is short of
it. A job that asked for pinned buffers then keeps going on pageable memory instead of dying: the copies
become synchronous (slower offload, the same values), and one warning says so, with the bytes and the
error, the first time it happens in the process.
"""

from __future__ import annotations

import warnings
import weakref
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
