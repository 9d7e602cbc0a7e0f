"""``precision_overrides``: per-parameter mixed precision in a policy file ([Note: per-parameter mixed precision]
in ``_runtime/split_reduce.py``), as ``fully_shard(..., mp_overrides=)`` takes it.

    mixed_precision: {param_dtype: bf16}
    precision_overrides:                 # first match wins
      - path: "*.norm.*"                 # glob(s) over parameter names
        param_dtype: fp32
        reduce_dtype: fp32
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

    def policy(self) -> MixedPrecisionPolicy:
        """The override as ``fully_shard`` takes it (``mp_overrides``)."""
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
