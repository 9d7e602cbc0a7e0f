"""[Note: one plan]: ``fully_shard`` plans a frozen ``GroupSpec``, checks it in one place and reports every problem
at once; a policy file's plan, ``explain`` and the estimators build the same spec and get the same problems, word
for word. One process: the fake process group (rank 0 of 4) gives the mesh, nothing runs forward."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn
from _models import UnevenMLP
from test_bad_input import assert_unchanged, fingerprint
from torch.distributed.tensor import Shard

import fsdp2lite as fl
from fsdp2lite._plan import GroupSpec, MeshShape, PlanError, group_problems, owned_params


class Scaled(nn.Module):
    """A block with a 0-dim temperature beside a Linear: two problems for one call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.temperature


def test_every_problem_of_a_call_at_once_and_nothing_changed(four_ranks: Any) -> None:
    """A 0-dim parameter, a dim the Linear does not have, and ZeRO-1/2 told to free its parameters: one
    ``PlanError`` (a ValueError) lists all three, each naming its culprit and the fix; the module is untouched."""
    model = Scaled()
    before = fingerprint(model)
    with pytest.raises(PlanError) as caught:
        fl.fully_shard(
            model,
            four_ranks,
            shard_placement_fn=lambda p: Shard(3) if p.dim() == 2 else None,
            sharding=fl.ShardingPolicy(shard="optimizer"),
            reshard_after_forward=True,
        )
    problems = caught.value.problems
    assert isinstance(caught.value, ValueError)
    assert [p.location for p in problems] == ["temperature", "proj.weight", "Scaled"], problems
    text = str(caught.value)
    assert text.startswith("fully_shard(Scaled): 3 problems\n"), text
    assert "0-dim parameter (a scalar) of Scaled" in text and "ignored_params" in text
    assert "shard_placement_fn asks for dim 3, but the parameter has shape (8, 8); use a dim in 0 .. 1" in text
    assert "reshard_after_forward=True would free them" in text
    assert_unchanged(model, before)
    fl.fully_shard(model, four_ranks, ignored_params={model.temperature})  # the fixes applied: it shards
    assert isinstance(model, fl.FSDPModule)


def test_a_policy_file_gets_fully_shards_words(four_ranks: Any) -> None:
    """The same group planned by a policy file and by ``fully_shard``: the same problems, word for word (the one
    check), and a planned spec equal to the one the call builds, parameter by parameter."""
    config = fl.FSDPConfig.model_validate(
        {
            "sharding": {"shard": "optimizer"},
            "reshard_after_forward": True,
            "wrap": [{"match": {"class": "UnevenBlock"}}],
        }
    )
    plan = fl.plan_config(UnevenMLP(), config)
    planned = {p.location: p.message for p in plan.refused}
    model = UnevenMLP()
    with pytest.raises(PlanError) as caught:
        fl.fully_shard(
            model.blocks[0], four_ranks, sharding=fl.ShardingPolicy(shard="optimizer"), reshard_after_forward=True
        )
    (problem,) = caught.value.problems
    assert planned["blocks.0"] == problem.message and planned["blocks.1"] == problem.message, planned
    spec = plan.specs[0]
    assert isinstance(spec, GroupSpec) and spec.paths == ("blocks.0",) and spec.mesh is None
    block = dict(model.blocks[0].named_parameters())
    assert [(p.fqn.removeprefix("blocks.0."), p.dim) for p in spec.params] == [(n, 0) for n in block]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.label = "x"  # type: ignore[misc]


def test_the_mesh_checks_wait_for_a_mesh_and_then_agree() -> None:
    """``reshard_after_forward=3`` is a mesh question: the plan has no problem without one, and on a mesh of 4 it
    has fully_shard's (the setter's) problem, named once for the rule that set it."""
    config = fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "UnevenBlock"}, "reshard_after_forward": 3}]})
    plan = fl.plan_config(UnevenMLP(), config)
    assert plan.refused == [] and all(group_problems(spec) == [] for spec in plan.specs)
    found = fl.config.mesh_problems(plan, config, 4)
    assert [p.location for p in found] == ["wrap.0"], found
    assert found[0].message == "reshard_after_forward=3 must divide the shard group size (4)"
    on_mesh = group_problems(plan.specs[0].on_mesh(MeshShape(4)))
    assert [p.message for p in on_mesh] == [found[0].message]


def test_the_one_walk_names_and_places(four_ranks: Any) -> None:
    """``owned_params``: each parameter once, named from its root's path, with every place it is registered at
    (a tie: two), not descending into what ``skip`` owns."""
    model = UnevenMLP()
    model.extra = nn.Linear(16, 37)
    model.extra.weight = model.blocks[0].up.weight  # a tie inside one walk
    owned = owned_params([("", model)], lambda m: m is model.blocks[1], set())
    names = [o.fqn for o in owned]
    assert "blocks.1.up.weight" not in names and "blocks.0.up.weight" in names
    tied = next(o for o in owned if o.fqn == "blocks.0.up.weight")
    assert [(type(m).__name__, n) for m, n in tied.places] == [("Linear", "weight"), ("Linear", "weight")]
    assert tied.places[1][0] is model.extra
    listed = owned_params([("[0]", model.blocks[0]), ("[1]", model.blocks[1])], lambda m: False, set())
    assert listed[0].fqn.startswith("[0].") and listed[-1].fqn.startswith("[1].")
