"""The tensors inside what crosses a module's boundary: forward arguments and outputs. Mixed precision
casts them (inputs to ``param_dtype`` with ``cast_forward_inputs``, outputs to ``output_dtype``), the
backward hooks find the ones that need grad.

[Note: tensor containers]
Tensors are found at any depth of tuples, lists, dicts, named tuples and other pytree nodes, and of
dataclass instances, as torch's ``fully_shard`` finds them (its ``_apply_to_tensors`` and
``collect_grad_tensors``). A dataclass holding a tensor that is replaced (cast, or routed through the
post-backward node) comes back as a new instance of its class (``dataclasses.replace`` with the new
fields, nested dataclasses likewise); the caller's object is left as it was, and one with nothing
replaced is passed on as it is. Fields declared ``init=False`` are left to the class's ``__post_init__``
(torch's replace of every field raises for them). A dataclass registered as a pytree node
(``register_dataclass``; transformers' ``ModelOutput``) is opened through its registration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with each tensor ``t`` replaced by ``fn(t)``, in ``tensors_in``'s order ([Note: tensor containers])."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if _tensor_args(tree):  # a hook's (args, kwargs) of tensors only, every call of a block: no pytree walk
        return tuple(fn(arg) for arg in tree[0]), {}
    return tree_map(lambda leaf: _map_leaf(fn, leaf), tree, is_leaf=_is_dataclass_leaf)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, depth first, dataclass fields in their order ([Note: tensor containers])."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if _tensor_args(tree):
        return list(tree[0])
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(tree, is_leaf=_is_dataclass_leaf)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_dataclass_leaf(leaf):
            for field in _init_fields(leaf):
                found.extend(tensors_in(getattr(leaf, field)))
    return found


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (others untouched)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _tensor_args(tree: Any) -> bool:
    """``tree`` is ``(args, {})`` with ``args`` a tuple of tensors: the common forward call, walked without pytree."""
    if type(tree) is not tuple or len(tree) != 2 or type(tree[0]) is not tuple or type(tree[1]) is not dict:
        return False
    return not tree[1] and all(isinstance(arg, torch.Tensor) for arg in tree[0])


def _is_dataclass_leaf(value: Any) -> bool:
    """A dataclass instance pytree does not open itself."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value) not in SUPPORTED_NODES


def _init_fields(value: Any) -> list[str]:
    return [field.name for field in dataclasses.fields(value) if field.init]


def _map_leaf(fn: Callable[[torch.Tensor], torch.Tensor], leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return fn(leaf)
    if not _is_dataclass_leaf(leaf):
        return leaf
    changes = {}
    for name in _init_fields(leaf):
        old = getattr(leaf, name)
        new = map_tensors(fn, old)
        if new is not old:
            changes[name] = new
    return dataclasses.replace(leaf, **changes) if changes else leaf
