"""``precision_overrides``: per-parameter mixed precision in a policy file ([Note: per-parameter mixed precision]
in ``_runtime/split_reduce.py``), as ``fully_shard(..., mp_overrides=)`` takes it.

    mixed_precision: {param_dtype: bf16}
    precision_overrides:                 # first match wins
      - path: "*.norm.*"                 # glob(s) over parameter names
        param_dtype: fp32
        reduce_dtype: fp32
        # output_dtype: bf16             # the norm's outputs; default: the group's compute dtype
        # cast_forward_inputs: true      # the norm's inputs cast to param_dtype (the default)

The module holding a matched parameter casts at its edges as torch's nested group of its own would
([Note: override casts] in ``_runtime/module_casts.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..policies import DType, MixedPrecisionPolicy


class PrecisionOverride(BaseModel):
    """Parameters (by name glob) that compute and reduce in dtypes of their own, inside their group."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    path: str | list[str] = Field(description="glob(s) over parameter names, e.g. '*.norm.*' or '*.router.weight'")
    param_dtype: DType = Field(None, description="their all-gather and compute dtype; None keeps their own dtype")
    reduce_dtype: DType = Field(None, description="their gradient reduce-scatter dtype; None uses param_dtype")
    output_dtype: DType = Field(
        None,
        description="their modules' outputs cast to this dtype; None: to the group's compute dtype when the "
        "module computes in another (a fp32 norm in a bf16 block hands bf16 on)",
    )
    cast_forward_inputs: bool = Field(True, description="their modules' floating-point inputs cast to param_dtype")

    def policy(self) -> MixedPrecisionPolicy:
        """The override as ``fully_shard`` takes it (``mp_overrides``)."""
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=self.output_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
        )
