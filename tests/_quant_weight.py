"""A tensor subclass with torch's all-gather extension hooks, for tests: an fp32 weight whose all-gather
sends int8 values and one fp32 scale per row, dequantized into the compute dtype after the gather (the
shape of torchao's float8/NF4 weights, small enough to read)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map, tree_map_only

aten = torch.ops.aten
# ops that make another piece of the same weight (sharding, padding, views): results stay QuantWeights
_KEEP = {aten.split.Tensor, aten.new_zeros.default, aten.slice.Tensor, aten.view.default, aten.detach.default,
         aten.alias.default, aten._to_copy.default, aten.clone.default, aten.as_strided.default}  # fmt: skip


class QuantWeight(torch.Tensor):
    calls: dict[str, int] = {"pre": 0, "post": 0, "post_out": 0}  # across instances: what the hooks saw

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> QuantWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"QuantWeight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        unwrap = lambda t: t._data if isinstance(t, QuantWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func is aten.copy_.default:
            return args[0]
        if func in _KEEP:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        QuantWeight.calls["pre"] += 1
        data = self._data
        scale = data.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        values = torch.round(data / scale).to(torch.int8)
        return (values, scale), (tuple(outer_size),)

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        values, scale = outputs
        dequantized = values.to(param_dtype) * scale.to(param_dtype)
        if out is not None:
            QuantWeight.calls["post_out"] += 1
            out.data.copy_(dequantized[: out.shape[0]])  # .data: autograd's saved copy must not see a new version
            return None
        QuantWeight.calls["post"] += 1
        return dequantized, (dequantized,)


def quantize_linears(model: torch.nn.Module) -> None:
    """Every Linear's weight becomes a frozen QuantWeight (a quantized base model, QLoRA's shape)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(QuantWeight(module.weight.detach().clone()), requires_grad=False)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """What the all-gather hooks deliver for this (unsharded) fp32 weight."""
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(weight / scale).to(torch.int8).float() * scale
