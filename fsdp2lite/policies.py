"""Policies as immutable, validated data (pydantic v2, frozen, extra="forbid").

Dtype fields take a ``torch.dtype`` or one of its names and always hold a ``torch.dtype``:
``bf16|bfloat16``, ``fp16|float16|half``, ``fp32|float32|float``.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema

DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_CANONICAL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def parse_dtype(value: Any) -> torch.dtype | None:
    """The one place strings become dtypes. ``None`` stays ``None`` (meaning: no cast)."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value not in _CANONICAL:
            raise ValueError(f"dtype {value} is not supported; use one of {sorted(set(_CANONICAL.values()))}")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise ValueError(f"{value!r} is not a dtype; valid names: {', '.join(DTYPE_NAMES)}")


DType = Annotated[
    torch.dtype | None,
    BeforeValidator(parse_dtype),
    PlainSerializer(lambda d: None if d is None else _CANONICAL[d], return_type=str | None),
    WithJsonSchema({"anyOf": [{"type": "string", "enum": list(DTYPE_NAMES)}, {"type": "null"}]}),
]

_FROZEN = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class MixedPrecisionPolicy(BaseModel):
    """Which dtypes the all-gather, compute, gradient reduction and outputs use."""

    model_config = _FROZEN

    param_dtype: DType = Field(
        None,
        description="dtype of the unsharded parameters: the all-gather and the forward/backward "
        "compute run in it. None keeps the parameters' own dtype.",
    )
    reduce_dtype: DType = Field(
        None,
        description="dtype of the gradient reduce-scatter (and HSDP all-reduce). None uses param_dtype.",
    )
    output_dtype: DType = Field(
        None, description="dtype that floating-point forward outputs are cast to. None: no cast."
    )
    cast_forward_inputs: bool = Field(True, description="cast floating-point forward inputs to param_dtype.")


class OffloadPolicy(BaseModel):
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""

    model_config = _FROZEN


class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; copy to the device for each all-gather."""

    pin_memory: bool = Field(
        True,
        description="pin the host shards so host-to-device copies are asynchronous (needs CUDA).",
    )


def cast_dtype(param: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a policy casts ``param`` to: ``dtype`` for floating-point parameters (None keeps theirs),
    integer and bool parameters always keep their own."""
    return dtype if dtype is not None and param.is_floating_point() else param.dtype
