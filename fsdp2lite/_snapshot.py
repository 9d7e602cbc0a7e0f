"""All or nothing: what sharding changes on modules, saved first and put back when an operation fails.

``fully_shard`` and ``apply_config`` change modules in place: each managed parameter is replaced in
``module._parameters``, hooks are registered, the class is swapped and ``_fsdp_state`` is set. Nothing
else of the user's is touched (the original Parameters are read, never written). So a snapshot of
those four things, per module, taken before the first change, is enough to undo a failed operation
exactly: the same Parameter objects with the same values, the same classes, the same hooks in the same
order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

_ABSENT = object()


class ModuleSnapshot:
    """Classes, parameters, hook dicts and FSDP state of ``modules`` (each once), restorable."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._entries: list[tuple[nn.Module, type, dict[str, Any], dict[str, dict[Any, Any]], Any]] = []
        seen: set[int] = set()
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            hooks = {
                name: dict(value) for name, value in vars(module).items() if "hook" in name and isinstance(value, dict)
            }
            state = module.__dict__.get("_fsdp_state", _ABSENT)
            self._entries.append((module, type(module), dict(module._parameters), hooks, state))

    @contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """The block changes the modules completely or, if it raises, not at all: restored, then re-raised."""
        try:
            yield
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put every module back as it was when the snapshot was taken."""
        for module, cls, params, hooks, state in self._entries:
            module.__class__ = cls
            module._parameters.clear()
            module._parameters.update(params)
            for name, saved in hooks.items():
                current = getattr(module, name)
                current.clear()
                current.update(saved)
            if state is _ABSENT:
                module.__dict__.pop("_fsdp_state", None)
            else:
                module.__dict__["_fsdp_state"] = state


def all_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """``modules`` and everything below them."""
    return [sub for module in modules for sub in module.modules()]
