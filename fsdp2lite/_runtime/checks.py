"""What lazy init checks before it changes anything, so a failed first forward leaves every module as it
was: one mesh, root settings made on the root, no meta parameters, one reduce dtype per group's
trainable parameters, no parameter sharded by two calls, every ``mp_overrides`` pattern matched somewhere."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import DTensor

from .group import FSDPParamGroup
from .module_casts import OverridePatterns
from .root import StateView

FSDPStates = Sequence[StateView]  # the FSDPStates under one root (hooks.py imports this module: no import back)


def check_materialized(group: FSDPParamGroup, name: str) -> None:
    """No parameter may still be on the meta device at the first forward (as registered now: after
    ``to_empty`` the module holds the new local tensors)."""
    for param in group.params:
        place = param.places[0]
        registered = place.module._parameters[place.name]
        local = registered._local_tensor if isinstance(registered, DTensor) else registered  # type: ignore[attr-defined]
        if local is not None and local.device.type == "meta":
            raise ValueError(
                f"parameter '{param.fqn}' of group '{name or '<root>'}' is still on the meta device at the first "
                "forward: call model.to_empty(device=...) and initialize the parameters (e.g. reset_parameters()) "
                "before running the model; nothing was changed"
            )


def check_reduce_dtypes(group: FSDPParamGroup, name: str) -> None:
    """``requires_grad`` is final at the first forward: the trainable parameters must reduce in one dtype
    (parameters unfrozen after ``fully_shard`` could break what it checked)."""
    problem = group.reduce_dtype_problem()
    if problem is not None:
        raise ValueError(
            f"group '{name or '<root>'}': {problem}; freeze the odd parameters (requires_grad_(False)) or set a "
            "reduce_dtype; nothing was changed"
        )


def check_no_tie_across_groups(states: FSDPStates, names: dict[int, str]) -> None:
    """One Parameter sharded by two separate fully_shard calls (a tied embedding and head, each sharded
    on its own) would become two independent copies, silently untied: refused, as torch refuses it."""
    owner: dict[int, str] = {}
    for state in states:
        if state.group is None:
            continue
        for param in state.group.params:
            where = f"'{param.fqn}' of group '{names[id(state)] or '<root>'}'"
            if param.orig_uid in owner:
                raise ValueError(
                    f"one parameter is sharded by two fully_shard calls ({owner[param.orig_uid]} and {where}), "
                    "already managed by another group: tied "
                    "parameters must be in one group; apply fully_shard to a module containing every use (e.g. "
                    "the root, or one call on a list of both modules); nothing was changed"
                )
            owner[param.orig_uid] = where


def check_root_settings(states: FSDPStates, names: dict[int, str]) -> None:
    """Root settings made on a module that turned out not to be the root would be silently ignored."""
    for state in states[1:]:
        if state.schedule_overrides:
            setting = next(iter(state.schedule_overrides))
            raise ValueError(
                f"set_{setting} was called on '{names[id(state)]}', which is not the root: the root is the "
                f"outermost fully_shard module ('{names[id(states[0])] or '<root>'}' here). Call it there"
            )


def check_one_mesh(states: FSDPStates, names: dict[int, str]) -> None:
    """Every group under one root must use the same mesh: one schedule, one set of process groups."""
    meshes = [(names[id(st)] or "<root>", st.group.mesh_info.mesh) for st in states if st.group is not None]
    if any(mesh != meshes[0][1] for _, mesh in meshes):
        listing = ", ".join(f"{name}: {tuple(mesh.shape)} {mesh.mesh_dim_names}" for name, mesh in meshes)
        raise ValueError(
            f"all fully_shard calls under one root must use the same mesh; got {listing}. "
            "Pass the same DeviceMesh to every call (fsdp2lite.init_mesh builds one)"
        )


def check_overrides_matched(calls: Sequence[OverridePatterns], root: str) -> None:
    """Every ``mp_overrides`` pattern of a call under this root matched a parameter in some call (one mapping
    serves every call of a bottom-up sharding; a pattern matching nothing anywhere is a typo)."""
    matched = set().union(*(call.matched for call in calls))
    patterns = list(dict.fromkeys(p for call in calls for p in call.unmatched if p not in matched))
    if not patterns:
        return
    names = [name for call in calls for name in call.names]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    plural = len(patterns) > 1
    quoted = ", ".join(repr(pattern) for pattern in patterns)
    raise ValueError(
        f"mp_overrides pattern{'s' if plural else ''} {quoted} match{'' if plural else 'es'} no parameter in "
        f"any fully_shard call under {root}; the calls' parameter names: {shown or 'none'} (fnmatch patterns "
        "over the names each call gives its parameters, relative to the module it shards); nothing was changed"
    )
