"""Running a module's method, or any function, as the module's forward pass: its group unsharded before and
resharded after (per ``reshard_after_forward``), its pre-backward hooked on the result, as around ``forward``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.nn as nn

T = TypeVar("T")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` (e.g. ``generate``) between the pre- and post-forward work, as
    ``forward`` is: its group is all-gathered before the method and resharded after it (per
    ``reshard_after_forward``), and forwards the method calls on the module run inside that one pass.
    A module that is not an ``FSDPModule`` is left alone (like torch's, so one script serves both)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_fsdp_forward_method takes an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        raise TypeError(f"method_name must be a str, got {type(method_name).__name__}")
    if getattr(module, "_fsdp_state", None) is None:
        return
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        methods = sorted(n for n in dir(type(module)) if not n.startswith("_") and callable(getattr(module, n, None)))
        hint = ", ".join(m for m in methods if m in ("generate", "forward", "encode", "decode")) or "forward"
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} (e.g. {hint})")
    state: Any = module._fsdp_state

    @functools.wraps(method)
    def forward_method(*args: Any, **kwargs: Any) -> Any:
        return state.run_forward_method(module, method, args, kwargs)

    setattr(module, method_name, forward_method)


def run_forward_pass(module: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run as ``module``'s forward pass, as ``register_fsdp_forward_method`` runs a method
    (``fsdp2lite.finetune``'s chunked loss runs the decoder and the head this way: [Note: the loss as the root's
    pass]); a plain call for a module ``fully_shard`` has not made an ``FSDPModule``."""
    state = getattr(module, "_fsdp_state", None)
    if state is None:
        return fn(*args, **kwargs)
    return state.run_forward_method(module, fn, args, kwargs)  # type: ignore[no-any-return]
