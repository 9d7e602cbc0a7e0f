"""Host buffers of CPU offload, pinned when asked, pageable when pinning fails.

[Note: pinning fails]
Pinning page-locks host memory so that copies to and from a CUDA device run asynchronously; it can fail
where a board or driver limits locked memory (pytorch#157146, axolotl#2409), or when the host is short of
it. A job that asked for pinned buffers then keeps going on pageable memory instead of dying: the copies
become synchronous (slower offload, the same values), and one warning says so, with the bytes and the
error, the first time it happens in the process.
"""

from __future__ import annotations

import warnings

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
            _warn_once(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size(), exc)
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
