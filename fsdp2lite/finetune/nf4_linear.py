"""A gathered NF4 base weight and its matmul, dequantized by fsdp2lite without weight-sized temporaries.

[Note: NF4 dequantized in pieces]
torchao's ``NF4Tensor.get_original_weight`` dequantizes a whole weight at once: two int64 index tensors of
half its values each (8 bytes a code), the two looked-up halves, the scaled halves and the interleaved result.
For Llama-3-70B's 28672 x 8192 MLP weights that is about 3 GiB of temporaries for a 0.44 GiB result, live at
every matmul of a QLoRA layer (measured on CPU and on an H200: ``../shared/evidence/gpu-2026-11-28/``).
``dequantize`` computes the same values, bit for bit, with none of that:

    pairs  (256, 2)   the two NF4 values of every code byte (high nibble first), in the compute dtype
    scales (rows, columns / 64)  each block's scale: torchao's own expression, int8 / factor + mean (small)
    value[r, 64 b + j] = pairs[codes[r, 32 b + j // 2], j % 2] * scales[r, b]

On CUDA one compiled kernel (``torch.compile`` of that expression: the look-up and the multiply fused, no
temporaries beside the block scales); elsewhere, eager, in runs of rows of at most ``PIECE_VALUES`` values,
each looked up into the result itself (``index_select(out=)``) and scaled in place: one run's int32 index (2
bytes a value of the run, 32 MiB at most) is all it holds beside the result and the scales
(``dequantize_bytes``: measured by ``tests/test_founding.py``'s allocator count). On fake tensors (the
planner's traced step) only the first run is made: the runs hold no values there, and the first, the
largest, is what the loop holds at any moment.

[Note: NF4 matmul]
``NF4Weight`` is what a QLoRA layer computes with while its group is gathered: ``F.linear(x, weight)`` runs
``NF4Linear``, which dequantizes the weight to the input's dtype for the matmul and lets it go (autograd keeps
only the 4-bit weight), and in backward dequantizes it again for the input's gradient (a frozen base has no
weight gradient). torchao's ``linear_nf4`` does the same with its own dequantization.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from .nf4_whole import BLOCK_SIZE, SCALER_BLOCK_SIZE, WholeNF4

aten = torch.ops.aten
KERNEL_ENV = "FSDP2LITE_NF4_KERNEL"  # compiled | eager: overrides the device's choice (``compiled_kernel``)
PIECE_VALUES = 16 * 2**20  # values dequantized at once on the eager path ([Note: NF4 dequantized in pieces])
PIECE_BYTES_PER_VALUE = 2  # its temporary: an int32 index per two values (written into the result in place)
SCALE_BYTES = 2  # a block scale, kept in the compute dtype while its weight is dequantized
SCALE_MAKING_BYTES = 4  # while the scales are made: int8 / factor, then + mean, each in the compute dtype


def block_scales(scalers: torch.Tensor, whole: WholeNF4) -> torch.Tensor:
    """Each 64-value block's scale ``(rows, columns / 64)`` in the compute dtype: torchao's
    ``dequantize_scalers`` expression on the whole weight's int8 ``scalers``."""
    count = scalers.numel()
    flat = scalers.reshape(-1)
    if count % SCALER_BLOCK_SIZE:  # only a planned weight (fake, of a shape to_nf4 refuses) is not whole units
        flat = F.pad(flat, (0, SCALER_BLOCK_SIZE - count % SCALER_BLOCK_SIZE))
    units = flat.view(-1, SCALER_BLOCK_SIZE)  # (blocks / 256, 256)
    scales = (units / whole.quantization_factor.unsqueeze(-1)).flatten().to(whole.dtype) + whole.scaler_mean
    return scales[:count].view(scalers.shape)


def code_pairs(whole: WholeNF4) -> torch.Tensor:
    """The two NF4 values of every code byte, ``(256, 2)``: high nibble (the even value) first."""
    codes = torch.arange(256, device=whole.nf4.device)
    return torch.stack((whole.nf4[codes >> 4], whole.nf4[codes & 0b1111]), dim=1)


def _lookup_scale(codes: torch.Tensor, scales: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``(rows, columns / 2)`` codes -> ``(rows, columns)`` values: every code's two values times its block's scale."""
    rows = codes.shape[0]
    values = pairs[codes.int()]  # (rows, columns / 2, 2)
    return (values.view(rows, -1, BLOCK_SIZE) * scales.unsqueeze(-1)).view(rows, -1)


@functools.cache
def _fused() -> Any:
    """``_lookup_scale`` as one compiled kernel (CUDA): [Note: NF4 dequantized in pieces]."""
    return torch.compile(_lookup_scale, dynamic=True, fullgraph=True)


def compiled_kernel(device: torch.device) -> bool:
    """Whether NF4 weights on ``device`` dequantize in one compiled kernel: on CUDA, unless ``FSDP2LITE_NF4_KERNEL``
    says ``eager``; elsewhere only if it says ``compiled`` (a CPU run standing for a GPU's, as
    ``benchmarks/bench_founding.py`` makes)."""
    choice = os.environ.get(KERNEL_ENV, "")
    if choice not in ("", "compiled", "eager"):
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected compiled or eager (or unset: compiled on CUDA)")
    return choice == "compiled" or (choice == "" and device.type == "cuda")


def dequantize(codes: torch.Tensor, scalers: torch.Tensor, whole: WholeNF4, fused: bool | None = None) -> torch.Tensor:
    """The weight ``(rows, columns)`` in its compute dtype from its codes ``(rows, columns / 2)`` and int8 block
    scales ``(rows, columns / 64)``: byte for byte torchao's ``get_original_weight`` ([Note: NF4 dequantized in
    pieces]). ``fused``: one compiled kernel (default: ``compiled_kernel``), else eager runs of rows."""
    scales = block_scales(scalers, whole)
    pairs = code_pairs(whole)
    fake = isinstance(codes, FakeTensor)  # the planner's traced step: the eager ops, shapes only
    if (fused if fused is not None else compiled_kernel(codes.device)) and not fake:
        return _fused()(codes, scales, pairs)
    rows, half = codes.shape
    out = torch.empty((rows, 2 * half), dtype=whole.dtype, device=codes.device)
    step = max(1, PIECE_VALUES // max(1, 2 * half))  # rows per piece
    # fake tensors hold no values: the first piece (the largest) is the whole of what the loop holds at once
    for start in range(0, min(rows, step) if fake else rows, step):
        piece = out[start : start + step]  # (piece_rows, columns), written in place
        # each code's two values; an int32 index is gathered from as it is, and freed before the next piece's
        torch.index_select(pairs, 0, codes[start : start + step].reshape(-1).int(), out=piece.view(-1, 2))
        piece.view(piece.shape[0], -1, BLOCK_SIZE).mul_(scales[start : start + step].unsqueeze(-1))
    return out


def dequantize_bytes(shape: tuple[int, ...] | torch.Size, compiled: bool) -> int:
    """The most dequantizing a weight of ``shape`` holds beside its result: the block scales (two of each while
    they are made), and on the eager path one piece's int32 index ([Note: NF4 dequantized in pieces])."""
    rows, columns = shape
    scales = rows * columns // BLOCK_SIZE
    making = scales * SCALE_MAKING_BYTES  # the quotient and the sum, before the quotient is freed
    if compiled:
        return making
    step = max(1, PIECE_VALUES // max(1, columns))
    return max(making, scales * SCALE_BYTES + min(rows, step) * columns * PIECE_BYTES_PER_VALUE)


class NF4Weight(torch.Tensor):
    """A whole NF4 weight while its group is gathered: codes and block scales (views of the all-gather's
    buffers) and what the weight shares ([Note: NF4 matmul]). Matmuls dequantize it; it is never written."""

    codes: torch.Tensor  # (rows, columns // 2) uint8
    scalers: torch.Tensor  # (rows, columns // 64) int8
    whole: WholeNF4

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scalers: torch.Tensor, whole: WholeNF4) -> NF4Weight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, whole.shape, dtype=whole.dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes: torch.Tensor, scalers: torch.Tensor, whole: WholeNF4) -> None:
        self.codes, self.scalers, self.whole = codes, scalers, whole

    def __repr__(self) -> str:  # type: ignore[override]
        return f"NF4Weight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], WholeNF4]:
        return ["codes", "scalers"], self.whole

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], whole: WholeNF4, *_: Any) -> NF4Weight:
        return NF4Weight(inner["codes"], inner["scalers"], whole)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in ``dtype`` (default: its compute dtype)."""
        weight = dequantize(self.codes, self.scalers, self.whole)
        return weight if dtype is None or dtype == weight.dtype else weight.to(dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_nf4(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        """Aliases of itself (detach, an as_strided or view to its own shape) and casts (dequantized); any
        other op is refused by name."""
        kwargs = kwargs or {}
        self = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return NF4Weight(self.codes, self.scalers, self.whole)
        if func in (aten.view.default, aten.as_strided.default) and tuple(args[1]) == tuple(self.shape):
            return NF4Weight(self.codes, self.scalers, self.whole)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype"}:
            return self.dequantize(kwargs.get("dtype"))
        raise NotImplementedError(
            f"{func} on an NF4Weight (a gathered QLoRA base weight): it is multiplied by F.linear, cast with "
            ".to(dtype) or dequantize(), and never written"
        )


class NF4Linear(torch.autograd.Function):
    """``F.linear`` with an ``NF4Weight`` ([Note: NF4 matmul])."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.weight = weight  # the 4-bit weight only; no dequantized copy outlives this call
        ctx.has_bias = bias is not None
        return F.linear(input, weight.dequantize(input.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        grad_input = grad_output @ ctx.weight.dequantize(grad_output.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad_output.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias


def linear_nf4(input: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for a gathered NF4 weight."""
    return NF4Linear.apply(input, weight, bias)  # type: ignore[no-any-return]
