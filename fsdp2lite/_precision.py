"""``fully_shard(..., mp_overrides=)``: per-parameter mixed precision, resolved and checked before anything is
sharded ([Note: per-parameter mixed precision] in ``_runtime/split_reduce.py``).

``mp_overrides`` is a mapping of parameter-name patterns (``fnmatch``, over the names ``fully_shard`` gives the
call's parameters: relative to the module, ``[i].`` first for a list) to a ``MixedPrecisionPolicy`` (the first
pattern that matches wins), or a function ``fn(param) -> MixedPrecisionPolicy | None`` like
``shard_placement_fn``. An override sets the parameter's ``param_dtype`` and ``reduce_dtype`` (None: its own
dtype, as in ``mp_policy``); the group's ``mp_policy`` keeps casting the modules' inputs and outputs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch.nn as nn

from ._plan import OwnedParam
from .policies import MixedPrecisionPolicy, from_torch_policy

Owned = list[OwnedParam]


def resolve_overrides(overrides: Any, owned: Owned, owner: str) -> list[MixedPrecisionPolicy | None]:
    """Per owned parameter, its override (None: the group's ``mp_policy``); TypeError/ValueError naming the
    pattern, the value or the parameter, and what would be valid."""
    if overrides is None:
        return [None] * len(owned)
    if callable(overrides) and not isinstance(overrides, Mapping):
        return [_checked(f"mp_overrides({fqn!r})", overrides(param), allow_none=True) for fqn, param, _ in owned]
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
    return _match(checked, owned, owner)


def _match(checked: dict[str, MixedPrecisionPolicy], owned: Owned, owner: str) -> list[MixedPrecisionPolicy | None]:
    names = [fqn for fqn, _, _ in owned]
    found: list[MixedPrecisionPolicy | None] = []
    used: set[str] = set()
    for name in names:
        pattern = next((p for p in checked if fnmatch.fnmatchcase(name, p)), None)
        found.append(None if pattern is None else checked[pattern])
        if pattern is not None:
            used.add(pattern)
    unused = [pattern for pattern in checked if pattern not in used]
    if unused:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        quoted = ", ".join(repr(p) for p in unused)
        raise ValueError(
            f"mp_overrides pattern{'s' if len(unused) > 1 else ''} {quoted} match{'' if len(unused) > 1 else 'es'} no "
            f"parameter of {owner}; its parameters: {shown or 'none'} (fnmatch patterns over these names)"
        )
    return found


def _checked(where: str, value: Any, allow_none: bool) -> MixedPrecisionPolicy | None:
    if value is None and allow_none:
        return None
    policy = from_torch_policy(value)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{where} must be a MixedPrecisionPolicy (fsdp2lite's or torch's){' or None' if allow_none else ''}, "
            f"got {type(value).__name__}"
        )
    if policy.output_dtype is not None:
        raise ValueError(
            f"{where} sets output_dtype={policy.output_dtype}: outputs are cast per module, by the group's "
            "mp_policy, not per parameter; leave output_dtype None in an override"
        )
    return policy


OverrideFn = Callable[[nn.Parameter], MixedPrecisionPolicy | None]
