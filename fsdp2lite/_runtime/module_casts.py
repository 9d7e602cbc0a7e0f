"""The casts around a module whose parameters compute in an override's dtype, inside a group of another.

[Note: override casts]
``mp_overrides={"*norm*": MixedPrecisionPolicy(param_dtype=torch.float32)}`` makes a norm's weight fp32 inside a
bf16 group ([Note: per-parameter mixed precision] in split_reduce.py). The modules around the norm still compute
in bf16, so the norm's module casts at its edges exactly as torch's nested group of its own would
(``fully_shard(norm, mp_policy=MixedPrecisionPolicy(param_dtype=fp32, output_dtype=bf16))``):

    inputs   -> the override's param_dtype      (when its cast_forward_inputs, as torch's group casts)
    outputs  -> the override's output_dtype, else the group's compute dtype when the module computes in another

    Llama block, group bf16, override fp32 on input_layernorm.weight:
    h (bf16) -> [cast fp32] -> LlamaRMSNorm: variance, rsqrt, weight * h, all fp32 -> [cast bf16] -> q_proj (bf16)

Without the output cast, HF's RMSNorm (``weight * hidden.to(input_dtype)``) hands an fp32 tensor to a bf16
Linear, which refuses it. The casts are plain forward hooks on the module that holds the parameters (every module
a tied parameter is registered at), made once at ``fully_shard`` from the plan's ``ModuleCast`` records; a
module's overridden parameters must agree on them (``_plan.py`` refuses two casts for one module).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .containers import cast_floating


@dataclass(frozen=True)
class ModuleCast:
    """The casts at one module's edges ([Note: override casts]); None: that edge is left alone."""

    module: nn.Module
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None


def install_casts(casts: Sequence[ModuleCast]) -> None:
    """Register each cast's hooks on its module (after any hook already there: fsdp2lite's own pre-forward casts
    a group's inputs first, and its post-forward sees the override's output)."""
    for cast in casts:
        if cast.input_dtype is not None:
            cast.module.register_forward_pre_hook(_input_cast(cast.input_dtype), with_kwargs=True)
        if cast.output_dtype is not None:
            cast.module.register_forward_hook(_output_cast(cast.output_dtype))


def _input_cast(dtype: torch.dtype) -> Any:
    def cast_inputs(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return cast_floating((args, kwargs), dtype)

    return cast_inputs


def _output_cast(dtype: torch.dtype) -> Any:
    def cast_outputs(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return cast_floating(output, dtype)

    return cast_outputs


@dataclass(frozen=True)
class OverridePatterns:
    """One call's ``mp_overrides`` patterns, and which of them matched a parameter of the call. A pattern may
    match nothing in one call of a bottom-up sharding and something in another (``*attn_norm*`` at the root);
    the root's lazy init refuses a pattern that matched nothing in any call below it (``checks.py``)."""

    patterns: tuple[str, ...] = ()  # () for a function, or no overrides
    matched: frozenset[str] = frozenset()
    names: tuple[str, ...] = ()  # the call's parameter names, as the patterns saw them (for the message)

    @property
    def unmatched(self) -> tuple[str, ...]:
        return tuple(pattern for pattern in self.patterns if pattern not in self.matched)
