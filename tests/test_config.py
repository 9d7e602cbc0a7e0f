"""FSDPConfig: loading, strictness, error reports, rule planning, and apply_config on real ranks."""

from __future__ import annotations

import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch
import yaml
from _dist import spawn_checks
from _models import TINY_GPT, gpt_batch, gpt_loss, tiny_gpt
from _parity import train_and_compare
from pydantic import BaseModel, ValidationError
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.config import Match, Problem, WrapRule, problems_from

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> list[fl.config.Problem]:
    with pytest.raises(fl.ConfigError) as info:
        fl.FSDPConfig.from_yaml(write(tmp_path, text))
    return info.value.problems


# ---- loading -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path: Path, tmp_path: Path) -> None:
    config = fl.FSDPConfig.from_yaml(path)
    again = fl.FSDPConfig.from_yaml(write(tmp_path, config.to_yaml()))
    assert again == config


def test_shipped_configs_cover_the_documented_setups() -> None:
    assert {p.stem for p in CONFIGS} >= {"fp32", "bf16", "hsdp", "cpu_offload", "demo"}


def test_dtype_names(tmp_path: Path) -> None:
    config = fl.FSDPConfig.from_yaml(write(tmp_path, "mixed_precision: {param_dtype: bfloat16, reduce_dtype: float}"))
    assert config.mixed_precision.param_dtype is torch.bfloat16
    assert config.mixed_precision.reduce_dtype is torch.float32
    [problem] = problems(tmp_path, "mixed_precision: {param_dtype: bf61}")
    assert problem.location == "mixed_precision.param_dtype"
    assert "'bf61' is not a dtype" in problem.message and "bf16" in problem.message


def test_unknown_keys_get_the_closest_valid_key(tmp_path: Path) -> None:
    found = problems(tmp_path, "mixed_precison: {}\nwrap:\n  - match: {clas: Block}\n")
    by_location = {p.location: p for p in found}
    assert by_location["mixed_precison"].suggestion == "did you mean 'mixed_precision'?"
    assert by_location["wrap.0.match.clas"].suggestion == "did you mean 'class'?"


def test_all_errors_are_reported_at_once(tmp_path: Path) -> None:
    text = "mesh: {replicate: 0}\nreshard_after_forward: sometimes\noffload: {device: gpu}\nextra: 1\n"
    locations = {p.location for p in problems(tmp_path, text)}
    assert {"mesh.replicate", "offload.device", "extra"} <= locations
    assert any(loc.startswith("reshard_after_forward") for loc in locations)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("wrap: [\n  {match: \n", "not valid YAML"),
        ("- a\n- b\n", "must be a mapping of keys, got a list"),
    ],
)
def test_files_that_are_not_configs(tmp_path: Path, text: str, message: str) -> None:
    [problem] = problems(tmp_path, text)
    assert message in problem.message
    with pytest.raises(fl.ConfigError, match=str(tmp_path / "config.yaml")):
        fl.FSDPConfig.from_yaml(tmp_path / "config.yaml")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(fl.ConfigError, match=r"(?s)missing.yaml.*cannot read the file"):
        fl.FSDPConfig.from_yaml(tmp_path / "missing.yaml")


def test_model_validate_raises_pydantic_errors_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"wrap\.0\.group"):
        fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}, "group": "maybe"}]})
    with pytest.raises(ValidationError, match="a match needs 'class' and/or 'path'"):
        fl.FSDPConfig.model_validate({"wrap": [{"match": {}}]})


def test_mesh_degrees() -> None:
    mesh = fl.config.MeshConfig(replicate=2, shard=-1)
    assert mesh.resolve(8) == (2, 4)
    with pytest.raises(ValueError, match=r"mesh replicate\(2\) \* shard\(3\) != world_size\(8\)"):
        fl.config.MeshConfig(replicate=2, shard=3).resolve(8)
    with pytest.raises(ValueError, match=r"replicate\(3\) does not divide world_size\(8\)"):
        mesh.model_copy(update={"replicate": 3}).resolve(8)
    # replicate: -1 takes the ranks shard leaves (HSDP over groups of a fixed size; issue 24)
    groups_of_4 = fl.config.MeshConfig(replicate=-1, shard=4)
    assert [groups_of_4.resolve(n) for n in (4, 8, 32)] == [(1, 4), (2, 4), (8, 4)]
    with pytest.raises(ValueError, match=r"mesh shard\(4\) does not divide world_size\(6\), so replicate=-1"):
        groups_of_4.resolve(6)
    for bad, message in (
        ({"replicate": -1}, r"replicate: -1 takes the ranks that shard leaves, so shard must be a number"),
        ({"replicate": 0}, r"replicate must be a positive rank count or -1 \(the remaining ranks\), got 0"),
        ({"replicate": -2, "shard": 2}, r"replicate must be a positive rank count or -1"),
    ):
        with pytest.raises(ValidationError, match=message):
            fl.config.MeshConfig.model_validate(bad)
    with pytest.raises(ValueError, match=r"only one degree can take the remaining ranks"):
        fl.mesh.resolve_mesh_degrees(-1, -1, 8)


# ---- planning ------------------------------------------------------------------------------------
def test_plan_first_match_wins_and_groups_bottom_up() -> None:
    config = fl.FSDPConfig(
        wrap=[
            WrapRule(match=Match(path="blocks.0")),
            WrapRule(match=Match(class_="Block"), reshard_after_forward=False),
            WrapRule(match=Match(path=["tok_emb", "head"]), group=True, mixed_precision={"param_dtype": "bf16"}),
            WrapRule(match=Match(class_="Linear", path="blocks.*.mlp.*")),
        ]
    )
    plan = fl.plan_config(tiny_gpt(), config)
    assert not plan.problems
    paths = [g.paths for g in plan.groups]
    assert paths[-1] == ("",)  # root last
    depths = [g.depth for g in plan.groups]
    assert depths == sorted(depths, reverse=True), "deeper groups are applied first"
    assert ("blocks.0.mlp.0",) in paths and ("blocks.0",) in paths and ("tok_emb", "head") in paths
    by_paths = {g.paths: g for g in plan.groups}
    assert by_paths[("blocks.0",)].rule_index == 0 and by_paths[("blocks.1",)].rule_index == 1
    assert by_paths[("blocks.1",)].policy.reshard_after_forward is False
    merged = by_paths[("tok_emb", "head")].policy.mixed_precision
    assert merged.param_dtype is torch.bfloat16 and merged.cast_forward_inputs is True


def test_rule_that_matches_nothing_lists_the_model_classes() -> None:
    config = fl.FSDPConfig(wrap=[WrapRule(match=Match(class_="TransformerBlock"))], ignore=[Match(path="*.rotary")])
    plan = fl.plan_config(tiny_gpt(), config)
    assert [p.location for p in plan.problems] == ["wrap.0.match", "ignore.0"]
    assert "Block" in plan.problems[0].suggestion and "Embedding" in plan.problems[0].suggestion
    with pytest.raises(fl.ConfigError, match=r"wrap.0.match: matches no module"):
        fl.apply_config(tiny_gpt(), config)  # no process group here: rejected before a mesh is built


def test_shard_placement_rules_are_planned_and_checked() -> None:
    """First match wins; a rule matching nothing is a problem; a dim the parameter lacks, or a Shard(d)
    parameter in a group resharding to k ranks, is refused by name before anything is sharded."""
    config = fl.FSDPConfig.model_validate(
        {
            "wrap": [{"match": {"class": "Block"}}],
            "shard_placement": [
                {"path": "blocks.0.mlp.*.weight", "dim": -1},
                {"path": ["blocks.*.mlp.0.weight", "nothing.*"], "dim": 0},
                {"path": "ln_f.*", "dim": 1},
            ],
        }
    )
    plan = fl.plan_config(tiny_gpt(), config)
    expected = {"blocks.0.mlp.0.weight": 1, "blocks.0.mlp.2.weight": 1, "blocks.1.mlp.0.weight": 0}
    assert plan.shard_dims == expected, plan.shard_dims
    assert [p.location for p in plan.problems] == ["shard_placement.2"], plan.problems
    bad = fl.FSDPConfig.model_validate(
        {
            "reshard_after_forward": 2,
            "wrap": [{"match": {"class": "Block"}}],
            "shard_placement": [{"path": "blocks.0.attn.qkv.*", "dim": 1}],
        }
    )
    refused = {p.location: p.message for p in fl.plan_config(tiny_gpt(), bad).refused}
    assert "dim 1, but the parameter has shape (48,)" in refused["blocks.0.attn.qkv.bias"], refused
    assert "sharded on another dim: blocks.0.attn.qkv.weight (Shard(1))" in refused["blocks.0"], refused
    with pytest.raises(fl.ConfigError, match=r"blocks.0.attn.qkv.bias: shard_placement.0 asks for dim 1"):
        fl.apply_config(tiny_gpt(), bad)  # no process group here: rejected before a mesh is built


def test_ignore_rules_select_parameters() -> None:
    config = fl.FSDPConfig(wrap=[WrapRule(match=Match(class_="Block"))], ignore=[Match(path="pos_emb.*")])
    assert list(fl.plan_config(tiny_gpt(), config).ignored) == ["pos_emb.weight"]


# ---- apply_config on real ranks ------------------------------------------------------------------
def config_file(name: str) -> fl.FSDPConfig:
    return fl.FSDPConfig.from_yaml(next(p for p in CONFIGS if p.stem == name))


def check_parity_configs(rank: int, ws: int) -> None:
    for name in ("fp32", "demo", "cpu_offload", "shard_dim1"):
        config = config_file(name)
        torch.manual_seed(0)
        model = tiny_gpt()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cpu_offload's pin_memory on a CPU-only machine
            train_and_compare(
                model, lambda m, config=config: fl.apply_config(m, config), gpt_batch, gpt_loss, rank, label=name
            )
        groups = {id(m._fsdp_state) for m in model.modules() if isinstance(m, fl.FSDPModule)}
        assert len(groups) == TINY_GPT.n_layers + 1, name


def check_bf16_config(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = fl.apply_config(tiny_gpt(), config_file("bf16"))
    seen: dict[str, torch.dtype] = {}
    model.blocks[0].mlp[0].register_forward_pre_hook(lambda m, a: seen.update(block=m.weight.dtype))
    model.head.register_forward_pre_hook(lambda m, a: seen.update(head=m.weight.dtype))
    gpt_loss(model, gpt_batch(0, rank)).backward()
    assert seen == {"block": torch.bfloat16, "head": torch.float32}, seen
    assert model.tok_emb._fsdp_state is model.head._fsdp_state, "the tied pair is one group"
    assert all(isinstance(p, DTensor) and p.grad.dtype == torch.float32 for p in model.parameters())


def check_ignored_params(rank: int, ws: int) -> None:
    config = fl.FSDPConfig(wrap=[WrapRule(match=Match(class_="Block"))], ignore=[Match(path="pos_emb.*")])
    model = fl.apply_config(tiny_gpt(), config)
    assert not isinstance(model.pos_emb.weight, DTensor)
    assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if n != "pos_emb.weight")
    gpt_loss(model, gpt_batch(0, rank)).backward()
    assert model.pos_emb.weight.grad is not None and not isinstance(model.pos_emb.weight.grad, DTensor)


def check_placement_and_group_flags(rank: int, ws: int) -> None:
    """shard_placement rules reach fully_shard as a shard_placement_fn; reduce_scatter_unused_params
    (top level, overridden per rule) and unshard_in_backward reach the groups."""
    from torch.distributed.tensor import Shard

    model = fl.apply_config(tiny_gpt(), config_file("shard_dim1"))
    for name, param in model.named_parameters():
        dim = 1 if name.startswith("blocks.") and ".mlp." in name and name.endswith(".weight") else 0
        assert param.placements == (Shard(dim),), (name, param.placements)
    config = fl.FSDPConfig.model_validate(
        {
            "reduce_scatter_unused_params": True,
            "wrap": [
                {"match": {"class": "Block"}, "reduce_scatter_unused_params": False},
                {"match": {"path": "pos_emb"}, "unshard_in_backward": False},
            ],
        }
    )
    model = fl.apply_config(tiny_gpt(), config)
    flags = {
        name or "<root>": (
            m._fsdp_state.group.controls.reduce_scatter_unused_params,
            m._fsdp_state.group.controls.unshard_in_backward,
        )
        for name, m in model.named_modules()
        if isinstance(m, fl.FSDPModule)
    }
    assert flags == {
        "<root>": (True, True),
        "blocks.0": (False, True),
        "blocks.1": (False, True),
        "pos_emb": (True, False),
    }, flags
    gpt_loss(model, gpt_batch(0, rank)).backward()  # pos_emb's backward needs no values: it runs sharded


def check_activation_checkpointing(rank: int, ws: int) -> None:
    """activation_checkpointing: true recomputes each Block's forward in backward (it runs twice per
    step) and trains exactly like DDP."""
    config = fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}, "activation_checkpointing": True}]})
    torch.manual_seed(0)
    model = tiny_gpt()
    calls = []
    ours = {id(block.attn) for block in model.blocks}  # DDP's reference copy gets the hooks too
    for block in model.blocks:
        block.attn.register_forward_hook(lambda m, a, o: calls.append(1) if id(m) in ours else None)
    train_and_compare(
        model, lambda m: fl.apply_config(m, config), gpt_batch, gpt_loss, rank, steps=2, label="checkpointed"
    )
    assert len(calls) == 2 * 2 * TINY_GPT.n_layers, len(calls)  # 2 steps x (forward + recompute) per block


def check_replicate_inferred(rank: int, ws: int) -> None:
    """mesh: {shard: 1, replicate: -1} on 2 ranks: HSDP with 2 replicas of 1-rank shards."""
    wrap = [{"match": {"class": "Block"}}]
    config = fl.FSDPConfig.model_validate({"mesh": {"replicate": -1, "shard": 1}, "wrap": wrap})
    model = tiny_gpt()
    fl.apply_config(model, config)
    mesh = model.tok_emb.weight.device_mesh
    assert tuple(mesh.shape) == (2, 1) and mesh.mesh_dim_names == ("replicate", "shard")


def check_mesh_mismatch(rank: int, ws: int) -> None:
    config = fl.FSDPConfig.model_validate(
        {"mesh": {"replicate": 2, "shard": 3}, "wrap": [{"match": {"class": "Block"}}]}
    )
    with pytest.raises(ValueError, match=rf"mesh replicate\(2\) \* shard\(3\) != world_size\({ws}\)"):
        fl.apply_config(tiny_gpt(), config)


def check_schedule(rank: int, ws: int) -> None:
    """schedule: values reach the root's context; auto keeps the device's (CPU) defaults."""
    wrap = [{"match": {"class": "Block"}}]
    cases = (
        ({}, (1, True, False)),
        (
            {"forward_prefetch_depth": 0, "late_backward_prefetch": False, "overlap_reduce_scatter": True},
            (0, False, True),
        ),
    )
    for schedule, expected in cases:
        torch.manual_seed(0)
        config = fl.FSDPConfig.model_validate({"wrap": wrap, "schedule": schedule})
        model = fl.apply_config(tiny_gpt(), config)
        gpt_loss(model, gpt_batch(0, rank)).backward()
        context = model._fsdp_state.root_context
        got = (context.forward_prefetch_depth, context.late_backward_prefetch, context.overlap_reduce_scatter)
        assert got == expected, (schedule, got)


def test_apply_config_on_two_ranks() -> None:
    spawn_checks(
        2,
        check_parity_configs,
        check_bf16_config,
        check_ignored_params,
        check_placement_and_group_flags,
        check_activation_checkpointing,
        check_mesh_mismatch,
        check_replicate_inferred,
        check_schedule,
    )


@pytest.mark.parametrize(
    ("schedule", "location", "message"),
    [
        ({"forward_prefetch_depth": -1}, "schedule.forward_prefetch_depth", "group count >= 0 or auto, got -1"),
        ({"forward_prefetch_depth": True}, "schedule.forward_prefetch_depth", "group count >= 0 or auto, got True"),
        ({"late_backward_prefetch": "sometimes"}, "schedule.late_backward_prefetch", "'sometimes' is not valid"),
    ],
)
def test_schedule_errors_name_the_key_and_value(schedule: dict, location: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        fl.FSDPConfig.model_validate({"schedule": schedule})
    problems = problems_from(info.value)
    assert [p.location for p in problems] == [location], problems
    assert message in problems[0].message, problems


def test_union_errors_are_one_problem_listing_what_is_valid() -> None:
    with pytest.raises(ValidationError) as info:
        fl.FSDPConfig.model_validate({"reshard_after_forward": "maybe", "wrap": [{"match": {"class": 3}}]})
    problems = problems_from(info.value)
    assert problems == [
        Problem("reshard_after_forward", "'maybe' is not valid here", "use true or false, an integer, auto"),
        Problem("wrap.0.match.class", "3 is not valid here", "use a string, a list of strings"),
    ]


def _literal_fields(model: type[BaseModel], prefix: tuple[str | int, ...]) -> Iterator[tuple[tuple, list]]:
    """(location, choices) of every field of ``model`` (and the models below it) whose annotation holds a
    Literal: a choice among fixed values; a wrap rule's fields through ``wrap.0``."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        if typing.get_origin(info.annotation) is list:
            if typing.get_args(info.annotation)[0] is WrapRule:
                yield from _literal_fields(WrapRule, (*prefix, key, 0))
            continue
        args = [info.annotation, *typing.get_args(info.annotation)]  # the annotation, or a union's members
        choices = [value for arg in args if typing.get_origin(arg) is Literal for value in typing.get_args(arg)]
        if choices:
            yield (*prefix, key), choices
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _literal_fields(arg, (*prefix, key))


LITERAL_FIELDS = dict(_literal_fields(fl.FSDPConfig, ()))


def _with_value(location: tuple, value: object) -> dict:
    """A config holding ``value`` at ``location``, otherwise valid (a wrap rule gets a match)."""
    data: dict = {}
    node = data
    for key, following in zip(location, location[1:]):
        if following == 0:
            node[key] = [{"match": {"class": "Block"}}]
            node = node[key][0]
        elif key != 0:
            node = node.setdefault(key, {})
    node[location[-1]] = value
    return data


@pytest.mark.parametrize("location", LITERAL_FIELDS, ids=lambda loc: ".".join(map(str, loc)))
def test_a_value_outside_a_fixed_choice_is_named_once_with_every_choice(location: tuple, tmp_path: Path) -> None:
    """Every Literal field of the schema, top level and in a wrap rule: the message shows the value given,
    once, and every valid choice as YAML writes it."""
    path = write(tmp_path, yaml.safe_dump(_with_value(location, "bogus-choice")))
    with pytest.raises(fl.ConfigError) as info:
        fl.FSDPConfig.from_yaml(path)
    dotted = ".".join(map(str, location))
    assert [p.location for p in info.value.problems] == [dotted], info.value.problems
    assert str(info.value).count("bogus-choice") == 1, str(info.value)
    problem = info.value.problems[0]
    assert problem.message == "'bogus-choice' is not valid here"
    assert all(str(choice) in problem.suggestion for choice in LITERAL_FIELDS[location]), problem


def test_the_fixed_choices_the_issue_named() -> None:
    """The schema's fixed choices are all walked (top level and rules), and the issue's three read as asked."""
    walked = {".".join(map(str, loc)) for loc in LITERAL_FIELDS}
    assert {"zero_stage", "sharding.shard", "sharding.replicate", "offload.device", "offload.optimizer"} <= walked
    assert {"wrap.0.sharding.shard", "wrap.0.offload.device", "wrap.0.communication.all_gather"} <= walked
    cases = [
        ({"zero_stage": 4}, "zero_stage: 4 is not valid here (use 1, 2 or 3)"),
        ({"zero_stage": True}, "zero_stage: True is not valid here (use 1, 2 or 3)"),  # not stage 1 (True == 1)
        ({"sharding": {"shard": "everything"}}, "sharding.shard: 'everything' is not valid here (use params or "),
        (_with_value(("wrap", 0, "sharding", "shard"), "nope"), "wrap.0.sharding.shard: 'nope' is not valid here"),
    ]
    for data, message in cases:
        with pytest.raises(ValidationError) as info:
            fl.FSDPConfig.model_validate(data)
        text = str(fl.ConfigError("config.yaml", problems_from(info.value)))
        assert message in text, text


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            _with_value(("wrap", 0, "group"), "maybe"),
            Problem("wrap.0.group", "'maybe' is not valid here", "use true or false, tied"),
        ),
        ({"mesh": {"shard": 1.5}}, Problem("mesh.shard", "1.5 is not valid here", "use an integer")),
        (
            {"shard_placement": [{"path": "*", "dim": "x"}]},
            Problem("shard_placement.0.dim", "'x' is not valid here", "use an integer"),
        ),
        (
            {"wrap": [{"match": "Block"}]},
            Problem("wrap.0.match", "'Block' is not valid here", "use a mapping of keys (class, path)"),
        ),
        (
            {"ignore": [{"path": [1]}]},
            Problem("ignore.0.path", "[1] is not valid here", "use a string, a list of strings"),
        ),
        (
            {"precision_overrides": [{"param_dtype": "fp32"}]},
            Problem("precision_overrides.0.path", "this key is required and missing", ""),
        ),
    ],
    ids=["bool", "int", "int in a list", "model", "nested union", "missing"],
)
def test_a_wrong_type_names_the_value_and_what_would_do(data: dict, expected: Problem) -> None:
    with pytest.raises(ValidationError) as info:
        fl.FSDPConfig.model_validate(data)
    assert problems_from(info.value) == [expected]


def test_ties_across_sibling_groups_are_refused() -> None:
    """tok_emb and head share one Parameter: two rules putting them in two groups would untie them."""
    config = fl.FSDPConfig(wrap=[WrapRule(match=Match(path="head")), WrapRule(match=Match(path="tok_emb"))])
    plan = fl.plan_config(tiny_gpt(), config)
    assert [p.location for p in plan.refused] == ["tok_emb.weight"]
    assert "tied to a parameter that group 'head' already owns" in plan.refused[0].message
    with pytest.raises(fl.ConfigError, match="tok_emb.weight: tied"):
        fl.apply_config(tiny_gpt(), config)  # no process group: refused before a mesh is built
    grouped = fl.FSDPConfig(wrap=[WrapRule(match=Match(path=["head", "tok_emb"]), group=True)])
    assert not fl.plan_config(tiny_gpt(), grouped).refused


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\x80\x81\xfe\xff" * 8)
    with pytest.raises(fl.ConfigError, match="not a text file"):
        fl.FSDPConfig.from_yaml(path)


def test_schedule_keys_are_the_runtime_settings() -> None:
    """Every ScheduleConfig key is a root setting with a device default (explain shows those)."""
    from fsdp2lite._runtime.root import ScheduleDefaults, schedule_defaults
    from fsdp2lite.config import ScheduleConfig

    assert tuple(ScheduleConfig.model_fields) == ScheduleDefaults._fields
    for key in ScheduleDefaults._fields:
        assert callable(getattr(fl.FSDPModule, f"set_{key}", None)), key
    assert schedule_defaults(on_cuda=False) == (1, True, False)
    assert schedule_defaults(on_cuda=True) == (0, False, True)


@pytest.mark.parametrize(
    "match",
    [
        {"class": "Block"},
        {"class": ["Block", "MLP"], "path": "blocks.*"},
        {"path": ["*embed_tokens", "lm_head", "layers.[0-2]", "layers.?1", "a.b"]},
        {"path": "*.[!0-9]*"},
    ],
)
def test_a_rules_matcher_answers_as_matches_does(match: dict) -> None:
    """``Match.matcher()`` (what a plan tests every module with: a class set and one regular expression) says
    what ``Match.matches`` (a glob at a time) says, for every path and class, special glob characters included."""
    rule = Match.model_validate(match)
    test = rule.matcher()
    paths = [
        "",
        "a.b",
        "a.bc",
        "lm_head",
        "model.lm_head",
        "model.embed_tokens",
        "layers.1",
        "layers.3",
        "layers.21",
        "layers.1.x",
        "blocks.0",
        "blocks.0.mlp",
        "x.y",
        "x.1",
        "x.\n",
    ]
    for path in paths:
        for class_name in ("Block", "MLP", "Linear"):
            assert test(path, class_name) is rule.matches(path, class_name), (path, class_name)
    assert any(test(path, c) for path in paths for c in ("Block", "MLP", "Linear"))
