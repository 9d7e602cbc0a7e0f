"""An NF4 weight held by rows, so that fsdp2lite shards it over any number of ranks.

[Note: NF4 padded by rows]
torchao's ``NF4Tensor`` shards by chunking its flat inner tensors: codes (2 per byte), int8 block scales
(one per 64 values) and the scales' factors (one per 256 scales, 64 * 256 = 16384 values). A chunk is a
valid NF4 tensor only when it holds whole 16384-value units, so torchao's own sharding needs the rows to
divide by the shard degree and each chunk to hold a multiple of 16384 values: Llama-3-70B's 8192 rows do
not divide by 3. ``NF4Rows`` holds the same bytes by rows instead:

    codes    (rows, columns / 2)   uint8: torchao's ``quantized_data``, a row's codes in a row
    scalers  (rows, columns / 64)  int8: torchao's ``quantized_scalers``, a row's block scales in a row
    whole    the weight's shape, its scale factors (numel / 16384), the scale mean, the 16-code table

With columns a multiple of 64 a row holds whole scale blocks, so any run of rows is a valid piece and
fsdp2lite shards it as it shards every parameter (``torch.chunk`` by rows, a rank's share padded with zero
rows to ``ceil(rows / degree)``: [Note: padded shard] in _runtime/layout.py). The factors are not split:
a factor's 256 scales may straddle two ranks, so every piece keeps the whole weight's (1/16384 of the
values, 8 MiB in bf16 for a 70B) by reference. The all-gather moves codes and scales, padding included:

    rows 10, degree 3: ranks hold rows [0, 4), [4, 8), [8, 10) + 2 zero rows
    all-gather -> codes (12, columns / 2), scalers (12, columns / 64); the first 10 rows are to_nf4's bytes

and the post-all-gather hook builds an ``NF4Weight`` on the first ``rows`` rows of the gathered buffers with
the whole factors and mean: byte for byte ``to_nf4`` of the whole weight, which fsdp2lite's own ``NF4Linear``
computes with, dequantizing it without weight-sized temporaries ([Note: NF4 dequantized in pieces] in
nf4_linear.py). ``qlora.quantize_base`` makes every QLoRA base weight this form, whatever the shard degree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .nf4_linear import NF4Weight
from .nf4_whole import BLOCK_SIZE, SCALER_BLOCK_SIZE, WholeNF4

aten = torch.ops.aten


class NF4Rows(torch.Tensor):
    """An NF4 weight (or a run of its rows) whose codes and block scales are held by rows, sharded by
    fsdp2lite at any shard degree through torch's all-gather hooks ([Note: NF4 padded by rows])."""

    codes: torch.Tensor  # (rows, columns // 2) uint8
    scalers: torch.Tensor  # (rows, columns // 64) int8
    whole: WholeNF4

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scalers: torch.Tensor, whole: WholeNF4) -> NF4Rows:
        shape = (codes.shape[0], whole.shape[1])
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, shape, dtype=whole.dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes: torch.Tensor, scalers: torch.Tensor, whole: WholeNF4) -> None:
        self.codes, self.scalers, self.whole = codes, scalers, whole

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"NF4Rows(rows={self.shape[0]}, of {tuple(self.whole.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        """The ops that shard, pad, move and copy it, applied to codes and scales alike; any other is refused."""
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{func} on an NF4Rows (a QLoRA base weight held by rows): it is sharded, moved and all-gathered "
                "whole; dequantize a gathered weight (an NF4Tensor) to compute with it"
            )
        return handler(func, *args, **(kwargs or {}))

    def __tensor_flatten__(self) -> tuple[list[str], WholeNF4]:
        return ["codes", "scalers"], self.whole

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], whole: WholeNF4, *_: Any) -> NF4Rows:
        return NF4Rows(inner["codes"], inner["scalers"], whole)

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], None]:
        """This rank's (padded) rows of codes and of block scales, as they are."""
        return (self.codes, self.scalers), None

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: Any = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The whole weight as an ``NF4Weight`` on the gathered ``(degree * padded_rows, ...)`` codes and
        scales, their padding rows left out ([Note: NF4 matmul]); refilled (``out``): it already views these
        buffers."""
        codes, scalers = outputs
        if out is not None:
            return None
        rows = self.whole.shape[0]
        return NF4Weight(codes[:rows], scalers[:rows], self.whole), (codes, scalers)


def nf4_tensor(quantized_data: torch.Tensor, quantized_scalers: torch.Tensor, whole: WholeNF4) -> Any:
    """torchao's NF4Tensor of the whole weight from its flat codes and int8 scales (views, not copies)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor as nf4

    shape = whole.shape
    meta = nf4.SubclassTensorArgs(shape, (shape[1], 1), 0, whole.dtype, quantized_data.device, False)
    n_blocks = shape.numel() // BLOCK_SIZE
    factor, mean = whole.quantization_factor, whole.scaler_mean
    return nf4.NF4Tensor(
        meta, BLOCK_SIZE, n_blocks, SCALER_BLOCK_SIZE, quantized_scalers, factor, mean, quantized_data, whole.nf4
    )


def rows_of(quantized: Any) -> NF4Rows:
    """A whole torchao NF4Tensor (``to_nf4``'s, 2D, columns a multiple of 64) held by rows."""
    rows, columns = quantized.shape
    whole = WholeNF4(
        quantized.shape, quantized.dtype, quantized.quantization_factor, quantized.scaler_mean, quantized.nf4
    )
    codes = quantized.quantized_data.view(rows, columns // 2)
    return NF4Rows(codes, quantized.quantized_scalers.view(rows, columns // BLOCK_SIZE), whole)


def _each(rows: NF4Rows, op: Any, whole: WholeNF4 | None = None) -> NF4Rows:
    return NF4Rows(op(rows.codes), op(rows.scalers), whole or rows.whole)


def _same(func: Any, self: NF4Rows, *args: Any, **kwargs: Any) -> NF4Rows:  # detach, alias, clone, pin
    return _each(self, lambda t: func(t, *args, **kwargs))


def _split(func: Any, self: NF4Rows, sizes: Any, dim: int = 0) -> list[NF4Rows]:  # torch.chunk's
    _rows_only(func, dim)
    pieces = zip(func(self.codes, sizes), func(self.scalers, sizes))
    return [NF4Rows(codes, scalers, self.whole) for codes, scalers in pieces]


def _slice(func: Any, self: NF4Rows, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> NF4Rows:
    _rows_only(func, dim)
    return _each(self, lambda t: func(t, 0, start, end, step))


def _rows_only(func: Any, dim: int) -> None:
    if dim != 0:
        raise NotImplementedError(f"{func} along dim {dim} of an NF4Rows: it is split by rows (dim 0) only")


def _new_zeros(func: Any, self: NF4Rows, size: Any, **kwargs: Any) -> NF4Rows:  # a padded shard
    rows, columns = size
    if columns != self.whole.shape[1]:
        raise NotImplementedError(f"new_zeros({list(size)}) of an NF4Rows of {self.whole.shape[1]} columns")
    device = kwargs.get("device") or self.codes.device
    codes = self.codes.new_zeros((rows, columns // 2), device=device)
    return NF4Rows(codes, self.scalers.new_zeros((rows, columns // BLOCK_SIZE), device=device), self.whole)


def _empty_like(func: Any, self: NF4Rows, **kwargs: Any) -> NF4Rows:  # to_empty's
    device = kwargs.get("device") or self.codes.device
    return _each(self, lambda t: torch.empty_like(t, device=device), self.whole.to(torch.device(device)))


def _to_copy(func: Any, self: NF4Rows, **kwargs: Any) -> NF4Rows:  # .to(device), .cpu(): the constants follow
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        raise NotImplementedError(f"an NF4 base weight cannot be cast to {dtype}: it stays NF4 ({self.dtype} compute)")
    device = torch.device(kwargs.get("device") or self.codes.device)
    non_blocking = kwargs.get("non_blocking", False)
    return _each(self, lambda t: t.to(device, non_blocking=non_blocking), self.whole.to(device))


def _copy(func: Any, self: NF4Rows, source: Any, non_blocking: bool = False) -> NF4Rows:
    if not isinstance(source, NF4Rows) or source.shape != self.shape:
        got = f"{type(source).__name__} {tuple(source.shape)}"
        raise NotImplementedError(
            f"copy_ into an NF4Rows {tuple(self.shape)} takes an NF4Rows of that shape, not {got}"
        )
    self.codes.copy_(source.codes, non_blocking=non_blocking)
    self.scalers.copy_(source.scalers, non_blocking=non_blocking)
    return self


def _is_pinned(func: Any, self: NF4Rows, device: Any = None) -> bool:
    return bool(self.codes.is_pinned())


def _view(func: Any, self: NF4Rows, size: Any, *rest: Any) -> NF4Rows:  # only as itself (nn.Parameter, as_strided)
    if tuple(size) != tuple(self.shape) or any(rest[1:]):  # as_strided: (stride, offset)
        raise NotImplementedError(f"{func} of an NF4Rows {tuple(self.shape)} as {tuple(size)}")
    return _each(self, lambda t: t.view(t.shape))


_OPS: dict[Any, Callable[..., Any]] = {
    aten.detach.default: _same,
    aten.alias.default: _same,
    aten.clone.default: _same,
    aten._pin_memory.default: _same,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.empty_like.default: _empty_like,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy,
    aten.is_pinned.default: _is_pinned,
    aten.view.default: _view,
    aten.as_strided.default: _view,
}
