"""Bad input gets a clear error naming the value and what is allowed, before anything is changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _models import UnevenMLP
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import fsdp2lite as fl

pytestmark = pytest.mark.usefixtures("single_rank_pg")


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"nn.Module.*got str"):
        fl.fully_shard("model")  # type: ignore[type-var]
    with pytest.raises(TypeError, match=r"got int"):
        fl.fully_shard([nn.Linear(2, 2), 3])  # type: ignore[list-item]


def test_empty_list() -> None:
    with pytest.raises(ValueError, match="empty list"):
        fl.fully_shard([])


@pytest.mark.parametrize("container", [nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})])
def test_container_without_forward(container: nn.Module) -> None:
    name = type(container).__name__
    with pytest.raises(ValueError, match=rf"cannot shard a {name}: it has no forward.*children"):
        fl.fully_shard(container)
    assert not isinstance(container, fl.FSDPModule)
    assert not any(isinstance(p, DTensor) for p in container.parameters())


def test_already_sharded() -> None:
    model = nn.Linear(4, 4)
    fl.fully_shard(model)
    with pytest.raises(ValueError, match="already applied to this Linear"):
        fl.fully_shard(model)


def test_top_down_is_rejected() -> None:
    model = UnevenMLP()
    fl.fully_shard(model)
    with pytest.raises(ValueError, match=r"'up.weight' of Linear is already sharded.*bottom-up"):
        fl.fully_shard(model.blocks[0])
    assert not isinstance(model.blocks[0], fl.FSDPModule)


def test_tied_across_groups() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    fl.fully_shard(model[0])
    with pytest.raises(ValueError, match=r"'1.weight' of Linear is tied to '0.weight'.*one group"):
        fl.fully_shard(model)


def test_zero_dim_parameter() -> None:
    model = nn.Linear(4, 4)
    model.temperature = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"temperature: 0-dim parameter \(a scalar\) of Linear.*ignored_params"):
        fl.fully_shard(model)
    assert not isinstance(model.weight, DTensor)  # nothing was changed


def test_zero_dim_parameter_can_be_ignored() -> None:
    model = nn.Linear(4, 4)
    model.temperature = nn.Parameter(torch.tensor(1.0))
    fl.fully_shard(model, ignored_params={model.temperature})
    assert isinstance(model.weight, DTensor) and not isinstance(model.temperature, DTensor)


@pytest.mark.parametrize("value", ["yes", 1.0, [2]])
def test_reshard_after_forward_type(value: object) -> None:
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True, False, an int k.*or None"):
        fl.fully_shard(nn.Linear(2, 2), reshard_after_forward=value)  # type: ignore[arg-type]


def test_reshard_after_forward_int_must_divide_the_shard_size() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"reshard_after_forward=2 must divide the shard group size \(1\); valid values: \[1\]"
    ):
        fl.fully_shard(model, reshard_after_forward=2)
    assert not isinstance(model.weight, DTensor)  # rejected before anything changed


def test_mesh_of_wrong_type() -> None:
    with pytest.raises(TypeError, match="DeviceMesh or None, got str"):
        fl.fully_shard(nn.Linear(2, 2), "cpu")  # type: ignore[arg-type]


def test_mesh_device_type_mismatch() -> None:
    cuda_mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
    with pytest.raises(ValueError, match=r"'weight' is on cpu but the mesh is a 'cuda' mesh"):
        fl.fully_shard(nn.Linear(2, 2), cuda_mesh)


def test_policy_types() -> None:
    with pytest.raises(
        TypeError, match=r"mp_policy must be a MixedPrecisionPolicy \(fsdp2lite's or torch's\) or None, got dict"
    ):
        fl.fully_shard(nn.Linear(2, 2), mp_policy={"param_dtype": "bf16"})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"offload_policy must be an OffloadPolicy \(fsdp2lite's or torch's\) or None, got str"
    ):
        fl.fully_shard(nn.Linear(2, 2), offload_policy="cpu")  # type: ignore[arg-type]


def test_ignored_params_type() -> None:
    with pytest.raises(TypeError, match="ignored_params must hold nn.Parameter objects, got a Tensor"):
        fl.fully_shard(nn.Linear(2, 2), ignored_params={torch.ones(1)})  # type: ignore[arg-type]


def test_setter_types() -> None:
    model = fl.fully_shard(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="requires_gradient_sync must be True or False, got 'no'"):
        model.set_requires_gradient_sync("no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True, False, an int k .*got None"):
        model.set_reshard_after_forward(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reshard_after_backward must be True or False"):
        model.set_reshard_after_backward(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive, finite number, got 0"):
        model.set_gradient_divide_factor(0)


def test_meta_parameters_at_first_forward() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    fl.fully_shard(model)
    with pytest.raises(ValueError, match=r"'weight'.*still on the meta device.*to_empty"):
        model(torch.randn(2, 4))


def test_mesh_shapes() -> None:
    mesh_3d = DeviceMesh("cpu", torch.arange(1).view(1, 1, 1), _init_backend=False)
    with pytest.raises(ValueError, match=r"1D mesh \(shard\) or a 2D mesh \(replicate, shard\); got a 3D mesh"):
        fl.fully_shard(nn.Linear(2, 2), mesh_3d)
    # a 2D mesh is (replicate, shard) by position, whatever its axes are named (as torch's): no error


def test_schedule_settings() -> None:
    model = UnevenMLP()
    for block in model.blocks:
        fl.fully_shard(block)
    fl.fully_shard(model)
    model(torch.randn(2, 16))  # lazy init: the root is known now
    with pytest.raises(
        ValueError, match="set_forward_prefetch_depth is a root setting; FSDPUnevenBlock is not the root"
    ):
        model.blocks[0].set_forward_prefetch_depth(1)
    with pytest.raises(ValueError, match="forward prefetch depth must be an int >= 0, got -1"):
        model.set_forward_prefetch_depth(-1)
    with pytest.raises(TypeError, match="overlap must be True or False, got 'yes'"):
        model.set_overlap_reduce_scatter("yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="late must be True or False, got 1"):
        model.set_late_backward_prefetch(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="set_late_backward_prefetch is a root setting; FSDPUnevenBlock is not"):
        model.blocks[1].set_late_backward_prefetch(True)
    with pytest.raises(TypeError, match="prefetch targets must be modules fully_shard was applied to, got Linear"):
        model.set_modules_to_forward_prefetch([model.head])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="expected a list of FSDPModules, got FSDPUnevenBlock"):
        model.set_modules_to_backward_prefetch(model.blocks[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="record_trace needs a module fully_shard was applied to, got Linear"):
        with fl.record_trace(model.head):  # type: ignore[arg-type]
            pass


# ---- long lists said once (issue 44) ----------------------------------------------------------------------
def test_alike_problems_of_many_layers_collapse_into_one_line() -> None:
    """A problem every layer has is listed once, "and N more like it"; the exception keeps every problem."""
    from torch.distributed.tensor import Shard

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError) as info:
        fl.fully_shard(Stack(), shard_placement_fn=lambda p: Shard(2))
    message = str(info.value)
    assert message.startswith("fully_shard(Stack): 24 problems\n") and len(info.value.problems) == 24
    lines = message.splitlines()[1:]
    assert len(lines) == 2, message  # weights and biases: one line each
    assert lines[0].startswith("  layers.0.weight: shard_placement_fn asks for dim 2, but the parameter has shape")
    assert lines[0].endswith("; and 11 more like it") and lines[1].endswith("; and 11 more like it")
    assert "layers.1." not in message


def test_a_config_error_lists_each_kind_once_and_counts_past_the_first_few() -> None:
    from fsdp2lite._plan import Problem

    alike = [Problem(f"model.layers.{i}.mlp.weight", "cannot shard", "") for i in range(80)]
    kinds = [Problem(f"key_{k}", f"value {k}.5 is not allowed", "use 1") for k in range(10)]
    message = str(fl.ConfigError("job.yaml", alike + kinds))
    lines = message.splitlines()
    assert lines[0] == "job.yaml: 90 problem(s)"
    assert lines[1] == "  model.layers.0.mlp.weight: cannot shard; and 79 more like it"
    assert lines[2:9] == [f"  key_{k}: value {k}.5 is not allowed (use 1)" for k in range(7)]  # not alike
    assert lines[9:] == ["  and 3 more problems"], message
