"""The bad-input catalogue: what a new user gets wrong, across the API, configs, the CLI and checkpoints.

Every case asserts the exception type, that the message names the culprit (argument, value, key,
module or file) and says what is valid, and that nothing changed: the same Parameter objects with the
same values, the same classes, hooks and FSDP settings as before the call (``fingerprint``). Where
the message asks for a fix, the fix is applied and shown to work.

One process: a one-rank gloo group for what runs forward or touches files, the fake process group
(this process as rank 1 of 4) for what depends on the world size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import UnevenMLP, tiny_gpt
from pydantic import ValidationError
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp2lite as fl
from fsdp2lite.cli import main

# ---- what "nothing changed" means --------------------------------------------------------------


def fingerprint(root: nn.Module) -> list[Any]:
    """Per module: class, hook keys in order, parameters (object and values), FSDP state and its settings."""
    out = []
    for name, module in root.named_modules():
        hooks = {k: tuple(v) for k, v in vars(module).items() if "hook" in k and isinstance(v, dict)}
        params = [(n, id(p), p.detach().clone()) for n, p in module._parameters.items() if p is not None]
        state = module.__dict__.get("_fsdp_state")
        settings = None
        if state is not None and state.group is not None:
            plain = (bool, int, float, str, type(None))
            settings = {k: v for k, v in vars(state.group).items() if isinstance(v, plain)}
            settings["overrides"] = dict(state.schedule_overrides)
        out.append((name, type(module), hooks, params, id(state), settings))
    return out


def assert_unchanged(root: nn.Module, before: list[Any]) -> None:
    after = fingerprint(root)
    assert len(after) == len(before), "modules were added or removed"
    for old, new in zip(before, after):
        name = old[0] or "<root>"
        assert old[1] is new[1], f"{name}: class changed {old[1].__name__} -> {new[1].__name__}"
        assert old[2] == new[2], f"{name}: hooks changed"
        assert [(n, i) for n, i, _ in old[3]] == [(n, i) for n, i, _ in new[3]], f"{name}: parameter objects changed"
        for (n, _, a), (_, _, b) in zip(old[3], new[3]):
            assert a.device.type == "meta" or torch.equal(a, b), f"{name}.{n}: values changed"
        assert old[4] == new[4] and old[5] == new[5], f"{name}: FSDP state or settings changed"


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, Callable[[nn.Module], Any]]]  # -> (model, the bad call)
    error: type[BaseException]
    match: str  # regex the message must match: names the culprit and what is valid


def check(case: Case) -> nn.Module:
    model, call = case.build()
    before = fingerprint(model)
    with pytest.raises(case.error, match=case.match):
        call(model)
    assert_unchanged(model, before)
    return model


# ---- process groups ---------------------------------------------------------------------------------


@pytest.fixture
def one_rank() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def four_ranks() -> Any:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return UnevenMLP()


def sharded() -> nn.Module:
    model = mlp()
    for block in model.blocks:
        fl.fully_shard(block)
    fl.fully_shard(model)
    return model


def plain(call: Callable[[nn.Module], Any], build: Callable[[], nn.Module] = mlp):
    return lambda: (build(), call)


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).bfloat16())


def _tied() -> nn.Module:
    model = tiny_gpt()
    fl.fully_shard(model.head)  # the head is tied to tok_emb, which the root would take
    return model


def _top_down() -> nn.Module:
    model = mlp()
    fl.fully_shard(model)
    return model


# ---- fully_shard ---------------------------------------------------------------------------------

FULLY_SHARD = [
    Case("not a module", plain(lambda m: fl.fully_shard(3)), TypeError, r"nn.Module or a list of them, got int"),
    Case("empty list", plain(lambda m: fl.fully_shard([])), ValueError, r"empty list of modules"),
    Case(
        "same module twice",
        plain(lambda m: fl.fully_shard([m.head, m.head])),
        ValueError,
        r"same Linear twice.*positions 0 and 1",
    ),
    Case("list with a non-module", plain(lambda m: fl.fully_shard([m.head, 3])), TypeError, r"got int"),
    Case(
        "a ModuleList",
        plain(lambda m: fl.fully_shard(m.blocks)),
        ValueError,
        r"cannot shard a ModuleList: it has no forward.*children",
    ),
    Case(
        "sharded twice",
        lambda: (sharded(), lambda m: fl.fully_shard(m.blocks[0])),
        ValueError,
        r"already applied to this UnevenBlock",
    ),
    Case(
        "top-down",
        lambda: (_top_down(), lambda m: fl.fully_shard(m.blocks[0])),
        ValueError,
        r"'up.weight' of Linear is already sharded.*bottom-up",
    ),
    Case(
        "reshard_after_forward str",
        plain(lambda m: fl.fully_shard(m, reshard_after_forward="yes")),
        TypeError,
        r"reshard_after_forward must be True, False, an int.*got 'yes'",
    ),
    Case(
        "reshard_after_forward 0",
        plain(lambda m: fl.fully_shard(m, reshard_after_forward=0)),
        ValueError,
        r"reshard_after_forward=0 must divide the shard group size \(1\); valid values: \[1\]",
    ),
    Case(
        "mp_policy str",
        plain(lambda m: fl.fully_shard(m, mp_policy="bf16")),
        TypeError,
        r"mp_policy must be a MixedPrecisionPolicy \(fsdp2lite's or torch's\) or None, got str",
    ),
    Case(
        "offload_policy bool",
        plain(lambda m: fl.fully_shard(m, offload_policy=True)),
        TypeError,
        r"offload_policy must be an OffloadPolicy \(fsdp2lite's or torch's\) or None, got bool",
    ),
    Case(
        "ignored_params int",
        plain(lambda m: fl.fully_shard(m, ignored_params=3)),
        TypeError,
        r"ignored_params must be a set of nn.Parameter, got int",
    ),
    Case(
        "ignored_params tensors",
        plain(lambda m: fl.fully_shard(m, ignored_params={torch.ones(1)})),
        TypeError,
        r"must hold nn.Parameter objects, got a Tensor",
    ),
    Case(
        "mesh str",
        plain(lambda m: fl.fully_shard(m, "cpu")),
        TypeError,
        r"takes a torch.distributed.device_mesh.DeviceMesh or None, got str",
    ),
    Case(
        "mesh 3D",
        plain(lambda m: fl.fully_shard(m, DeviceMesh("cpu", torch.arange(1).view(1, 1, 1), _init_backend=False))),
        ValueError,
        r"got a 3D mesh",
    ),
    Case(
        "0-dim parameter",
        lambda: (Scalar(), fl.fully_shard),
        ValueError,
        r"scale: 0-dim parameter \(a scalar\) of Scalar.*shape \(1,\).*pass it in ignored_params",
    ),
    Case(
        "mixed dtypes",
        lambda: (Mixed(), fl.fully_shard),
        ValueError,
        r"fully_shard\(Mixed\): its trainable parameters reduce their gradients in 2 dtypes "
        r"\(float32: a.weight.*bfloat16: b.weight.*param_dtype",
    ),
    Case(
        "tie across groups",
        lambda: (_tied(), fl.fully_shard),
        ValueError,
        r"'tok_emb.weight' of Embedding is tied to 'head.weight'",
    ),
    Case(
        "placement Replicate",
        plain(lambda m: fl.fully_shard(m.blocks[0], shard_placement_fn=lambda p: Replicate())),
        TypeError,
        r"returned Replicate\(\) for parameter 'up.weight' of Linear",
    ),
    Case(
        "placement dim 2",
        plain(lambda m: fl.fully_shard(m.blocks[0], shard_placement_fn=lambda p: Shard(2))),
        ValueError,
        r"6 problems\n  up.weight: shard_placement_fn asks for dim 2, but the parameter has shape \(37, 16\); "
        r"use a dim in 0 \.\. 1.*\n  up.bias: ",
    ),
    Case(
        "placement not callable",
        plain(lambda m: fl.fully_shard(m, shard_placement_fn=Shard(1))),
        TypeError,
        r"shard_placement_fn must be a callable",
    ),
]


@pytest.mark.parametrize("case", FULLY_SHARD, ids=lambda c: c.name)
def test_fully_shard(case: Case, one_rank: DeviceMesh) -> None:
    check(case)


FOUR_RANKS = [
    Case(
        "reshard 3 of 4",
        plain(lambda m: fl.fully_shard(m, reshard_after_forward=3)),
        ValueError,
        r"reshard_after_forward=3 must divide the shard group size \(4\); valid values: \[1, 2, 4\]",
    ),
    Case(
        "reshard 2 with Shard(1)",
        plain(
            lambda m: fl.fully_shard(
                m.blocks[0], reshard_after_forward=2, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None
            )
        ),
        ValueError,
        r"up.weight \(Shard\(1\)\).*True or False",
    ),
    Case(
        "set_reshard 3 of 4",
        lambda: (sharded(), lambda m: m.set_reshard_after_forward(3)),
        ValueError,
        r"reshard_after_forward=3 must divide.*\[1, 2, 4\]",
    ),
    Case(
        "init_mesh replicate 3 of 4",
        plain(lambda m: fl.init_mesh(replicate=3)),
        ValueError,
        r"replicate\(3\) does not divide world_size\(4\)",
    ),
    Case(
        "init_mesh 2 x 3",
        plain(lambda m: fl.init_mesh(replicate=2, shard=3)),
        ValueError,
        r"replicate\(2\) \* shard\(3\) != world_size\(4\)",
    ),
    Case(
        "init_mesh replicate 0",
        plain(lambda m: fl.init_mesh(replicate=0)),
        ValueError,
        r"mesh degrees must be >= 1.*replicate\(0\)",
    ),
]


@pytest.mark.parametrize("case", FOUR_RANKS, ids=lambda c: c.name)
def test_world_size_dependent(case: Case, four_ranks: DeviceMesh) -> None:
    check(case)


# ---- FSDPModule settings and functions --------------------------------------------------------------

SETTERS = [
    Case(
        "requires_gradient_sync int",
        lambda: (sharded(), lambda m: m.set_requires_gradient_sync(1)),
        TypeError,
        r"requires_gradient_sync must be True or False, got 1",
    ),
    Case(
        "requires_all_reduce str",
        lambda: (sharded(), lambda m: m.set_requires_all_reduce("no")),
        TypeError,
        r"requires_all_reduce must be True or False, got 'no'",
    ),
    Case(
        "reshard_after_forward None",
        lambda: (sharded(), lambda m: m.set_reshard_after_forward(None)),
        TypeError,
        r"reshard_after_forward must be True, False, an int k.*got None",
    ),
    Case(
        "reshard_after_backward None",
        lambda: (sharded(), lambda m: m.set_reshard_after_backward(None)),
        TypeError,
        r"reshard_after_backward must be True or False, got None",
    ),
    Case(
        "divide factor 0",
        lambda: (sharded(), lambda m: m.set_gradient_divide_factor(0)),
        ValueError,
        r"positive, finite number, got 0",
    ),
    Case(
        "divide factor inf",
        lambda: (sharded(), lambda m: m.set_gradient_divide_factor(math.inf)),
        ValueError,
        r"positive, finite number, got inf",
    ),
    Case(
        "divide factor nan",
        lambda: (sharded(), lambda m: m.set_gradient_divide_factor(math.nan)),
        ValueError,
        r"positive, finite number, got nan",
    ),
    Case(
        "divide factor str",
        lambda: (sharded(), lambda m: m.set_gradient_divide_factor("2")),
        TypeError,
        r"must be a number, got '2' \(str\)",
    ),
    Case(
        "prefetch depth -1",
        lambda: (sharded(), lambda m: m.set_forward_prefetch_depth(-1)),
        ValueError,
        r"int >= 0, got -1",
    ),
    Case(
        "prefetch depth bool",
        lambda: (sharded(), lambda m: m.set_forward_prefetch_depth(True)),
        ValueError,
        r"int >= 0, got True",
    ),
    Case(
        "overlap int",
        lambda: (sharded(), lambda m: m.set_overlap_reduce_scatter(1)),
        TypeError,
        r"overlap must be True or False, got 1",
    ),
    Case(
        "late prefetch None",
        lambda: (sharded(), lambda m: m.set_late_backward_prefetch(None)),
        TypeError,
        r"late must be True or False, got None",
    ),
    Case(
        "forward prefetch not a list",
        lambda: (sharded(), lambda m: m.blocks[0].set_modules_to_forward_prefetch(m.blocks[1])),
        TypeError,
        r"expected a list of FSDPModules, got FSDPUnevenBlock",
    ),
    Case(
        "forward prefetch plain module",
        lambda: (sharded(), lambda m: m.blocks[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])),
        TypeError,
        r"modules fully_shard was applied to, got Linear",
    ),
    Case(
        "backward prefetch int",
        lambda: (sharded(), lambda m: m.blocks[1].set_modules_to_backward_prefetch([3])),
        TypeError,
        r"got int",
    ),
    Case(
        "is_last_backward int",
        lambda: (sharded(), lambda m: m.set_is_last_backward(1)),
        TypeError,
        r"is_last_backward must be True or False, got 1",
    ),
    Case(
        "unshard_in_backward str",
        lambda: (sharded(), lambda m: m.set_unshard_in_backward("no")),
        TypeError,
        r"unshard_in_backward must be True or False, got 'no'",
    ),
    Case(
        "all_reduce_hook int",
        lambda: (sharded(), lambda m: m.set_all_reduce_hook(3)),
        TypeError,
        r"callable hook\(tensor\) -> None, got int",
    ),
    Case(
        "post_optim_event str",
        lambda: (sharded(), lambda m: m.set_post_optim_event("now")),
        TypeError,
        r"takes a torch.Event.*got str",
    ),
    Case(
        "post_optim_event on CPU",
        lambda: (sharded(), lambda m: m.set_post_optim_event(torch.Event("cpu"))),
        ValueError,
        r"orders CUDA streams; this model is on a 'cpu' mesh",
    ),
    Case(
        "unused params None",
        lambda: (sharded(), lambda m: m.set_reduce_scatter_unused_params(None)),
        TypeError,
        r"reduce_scatter_unused_params must be True or False, got None",
    ),
    Case(
        "forward method missing",
        lambda: (sharded(), lambda m: fl.register_fsdp_forward_method(m, "generate")),
        ValueError,
        r"FSDPUnevenMLP has no method 'generate'",
    ),
    Case(
        "forward method name int",
        lambda: (sharded(), lambda m: fl.register_fsdp_forward_method(m, 3)),
        TypeError,
        r"method_name must be a str, got int",
    ),
    Case(
        "forward method on a str",
        plain(lambda m: fl.register_fsdp_forward_method("model", "forward")),
        TypeError,
        r"takes an nn.Module, got str",
    ),
    Case(
        "init_mesh replicate str",
        plain(lambda m: fl.init_mesh(replicate="2")),
        TypeError,
        r"init_mesh\(replicate=...\) must be an int, got '2' \(str\)",
    ),
    Case(
        "init_mesh replicate float",
        plain(lambda m: fl.init_mesh(replicate=1.0)),
        TypeError,
        r"init_mesh\(replicate=...\) must be an int, got 1.0 \(float\)",
    ),
    Case(
        "init_mesh shard bool",
        plain(lambda m: fl.init_mesh(shard=True)),
        TypeError,
        r"init_mesh\(shard=...\) must be an int, got True",
    ),
    Case(
        "init_mesh device int",
        plain(lambda m: fl.init_mesh(device_type=3)),
        TypeError,
        r"device_type=...\) must be a str like 'cuda' or 'cpu'",
    ),
    Case(
        "mp dtype name",
        plain(lambda m: fl.MixedPrecisionPolicy(param_dtype="bf61")),
        ValidationError,
        r"param_dtype[\s\S]*'bf61' is not a dtype; valid names: bf16",
    ),
    Case(
        "mp dtype fp64",
        plain(lambda m: fl.MixedPrecisionPolicy(reduce_dtype=torch.float64)),
        ValidationError,
        r"reduce_dtype[\s\S]*torch.float64 is not supported; use one of",
    ),
    Case(
        "mp extra key",
        plain(lambda m: fl.MixedPrecisionPolicy(param_dtyp="bf16")),
        ValidationError,
        r"param_dtyp[\s\S]*Extra inputs are not permitted",
    ),
    Case(
        "offload pin str",
        plain(lambda m: fl.CPUOffloadPolicy(pin_memory="maybe")),
        ValidationError,
        r"pin_memory[\s\S]*valid boolean",
    ),
]


@pytest.mark.parametrize("case", SETTERS, ids=lambda c: c.name)
def test_settings_and_functions(case: Case, one_rank: DeviceMesh) -> None:
    check(case)


def test_root_setting_on_a_non_root_fails_at_the_first_forward_changing_nothing(one_rank: DeviceMesh) -> None:
    model = sharded()
    model.blocks[0].set_forward_prefetch_depth(3)  # before the first forward: the root is not known yet
    before = fingerprint(model)
    with pytest.raises(ValueError, match=r"set_forward_prefetch_depth was called on 'blocks.0', which is not the root"):
        model(torch.randn(2, 16))
    assert_unchanged(model, before)
    model.blocks[0]._fsdp_state.schedule_overrides.clear()  # the fix: set it on the root instead
    model.set_forward_prefetch_depth(3)
    model(torch.randn(2, 16)).sum().backward()
    assert model._fsdp_state.root_context.forward_prefetch_depth == 3


def test_meta_parameters_fail_the_first_forward_changing_nothing(one_rank: DeviceMesh) -> None:
    with torch.device("meta"):
        model = UnevenMLP()
    for block in model.blocks:
        fl.fully_shard(block)
    fl.fully_shard(model)
    before = fingerprint(model)
    with pytest.raises(ValueError, match=r"parameter '\w+' of group '[\w<>.]+' is still on the meta device.*to_empty"):
        model(torch.randn(2, 16))
    assert_unchanged(model, before)
    model.to_empty(device="cpu")  # what the message says, then the model runs
    model.reset_all()
    model(torch.randn(2, 16)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- configs -------------------------------------------------------------------------------------


def yaml_problems(tmp_path: Path, text: str | bytes) -> list[fl.config.Problem]:
    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(fl.ConfigError) as info:
        fl.FSDPConfig.from_yaml(path)
    return info.value.problems


YAML_CASES = [
    (
        "duplicate key",
        "mesh: {shard: -1}\nwrap: []\nmesh: {replicate: 2}\n",
        "line 3",
        r"key 'mesh' is given twice.*first on line 1",
    ),
    (
        "nested duplicate",
        "mixed_precision:\n  param_dtype: bf16\n  param_dtype: fp32\n",
        "line 3",
        r"key 'param_dtype' is given twice",
    ),
    ("unknown key", "mixed_precison: {}\n", "mixed_precison", r"Extra inputs|not permitted|unknown"),
    ("bad dtype", "mixed_precision: {param_dtype: bf61}\n", "mixed_precision.param_dtype", r"'bf61' is not a dtype"),
    ("reshard maybe", "reshard_after_forward: maybe\n", "reshard_after_forward", r"'maybe' is not valid here"),
    ("reshard 0", "reshard_after_forward: 0\n", "reshard_after_forward", r"rank count >= 1, got 0"),
    ("replicate 0", "mesh: {replicate: 0}\n", "mesh.replicate", r"positive rank count or -1 .*, got 0"),
    ("empty match", "wrap:\n  - match: {}\n", "wrap.0.match", r"needs 'class' and/or 'path'"),
    (
        "placement dim str",
        "shard_placement:\n  - {path: '*', dim: x}\n",
        "shard_placement.0.dim",
        r"'x' is not valid here",
    ),
    ("placement no path", "shard_placement:\n  - {dim: 1}\n", "shard_placement.0.path", r"required|missing"),
    ("offload device", "offload: {device: gpu}\n", "offload.device", r"'gpu' is not valid here"),
    ("zero stage", "zero_stage: 4\n", "zero_stage", r"^4 is not valid here$"),
    ("sharding shard", "sharding: {shard: everything}\n", "sharding.shard", r"'everything' is not valid here"),
    (
        "rule sharding",
        "wrap:\n  - match: {class: B}\n    sharding: {shard: nope}\n",
        "wrap.0.sharding.shard",
        r"'nope'",
    ),
    ("a list", "- mesh\n", "", r"top level must be a mapping"),
    ("not yaml", "mesh: [1, 2\n", "line", r"not valid YAML"),
    ("binary", b"\xff\xfe\x00\x01", "", r"not a text file"),
]


@pytest.mark.parametrize(("name", "text", "location", "message"), YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_yaml(name: str, text: str, location: str, message: str, tmp_path: Path) -> None:
    found = yaml_problems(tmp_path, text)
    assert any(p.location.startswith(location) and re.search(message, p.message) for p in found), found


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(fl.ConfigError, match=r"nope.yaml[\s\S]*cannot read the file: No such file"):
        fl.FSDPConfig.from_yaml(tmp_path / "nope.yaml")


def config(data: dict) -> fl.FSDPConfig:
    return fl.FSDPConfig.model_validate(data)


BLOCKS = {"wrap": [{"match": {"class": "UnevenBlock"}}]}

APPLY = [
    Case(
        "config is a path",
        plain(lambda m: fl.apply_config(m, "x.yaml")),
        TypeError,
        r"got the path 'x.yaml': pass fsdp2lite.FSDPConfig.from_yaml\('x.yaml'\)",
    ),
    Case(
        "config is a dict",
        plain(lambda m: fl.apply_config(m, dict(BLOCKS))),
        TypeError,
        r"got a dict: pass fsdp2lite.FSDPConfig.model_validate",
    ),
    Case(
        "model is a str",
        plain(lambda m: fl.apply_config("model", config(BLOCKS))),
        TypeError,
        r"model must be an nn.Module, got str",
    ),
    Case(
        "mesh is a str",
        plain(lambda m: fl.apply_config(m, config(BLOCKS), mesh="cpu")),
        TypeError,
        r"mesh must be a DeviceMesh or None, got str",
    ),
    Case(
        "already sharded",
        lambda: (sharded(), lambda m: fl.apply_config(m, config(BLOCKS))),
        ValueError,
        r"UnevenMLP is already sharded \(fully_shard was applied to <root>, blocks.0",
    ),
    Case(
        "rule matches a ModuleList",
        plain(lambda m: fl.apply_config(m, config({"wrap": [{"match": {"path": "blocks"}}]}))),
        fl.ConfigError,
        r"blocks: cannot shard a ModuleList: it has no forward.*children.*path: 'blocks.\*'",
    ),
    Case(
        "reshard 2 of 1",
        plain(
            lambda m: fl.apply_config(
                m, config({"wrap": [{"match": {"class": "UnevenBlock"}, "reshard_after_forward": 2}]})
            )
        ),
        fl.ConfigError,
        r"wrap.0: reshard_after_forward=2 must divide the shard group size \(1\).*\[1\]",
    ),
    Case(
        "root mixes dtypes",
        lambda: (Mixed(), lambda m: fl.apply_config(m, config({}))),
        fl.ConfigError,
        r"<root>: its trainable parameters reduce their gradients in 2 dtypes "
        r"\(float32: a.weight, a.bias; bfloat16: b.weight.*param_dtype",
    ),
    Case(
        "rule matches nothing",
        plain(lambda m: fl.apply_config(m, config({"wrap": [{"match": {"class": "Block"}}]}))),
        fl.ConfigError,
        r"wrap.0.match: matches no module.*UnevenBlock",
    ),
    Case(
        "placement matches nothing",
        plain(lambda m: fl.apply_config(m, config({**BLOCKS, "shard_placement": [{"path": "x.*", "dim": 1}]}))),
        fl.ConfigError,
        r"shard_placement.0: matches no parameter",
    ),
    Case(
        "placement dim too big",
        plain(lambda m: fl.apply_config(m, config({**BLOCKS, "shard_placement": [{"path": "head.bias", "dim": 1}]}))),
        fl.ConfigError,
        r"head.bias: shard_placement.0 asks for dim 1.*shape \(2,\)",
    ),
    Case(
        "0-dim parameter",
        lambda: (Scalar(), lambda m: fl.apply_config(m, config({}))),
        fl.ConfigError,
        r"scale: 0-dim parameter",
    ),
    Case(
        "mesh degrees",
        plain(lambda m: fl.apply_config(m, config({**BLOCKS, "mesh": {"replicate": 2}}))),
        ValueError,
        r"replicate\(2\) does not divide world_size\(1\)",
    ),
]


@pytest.mark.parametrize("case", APPLY, ids=lambda c: c.name)
def test_apply_config(case: Case, one_rank: DeviceMesh) -> None:
    check(case)


def test_apply_config_failing_part_way_puts_everything_back(
    one_rank: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after some groups were sharded (here injected into the third group's build) leaves
    the model exactly as before; the same config then applies cleanly."""
    import fsdp2lite.api

    real = fsdp2lite.api.build_spec
    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].modules)
        if len(calls) == 3:
            raise RuntimeError("injected failure in the third group")
        return real(*args, **kwargs)

    model = mlp()
    before = fingerprint(model)
    monkeypatch.setattr(fsdp2lite.api, "build_spec", failing)
    with pytest.raises(RuntimeError, match="injected failure in the third group"):
        fl.apply_config(model, config(BLOCKS))
    assert len(calls) == 3
    assert_unchanged(model, before)
    monkeypatch.setattr(fsdp2lite.api, "build_spec", real)
    fl.apply_config(model, config(BLOCKS))
    model(torch.randn(2, 16)).sum().backward()
    assert isinstance(model, fl.FSDPModule) and all(p.grad is not None for p in model.parameters())


# ---- the CLI -----------------------------------------------------------------------------------------

FACTORY = "fsdp2lite.models:gpt_small"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


CLI = [
    (
        "explain: reshard 3 at world 2",
        lambda t: ["explain", write(t, "reshard_after_forward: 3\n"), "--model", FACTORY, "--world-size", "2"],
        1,
        r"reshard_after_forward=3 must.*divide the shard group size \(2\)",
    ),
    (
        "explain: rule on a ModuleList",
        lambda t: ["explain", write(t, "wrap:\n  - match: {path: blocks}\n"), "--model", FACTORY],
        1,
        r"cannot shard a ModuleList: it.*has no forward",
    ),
    (
        "explain: mixed dtypes",
        lambda t: ["explain", write(t, "wrap:\n  - match: {class: Block}\n"), "--model", "fsdp2lite.models:nope"],
        2,
        r"nope",
    ),
    (
        "validate: duplicate key",
        lambda t: ["validate", write(t, "wrap: []\nwrap: []\n")],
        1,
        r"key 'wrap' is given twice",
    ),
    ("validate: missing file", lambda t: ["validate", str(t / "missing.yaml")], 1, r"cannot read the file"),
    (
        "explain: world size 0",
        lambda t: ["explain", write(t, "{}\n"), "--model", FACTORY, "--world-size", "0"],
        2,
        r"--world-size.*0",
    ),
    (
        "consolidate: not a checkpoint",
        lambda t: ["consolidate", str(t), str(t / "out.pt")],
        1,
        r"no .metadata file|not a complete DCP checkpoint",
    ),
    ("consolidate: bad dtype", lambda t: ["consolidate", str(t), str(t / "out.pt"), "--dtype", "fp13"], 2, r"fp13"),
]


@pytest.mark.parametrize(("name", "argv", "code", "message"), CLI, ids=[c[0] for c in CLI])
def test_cli(
    name: str,
    argv: Callable[[Path], list[str]],
    code: int,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        got = main(argv(tmp_path))
    except SystemExit as exit_:  # argparse errors
        got = exit_.code
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert got == code, text
    assert re.search(message, text), text
    assert "Traceback" not in text


# ---- checkpoints -------------------------------------------------------------------------------------


def saved(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    model = sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt"
    fl.save_checkpoint(path, model, optimizer)
    return model, optimizer, path


def test_checkpoint_argument_errors(one_rank: DeviceMesh, tmp_path: Path) -> None:
    model, optimizer, path = saved(tmp_path)
    before = fingerprint(model)
    cases = [
        (
            lambda: fl.load_checkpoint(path, optimizer, model),
            TypeError,
            r"got an optimizer \(AdamW\) where the model goes",
        ),
        (lambda: fl.load_checkpoint(3, model), TypeError, r"path must be a str or Path, got int"),
        (
            lambda: fl.save_checkpoint(path, model, optimizer="adam"),
            TypeError,
            r"optimizer must be a torch.optim.Optimizer, a non-empty list of them \(one per group: "
            r"fl.step_in_backward's handle.optimizers\) or None, got str",
        ),
        (lambda: fl.save_checkpoint(path, model, []), TypeError, r"or None, got an empty list"),
        (lambda: fl.load_checkpoint(path, model, [optimizer, "adam"]), TypeError, r"optimizer\[1\] must be a"),
        (
            lambda: fl.load_checkpoint(path, model, [optimizer, torch.optim.SGD([model.scale], lr=0.1)]),
            ValueError,
            r"scale is in optimizer\[0\] and optimizer\[1\]; a list of optimizers is saved as one state",
        ),
        (lambda: fl.load_checkpoint(path, "model"), TypeError, r"model must be an nn.Module, got str"),
        (lambda: fl.load_checkpoint(tmp_path / "none", model), fl.CheckpointError, r"none: not a directory"),
    ]
    regular = tmp_path / "a_file"
    regular.write_text("x")
    cases.append((lambda: fl.save_checkpoint(regular, model), fl.CheckpointError, r"a_file: exists and is a file"))
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
        assert_unchanged(model, before)
    assert regular.read_text() == "x"


def test_damaged_checkpoint_loads_nothing(one_rank: DeviceMesh, tmp_path: Path) -> None:
    """The last tensor's bytes overwritten (right size): CheckpointError (an Exception) naming it, the
    model and optimizer untouched; a good checkpoint then loads."""
    model, optimizer, path = saved(tmp_path)
    metadata = fl.checkpoint.read_metadata(path)
    items = [(index, info) for index, info in metadata.storage_data.items() if str(index.fqn).startswith("model.")]
    index, last = max(items, key=lambda item: (item[1].relative_path, item[1].offset))
    good = (path / last.relative_path).read_bytes()
    data = bytearray(good)
    data[last.offset : last.offset + last.length] = b"A" * last.length
    (path / last.relative_path).write_bytes(bytes(data))
    in_checkpoint = {name: param.detach().clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # differs from the checkpoint: a partial load would show
    before = fingerprint(model)
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with pytest.raises(fl.CheckpointError, match=rf"reading failed, nothing was loaded.*damaged data for {index.fqn}"):
        fl.load_checkpoint(path, model, optimizer)
    assert_unchanged(model, before)
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, optimizer.state.values()))
    (path / last.relative_path).write_bytes(good)
    fl.load_checkpoint(path, model, optimizer)
    for name, param in model.named_parameters():  # the good checkpoint's values are back
        assert torch.equal(param.detach(), in_checkpoint[name]), name


def test_checkpoint_that_does_not_fit(one_rank: DeviceMesh, tmp_path: Path) -> None:
    _, _, path = saved(tmp_path)
    torch.manual_seed(1)
    other = UnevenMLP(d=8)
    for block in other.blocks:
        fl.fully_shard(block)
    fl.fully_shard(other)
    before = fingerprint(other)
    with pytest.raises(
        fl.CheckpointError,
        match=r"does not fit this model[\s\S]*blocks.0.up.weight: shape \(37, 16\) in the checkpoint, \(37, 8\)",
    ):
        fl.load_checkpoint(path, other)
    assert_unchanged(other, before)


def test_catalogue_size() -> None:
    """The catalogue covers at least 80 bad inputs (each parametrized case and each listed call)."""
    listed = 6 + 1 + 4 + 2  # checkpoint argument calls, the damaged checkpoint, load_state_dict, first forward
    total = len(FULLY_SHARD) + len(FOUR_RANKS) + len(SETTERS) + len(YAML_CASES) + len(APPLY) + len(CLI) + listed
    assert total >= 80, total


def test_load_state_dict_that_does_not_fit_loads_nothing(one_rank: DeviceMesh) -> None:
    """torch's load_state_dict copies every key that fits before it raises for the ones that do not;
    an FSDPModule checks first: nothing is copied, and the right dict then loads."""
    model = sharded()
    torch.manual_seed(5)
    other = UnevenMLP()
    good = other.state_dict()  # plain full tensors, other values than the model's
    bad_shape = {k: (v[:-1] if k == "head.weight" else v) for k, v in good.items()}
    missing = {k: v for k, v in good.items() if k != "blocks.1.down.bias"}
    extra = {**good, "blocks.0.nope": torch.zeros(1)}
    before = fingerprint(model)
    for state, match in (
        (bad_shape, r"nothing was loaded[\s\S]*size mismatch for head.weight: copying a param with shape \(1, 16\)"),
        (missing, r"Missing key\(s\) in state_dict: blocks.1.down.bias"),
        (extra, r"Unexpected key\(s\) in state_dict: blocks.0.nope"),
        ([1, 2], r"expects a mapping of names to tensors, got list"),
    ):
        with pytest.raises((RuntimeError, TypeError), match=match):
            model.load_state_dict(state)
        assert_unchanged(model, before)
    model.load_state_dict(good)
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), good[name]), name


def test_fully_shard_after_a_refusal_the_fix_works(one_rank: DeviceMesh) -> None:
    """Doing what the message says works on the very module that was refused: nothing was left behind."""
    model = mlp()
    with pytest.raises(ValueError, match=r"same Linear twice"):
        fl.fully_shard([model.head, model.head])
    fl.fully_shard([model.head])  # each module once
    mixed = Mixed()
    with pytest.raises(ValueError, match=r"param_dtype"):
        fl.fully_shard(mixed)
    fl.fully_shard(mixed, mp_policy=fl.MixedPrecisionPolicy(param_dtype="bf16"))
    mixed(torch.randn(3, 2)).float().sum().backward()
    assert all(p.grad is not None for p in mixed.parameters())
    scalar = Scalar()
    with pytest.raises(ValueError, match=r"0-dim"):
        fl.fully_shard(scalar)
    fl.fully_shard(scalar, ignored_params={scalar.scale})
    assert isinstance(scalar, fl.FSDPModule) and not hasattr(scalar.scale, "placements")
