"""Which Parameters are fsdp2lite's, and the numbers of the originals they replaced: kept beside the
Parameters in identity tables, never written on them (STYLE.md: no state hung on ``nn.Parameter``).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

# [Note: original identity]
# A Parameter sharded by two separate fully_shard calls (a tie split across groups) must be found at lazy
# init, but the original may be gone by then (each call replaces it on its modules; nothing else need
# hold it). So every original gets a number the first time a call sees it, kept while it lives in a weak
# identity table (nothing is written on the user's Parameter) and on each FSDPParam made from it.
_original_uids: dict[int, int] = {}  # id(original) -> number, the entry dropped when the original dies
_next_uid = itertools.count()


def original_uid(param: torch.Tensor) -> int:
    """The number of this original Parameter ([Note: original identity]). Keyed by ``id`` with a
    finalizer, not a WeakKeyDictionary: that compares colliding keys with ``==``, elementwise on tensors."""
    key = id(param)
    uid = _original_uids.get(key)
    if uid is None:
        uid = _original_uids[key] = next(_next_uid)
        weakref.finalize(param, _original_uids.pop, key, None)  # an id is reused only after its object dies
    return uid


class _ShardedOwner(Protocol):
    """An ``FSDPParam``: what ``sharded_param_ids`` reads of it."""

    @property
    def sharded_param(self) -> torch.Tensor: ...


class _Group(Protocol):
    """An ``FSDPParamGroup``: its parameters."""

    @property
    def params(self) -> tuple[_ShardedOwner, ...]: ...


# The groups alive in this process. Not the sharded Parameters themselves: a weak reference to a Parameter
# stops ``module.to_empty`` from swapping it (``torch.utils.swap_tensors`` refuses tensors with weakrefs).
_groups: weakref.WeakSet[_Group] = weakref.WeakSet()


def register_group(group: _Group) -> None:
    """Record a new group, so its sharded parameters are known as fsdp2lite's while it lives."""
    _groups.add(group)


def sharded_param_ids() -> set[int]:
    """``id`` of every sharded parameter (DTensor) of a live group: fsdp2lite's, as opposed to a
    tensor-parallel DTensor or a plain Parameter."""
    return {id(param.sharded_param) for group in list(_groups) for param in group.params}
