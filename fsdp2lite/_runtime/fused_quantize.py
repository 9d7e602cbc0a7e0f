"""The quantized collectives' encode and decode as fused kernels on CUDA ([Note: fused quantize kernels]).

[Note: fused quantize kernels]
``quantize.encode`` and ``quantize.decode`` are a few eager ops each: an ``aminmax`` over the blocks, a
division, rounding and clamping, a cast (encode); a multiply by the scales and a cast (decode). On a GPU each
is a kernel reading and writing the whole group: measured on an H100 at fake world 8 (944M GPT, int8), the
decode's ``aten::mul`` alone took 250 µs per group and the quantized all-gather cost 11% of the step
(``../shared/evidence/gpu-2026-11-24``). On a CUDA device they run instead as ``torch.compile``d functions of the
same code: Inductor fuses each into one pass over memory (the reduction and the pointwise ops of the encode in
one kernel; the decode's multiply and cast in one). The arithmetic is the same IEEE operations in the same
order (a true division, round-half-to-even, the same casts), so the codes and scales are bit-identical to the
eager ones: ``tests/test_fused_quantize.py`` checks that on CPU through Inductor's C++ backend, and a ``gpu``
test on CUDA (not yet run on a GPU). CPU keeps the eager ops (``FUSED_DEVICES``). A compile that fails (no
Triton, an unsupported op on an old torch) warns once and the process goes on with the eager ops; the
values are the same either way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

FUSED_DEVICES = ("cuda",)  # device types whose encode and decode run compiled (tests add "cpu")

_compiled: dict[str, Callable[..., Any]] = {}  # "encode"/"decode" -> the compiled function, made at first use
_failed: list[str] = []  # a compile failed in this process: the eager ops from then on


def run_fused(name: str, eager: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``eager(tensor, *args, **kwargs)`` (``quantize.encode`` or ``decode``), compiled into fused kernels where
    ``tensor`` lives on a device in ``FUSED_DEVICES`` ([Note: fused quantize kernels])."""
    if tensor.device.type not in FUSED_DEVICES or _failed:
        return eager(tensor, *args, **kwargs)
    compiled = _compiled.get(name)
    if compiled is None:
        compiled = _compiled[name] = torch.compile(eager, fullgraph=True)
    try:
        return compiled(tensor, *args, **kwargs)
    except Exception as exc:  # compiling failed: the eager ops give the same values
        _failed.append(name)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(
            f"fsdp2lite: compiling the quantized collectives' {name} for {tensor.device.type} failed ({reason}); "
            "using the eager ops from now on (the same values, more kernels)",
            RuntimeWarning,
            stacklevel=3,
        )
        return eager(tensor, *args, **kwargs)
