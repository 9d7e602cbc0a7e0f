"""Policies as immutable, validated data (pydantic v2, frozen, extra="forbid").

Dtype fields take a ``torch.dtype`` or one of its names and always hold a ``torch.dtype``:
``bf16|bfloat16``, ``fp16|float16|half``, ``fp32|float32|float``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Protocol

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    field_validator,
    model_validator,
)

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


def short_dtype_name(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16``, ``fp32`` (the YAML spelling); other dtypes by torch's name (``int8``)."""
    return _CANONICAL.get(dtype, str(dtype).removeprefix("torch."))


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Fields by keyword, or positionally in torch's dataclass order
        (``MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, True)``)."""
        super().__init__(**_positional("MixedPrecisionPolicy", _MP_FIELDS, args, kwargs))

    @model_validator(mode="before")
    @classmethod
    def _from_torch(cls, value: Any) -> Any:
        """torch's ``MixedPrecisionPolicy`` dataclass, where a policy is expected (e.g. inside FSDPConfig)."""
        if _is_torch_policy(value, "MixedPrecisionPolicy"):
            return {name: getattr(value, name) for name in _MP_FIELDS}
        return value


_MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _positional(name: str, fields: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional arguments as keywords, in ``fields`` order (torch's policies are dataclasses)."""
    if len(args) > len(fields):
        raise TypeError(
            f"{name} takes at most {len(fields)} positional arguments ({', '.join(fields)}), got {len(args)}"
        )
    for field_name, value in zip(fields, args):
        if field_name in kwargs:
            raise TypeError(f"{name} got {field_name} both by position and by keyword")
        kwargs[field_name] = value
    return kwargs


class OffloadPolicy(BaseModel):
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""

    model_config = _FROZEN


class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; copy to the device for each all-gather.
    ``optimizer_only=True`` (ZeRO-Offload's shape, not in torch's): the shards stay on the device and are
    all-gathered from there; the fp32 master shards, their gradients and the optimizer state live (and step)
    on the host, and each group's device shards are refreshed from the masters once after the step."""

    pin_memory: bool = Field(
        True,
        description="pin the host shards so host-to-device copies are asynchronous (needs CUDA).",
    )
    optimizer_only: bool = Field(
        False,
        description="ZeRO-Offload: shards stay on the device; masters, gradients and optimizer state on the host",
    )
    optimizer: Literal["cpu", "nvme"] = Field(
        "cpu",
        description="where the optimizer state lives between steps: cpu (host memory) or nvme (one file per rank "
        "under nvme_path, streamed through the host group by group at each step; ZeRO-Infinity's shape)",
    )
    nvme_path: str | None = Field(
        None, description="with optimizer: nvme, the directory (on a fast local disk) that holds the state files"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``pin_memory`` by keyword or positionally, as torch's dataclass."""
        super().__init__(**_positional("CPUOffloadPolicy", ("pin_memory",), args, kwargs))

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> CPUOffloadPolicy:
        if self.optimizer == "nvme" and not (self.nvme_path or "").strip():
            raise ValueError("optimizer='nvme' keeps the optimizer state in files: give nvme_path (a directory)")
        if self.optimizer == "cpu" and self.nvme_path is not None:
            raise ValueError(
                f"nvme_path={self.nvme_path!r} is only read with optimizer='nvme' (the state stays in host memory "
                "with optimizer='cpu'): set optimizer='nvme' or drop nvme_path"
            )
        return self


class CommPolicy(BaseModel):
    """How a group's collectives encode what they send: fewer bytes on the wire, the same math on both
    ends. The parameters, their gradients, the optimizer and checkpoints stay in their own precision; only
    what crosses the network is quantized, so its error never accumulates in the weights."""

    model_config = _FROZEN

    all_gather: Literal["int8", "fp8"] | None = Field(
        None,
        description="quantize each parameter shard for the all-gather: int8 with one fp32 absmax scale per "
        "block (0.25x fp32's bytes, 0.5x bf16's), or fp8 e4m3 likewise; dequantized into param_dtype after it. "
        "None sends param_dtype.",
    )
    block_size: int = Field(
        256, description="elements per scale block of a quantized collective (one fp32 scale each; 16 .. 65536)"
    )
    reduce_scatter: Literal["all_to_all", "int8"] | None = Field(
        None,
        description="all_to_all: each rank sends rank j its j-th chunk and sums what it receives in "
        "reduce_dtype (half the bytes of gloo's all-reduce); int8: the same with int8 chunks and block scales, "
        "summed in fp32. None: the backend's reduce-scatter (gloo: the in-place all-reduce).",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if isinstance(value, bool) or not 16 <= value <= 65536:
            raise ValueError(f"block_size must be an integer from 16 to 65536, got {value!r}")
        return value

    @field_validator("all_gather")
    @classmethod
    def _fp8_available(cls, value: str | None) -> str | None:
        if value == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(
                f"all_gather='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks; use 'int8'"
            )
        return value

    @property
    def active(self) -> bool:
        return self.all_gather is not None or self.reduce_scatter is not None


class ShardingPolicy(BaseModel):
    """What each mesh axis shards (ZeRO's stages): ``shard: params`` (ZeRO-3, the default: parameters,
    gradients and optimizer state sharded, each group all-gathered before use and freed after) or
    ``optimizer`` (ZeRO-1/2: the unsharded parameters stay resident between steps; gradients are
    reduce-scattered into the sharded masters, the optimizer steps on shards, and each group is all-gathered
    once after the shards change). ``replicate``, on a 2-D (replicate, shard) mesh: ``none`` (HSDP: every
    replica holds whole shards, their gradients all-reduced) or ``optimizer`` (HFSDP: masters and optimizer
    state sharded across the replicas too, gradients reduce-scattered across them, the shards rebuilt by one
    all-gather across them after the step). ``align`` pads each rank's shard to whole blocks of rows ([Note:
    padded shard] in ``_runtime/layout.py``)."""

    model_config = _FROZEN

    shard: Literal["params", "optimizer"] = Field(
        "params", description="params: ZeRO-3 (default); optimizer: ZeRO-1/2, parameters resident between steps"
    )
    replicate: Literal["none", "optimizer"] = Field(
        "none",
        description="none: each replica holds whole shards (HSDP, default); optimizer: masters and optimizer state "
        "sharded across the replicas too (HFSDP, a 2-D mesh)",
    )
    align: int = Field(
        1,
        ge=1,
        strict=True,
        description="each rank's shard padded to a multiple of this many rows (e.g. 256 for block-wise 8-bit "
        "optimizer states or quantization blocks that must not straddle ranks); the rows each rank holds stay "
        "torch.chunk's, so checkpoints and DTensor placements do not change; 1: no padding beyond torch.chunk's",
    )

    @classmethod
    def zero_stage(cls, stage: int) -> ShardingPolicy:
        """DeepSpeed's shorthand for the shard axis: 3 -> params, 1 and 2 -> optimizer (they coincide here: a
        reduce-scatter already leaves each rank only its gradient shard, so ZeRO-1's whole gradients buy nothing)."""
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {stage!r}")
        return cls(shard="params" if stage == 3 else "optimizer")

    @property
    def replica_sharded(self) -> bool:
        """Masters and optimizer state sharded across the replicas (HFSDP)."""
        return self.replicate == "optimizer"

    @property
    def resident(self) -> bool:
        """Parameters stay unsharded between steps (ZeRO-1/2)."""
        return self.shard == "optimizer"


def cast_dtype(param: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a policy casts ``param`` to: ``dtype`` for floating-point parameters (None keeps theirs),
    integer and bool parameters always keep their own."""
    return dtype if dtype is not None and param.is_floating_point() else param.dtype


def reduce_cast_dtype(
    param: torch.Tensor, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> torch.dtype:
    """The dtype ``param``'s gradient is reduced in under a policy's ``param_dtype`` and ``reduce_dtype``
    (``reduce_dtype``, else ``param_dtype``, cast as ``cast_dtype`` casts)."""
    return cast_dtype(param, reduce_dtype if reduce_dtype is not None else param_dtype)


class DtypePolicy(Protocol):
    """A policy's two dtypes (``MixedPrecisionPolicy``, the runtime's per-parameter ``ParamPolicy``)."""

    @property
    def param_dtype(self) -> torch.dtype | None: ...

    @property
    def reduce_dtype(self) -> torch.dtype | None: ...


def reduce_dtype_problem_by_policy(
    named_params: Mapping[str, torch.Tensor], policies: Mapping[str, DtypePolicy]
) -> str | None:
    """``reduce_dtype_problem`` for each set of parameters sharing a policy (``policies``: name -> policy): an
    override's parameters reduce apart ([Note: per-parameter mixed precision]); the first problem, or None."""
    by_policy: dict[DtypePolicy, dict[str, torch.Tensor]] = {}
    for name, param in named_params.items():
        by_policy.setdefault(policies[name], {})[name] = param
    for policy, named in by_policy.items():
        problem = reduce_dtype_problem(named, policy.param_dtype, policy.reduce_dtype)
        if problem is not None:
            return problem
    return None


def reduce_dtype_problem(
    named_params: Mapping[str, torch.Tensor], param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> str | None:
    """Why these parameters (of one group) cannot be reduce-scattered together, or None. A group's
    gradients are one reduce-scatter in one dtype, so its *trainable* parameters must reduce in one
    dtype; frozen ones of other dtypes are fine (they are all-gathered, never reduced). The message
    lists the parameters of each dtype, fewest first."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, param in named_params.items():
        if param.requires_grad:
            by_dtype.setdefault(reduce_cast_dtype(param, param_dtype, reduce_dtype), []).append(name)
    if len(by_dtype) < 2:
        return None
    parts = []
    for dtype, names in sorted(by_dtype.items(), key=lambda item: len(item[1])):
        shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
        parts.append(f"{str(dtype).removeprefix('torch.')}: {shown}")
    return (
        f"its trainable parameters reduce their gradients in {len(by_dtype)} dtypes ({'; '.join(parts)}), but a "
        "group's gradients are one reduce-scatter in one dtype"
    )


def _is_torch_policy(value: Any, name: str) -> bool:
    """Whether ``value`` is torch's own policy dataclass ``name`` (``torch.distributed.fsdp``), by its
    class's module and name: checked without importing torch's FSDP package."""
    cls = type(value)
    return cls.__name__ == name and cls.__module__.startswith("torch.distributed.fsdp")


def from_torch_policy(value: Any) -> Any:
    """torch's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` as fsdp2lite's (the
    same fields); anything else unchanged, for the caller's type check."""
    if _is_torch_policy(value, "MixedPrecisionPolicy"):
        return MixedPrecisionPolicy.model_validate(value)
    if _is_torch_policy(value, "CPUOffloadPolicy"):
        return CPUOffloadPolicy(pin_memory=value.pin_memory)
    if _is_torch_policy(value, "OffloadPolicy"):
        return OffloadPolicy()
    return value
