"""``fully_shard(..., mp_overrides=)``: per-parameter mixed precision, resolved and checked before anything is
sharded ([Note: per-parameter mixed precision] in ``_runtime/split_reduce.py``).

``mp_overrides`` is a mapping of parameter-name patterns (``fnmatch``, over the names ``fully_shard`` gives the
call's parameters: relative to the module, ``[i].`` first for a list) to a ``MixedPrecisionPolicy`` (the first
pattern that matches wins), or a function ``fn(param) -> MixedPrecisionPolicy | None`` like
``shard_placement_fn``. An override sets the parameter's ``param_dtype`` and ``reduce_dtype`` (None: its own
dtype, as in ``mp_policy``), and the module holding it casts its inputs to that ``param_dtype`` and its outputs
back to the group's compute dtype, or to the override's ``output_dtype`` ([Note: override casts] in
``_runtime/module_casts.py``). One mapping serves every call of a bottom-up sharding: a pattern may match nothing
in one call (``*attn_norm*`` at the root); one that matches nothing in any call under a root is refused at its
first forward, before anything runs (``_runtime/checks.py``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn

from ._runtime.module_casts import ModuleCast, OverridePatterns
from .policies import MixedPrecisionPolicy, cast_dtype, from_torch_policy


class Planned(Protocol):
    """What the casts read of a planned parameter (``_plan.ParamSpec``)."""

    @property
    def fqn(self) -> str: ...
    @property
    def param(self) -> nn.Parameter: ...
    @property
    def places(self) -> tuple[tuple[nn.Module, str], ...]: ...
    @property
    def mixed_precision(self) -> MixedPrecisionPolicy: ...
    @property
    def overridden(self) -> bool: ...


Owned = Sequence[tuple[str, nn.Parameter, Any]]  # _plan.OwnedParam: fqn, param, places (_plan imports this)
Resolved = tuple[list[MixedPrecisionPolicy | None], OverridePatterns]


def resolve_overrides(overrides: Any, owned: Owned) -> Resolved:
    """Per owned parameter, its override (None: the group's ``mp_policy``), and the patterns that matched;
    TypeError/ValueError naming the pattern, the value or the parameter, and what would be valid."""
    if overrides is None:
        return [None] * len(owned), OverridePatterns()
    if callable(overrides) and not isinstance(overrides, Mapping):
        found = [_checked(f"mp_overrides({fqn!r})", overrides(param), allow_none=True) for fqn, param, _ in owned]
        return found, OverridePatterns()
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "mp_overrides must be a mapping of parameter-name patterns to MixedPrecisionPolicy (e.g. "
            f"{{'*norm*': MixedPrecisionPolicy(param_dtype=torch.float32)}}) or a function param -> policy | None, "
            f"got {type(overrides).__name__}"
        )
    checked: dict[str, MixedPrecisionPolicy] = {}
    for pattern, value in overrides.items():
        if not isinstance(pattern, str):
            raise TypeError(f"mp_overrides keys are parameter-name patterns (str), got {type(pattern).__name__}")
        policy = _checked(f"mp_overrides[{pattern!r}]", value, allow_none=False)
        if policy is not None:
            checked[pattern] = policy
    return _match(checked, owned)


def _match(checked: dict[str, MixedPrecisionPolicy], owned: Owned) -> Resolved:
    names = tuple(fqn for fqn, _, _ in owned)
    found: list[MixedPrecisionPolicy | None] = []
    used: set[str] = set()
    for name in names:
        pattern = next((p for p in checked if fnmatch.fnmatchcase(name, p)), None)
        found.append(None if pattern is None else checked[pattern])
        if pattern is not None:
            used.add(pattern)
    return found, OverridePatterns(tuple(checked), frozenset(used), names)


def _checked(where: str, value: Any, allow_none: bool) -> MixedPrecisionPolicy | None:
    if value is None and allow_none:
        return None
    policy = from_torch_policy(value)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{where} must be a MixedPrecisionPolicy (fsdp2lite's or torch's){' or None' if allow_none else ''}, "
            f"got {type(value).__name__}"
        )
    return policy


def override_casts(
    params: Sequence[Planned], group: MixedPrecisionPolicy
) -> tuple[list[ModuleCast], list[tuple[str, str, str]]]:
    """The casts at the edges of each module holding overridden parameters ([Note: override casts]), and the
    problems (location, message, suggestion): two overrides asking one module for different casts."""
    by_module: dict[int, tuple[ModuleCast, str]] = {}
    problems: dict[int, tuple[str, str, str]] = {}  # one per module
    for p in params:
        if not p.overridden:
            continue
        for module, _ in p.places:
            cast = _cast_of(module, p.param, p.mixed_precision, group)
            earlier = by_module.setdefault(id(module), (cast, p.fqn))
            if earlier[0] != cast:
                problems.setdefault(id(module), _conflict(earlier, (cast, p.fqn)))
    casts = [cast for cast, _ in by_module.values() if cast.input_dtype is not None or cast.output_dtype is not None]
    return casts, list(problems.values())


def _cast_of(
    module: nn.Module, param: torch.Tensor, own: MixedPrecisionPolicy, group: MixedPrecisionPolicy
) -> ModuleCast:
    """An override's casts: inputs to its param_dtype (if it casts forward inputs); outputs to its output_dtype,
    else to the group's compute dtype when the module computes in another."""
    computes, around = cast_dtype(param, own.param_dtype), cast_dtype(param, group.param_dtype)
    inputs = own.param_dtype if own.cast_forward_inputs and own.param_dtype is not None else None
    output = own.output_dtype if own.output_dtype is not None else (around if around != computes else None)
    return ModuleCast(module, inputs if param.is_floating_point() else None, output)


def _conflict(first: tuple[ModuleCast, str], second: tuple[ModuleCast, str]) -> tuple[str, str, str]:
    def shown(cast: ModuleCast) -> str:
        return f"inputs {_name(cast.input_dtype)}, outputs {_name(cast.output_dtype)}"

    module = type(first[0].module).__name__
    return (
        second[1],
        f"the overrides of one module ({module}) cast its inputs and outputs differently: "
        f"{first[1]} ({shown(first[0])}) and {second[1]} ({shown(second[0])})",
        "give a module's parameters one override (match them with one pattern, e.g. 'norm.*'), or set the same "
        "param_dtype, output_dtype and cast_forward_inputs in both",
    )


def _name(dtype: torch.dtype | None) -> str:
    return "uncast" if dtype is None else str(dtype).removeprefix("torch.")


OverrideFn = Callable[[nn.Parameter], MixedPrecisionPolicy | None]
