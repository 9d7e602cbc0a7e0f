"""The config subcommands: ``validate``, ``explain``, ``schema``, and the demo's ``--config``.

In-process through ``fsdp2lite.cli.main`` (rich prints plain text to a captured stdout); one
subprocess run checks the console script end to end. ``COLUMNS`` is widened so table cells do not wrap.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _cpu_env import cpu_env
from _models import tiny_llama

from fsdp2lite.cli import main
from fsdp2lite.cli.demo import builtin_policy, load_policy
from fsdp2lite.cli.explain import Explanation, explain_config, sharded_nbytes
from fsdp2lite.cli.schema import markdown_reference
from fsdp2lite.config import FSDPConfig
from fsdp2lite.models import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(path) for path in (REPO / "configs").glob("*.yaml"))
HF_CONFIG = str(REPO / "configs" / "hf_causal_lm.yaml")  # for Hugging Face models (examples/train.py)
# for Hugging Face decoder layers: full training and LoRA/QLoRA fine-tuning (examples/train.py --finetune)
HF_CONFIGS = [HF_CONFIG, str(REPO / "configs" / "qlora_llama.yaml")]
GPT_CONFIGS = [config for config in CONFIGS if config not in HF_CONFIGS]  # for fsdp2lite's GPT
FACTORY = "fsdp2lite.models:gpt_small"


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def _write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _explain(config: FSDPConfig, world_size: int = 8, model: nn.Module | None = None) -> Explanation:
    if model is None:
        with torch.device("meta"):
            model = GPT(GPTConfig())
    return explain_config(model, config, world_size)


# ---- validate -----------------------------------------------------------------------------------
def test_validate_every_shipped_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert CONFIGS, "configs/*.yaml not found"
    assert main(["validate", *CONFIGS]) == 0
    out = capsys.readouterr().out
    for path in CONFIGS:
        assert f"✓ {path}: valid" in out


def test_validate_unknown_key_names_location_and_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "wrap: [{match: {clas: Block}}]\n")
    assert main(["validate", path]) == 1
    out = capsys.readouterr().out
    assert path in out and "wrap.0.match.clas" in out and "did you mean 'class'?" in out


def test_validate_shows_every_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        "mesh: {replicat: 2}\nmixed_precision: {param_dtype: bf17}\nreshard_after_forward: 0\n"
        "wrap: [{match: {}}, {mtch: {class: Block}}]\nfoo: 1\n",
    )
    assert main(["validate", CONFIGS[0], path]) == 1
    out = capsys.readouterr().out
    assert f"✓ {CONFIGS[0]}: valid" in out and "1 of 2 file(s) invalid" in out
    for location in (
        "mesh.replicat",
        "mixed_precision.param_dtype",
        "reshard_after_forward",
        "wrap.0.match",
        "wrap.1.mtch",
        "foo",
    ):
        assert location in out, location
    assert "did you mean 'replicate'?" in out and "'bf17' is not a dtype" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the file"),
        ("mesh: [1, 2\n", "not valid YAML"),
        ("- mesh\n- wrap\n", "the top level must be a mapping of keys, got a list"),
        (b"\xff\xfe\x00\x01", "not a text file"),
    ],
    ids=["missing", "not-yaml", "list", "binary"],
)
def test_validate_unreadable_files_exit_1_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "config.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main(["validate", str(path)]) == 1
    captured = capsys.readouterr()
    assert message in captured.out and "Traceback" not in captured.out + captured.err


def test_validate_console_script_has_no_traceback(tmp_path: Path) -> None:
    bad = _write(tmp_path, "offload: {device: gpu}\n")
    result = subprocess.run(
        [sys.executable, "-m", "fsdp2lite", "validate", bad, str(tmp_path / "missing.yaml")],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert "offload.device" in result.stdout and "cannot read the file" in result.stdout


def test_validate_names_a_value_outside_a_fixed_choice_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's three: the value given and the valid ones, each value once, top level and in a rule."""
    path = _write(
        tmp_path,
        "zero_stage: 4\nsharding: {shard: everything}\nwrap:\n  - match: {class: Block}\n    sharding: {shard: nope}\n",
    )
    assert main(["validate", path]) == 1
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") == 4}
    assert set(rows) == {"zero_stage", "sharding.shard", "wrap.0.sharding.shard"}, out
    assert "4 is not valid here" in rows["zero_stage"] and "use 1, 2 or 3" in rows["zero_stage"]
    assert "'everything' is not valid here" in rows["sharding.shard"] and "use params or optimizer" in out
    assert "'nope' is not valid here" in rows["wrap.0.sharding.shard"]
    assert out.count("everything") == 1 and out.count("nope") == 1


def test_validate_refuses_settings_that_contradict_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a model: the checks fully_shard makes of a group's settings, on the top level's policy and
    each rule's (ZeRO-1/2 with a reshard; optimizer_only with HFSDP); explain refuses the same, with the model."""
    path = _write(
        tmp_path,
        "zero_stage: 2\nreshard_after_forward: true\nmesh: {replicate: 2}\nwrap:\n"
        "  - match: {class: Block}\n    offload: {device: cpu, optimizer_only: true}\n"
        "    sharding: {replicate: optimizer}\n"
        "  - match: {class: MLP}\n    reshard_after_forward: false\n",  # ZeRO-2, kept: no problem
    )
    monkeypatch.setenv("COLUMNS", "400")  # the messages on one line each
    assert main(["validate", path]) == 1
    out = capsys.readouterr().out
    assert "<top>" in out and "reshard_after_forward=True would free them" in out
    assert "wrap.0" in out and "both move where the masters live" in out and "wrap.1" not in out
    assert main(["explain", path, "--model", FACTORY, "--world-size", "4"]) == 1
    assert "reshard_after_forward=True would free them" in capsys.readouterr().out


def test_validate_says_what_an_offload_budget_still_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """offload: {device: none, budget: ...} is the planner's input (device: none for the groups it leaves),
    valid; the check line says how it becomes a placement, which training needs."""
    path = _write(tmp_path, "offload: {device: none, budget: 20GiB}\n")
    assert main(["validate", path]) == 0
    out = capsys.readouterr().out
    assert f"✓ {path}: valid (offload.budget 20GiB is resolved into groups to offload" in out
    assert f"fsdp2lite estimate --config {path} --model M --world-size N" in out and "train with OUT.yaml" in out


# ---- explain: the command -----------------------------------------------------------------------
@pytest.mark.parametrize("config", GPT_CONFIGS, ids=lambda path: Path(path).name)
def test_explain_every_shipped_config(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", config, "--model", FACTORY, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "<root>  top-level" in out
    assert "4 x Block (blocks.0 .. blocks.3)  wrap[0]: class=Block" in out  # the four alike blocks: one node
    two_d = config.endswith(("hsdp.yaml", "hfsdp.yaml"))
    degree = "shard degree 4, replicate 2" if two_d else "shard degree 8, replicate 1"
    assert "summary: 834,304 params" in out and degree in out
    assert "schedule (root): forward_prefetch_depth=" in out


def test_explain_shows_the_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "schedule.yaml"
    schedule = "schedule: {forward_prefetch_depth: 2, late_backward_prefetch: false}"
    path.write_text(f"wrap:\n  - match: {{class: Block}}\n{schedule}\n")
    assert main(["explain", str(path), "--model", FACTORY]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich may wrap the line
    assert (
        "schedule (root): forward_prefetch_depth=2 · late_backward_prefetch=false · "
        "overlap_reduce_scatter=auto (CPU false, CUDA true)"
    ) in out


def test_explain_rule_matching_nothing_exits_1_listing_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "wrap:\n  - match: {class: Block}\n  - match: {class: TransformerLayer}\n")
    assert main(["explain", path, "--model", FACTORY]) == 1
    out = capsys.readouterr().out
    assert "rules that match nothing" in out and "wrap.1.match" in out
    assert "Attention, Block, Embedding, GELU, GPT, LayerNorm, Linear, ModuleList, Sequential" in out


def test_explain_invalid_config_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "wrap: [{match: {clas: Block}}]\n")
    assert main(["explain", path, "--model", FACTORY]) == 1
    assert "wrap.0.match.clas" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fsdp2lite.models", "expected 'pkg.module:factory'"),
        ("fsdp2lite.no_such_module:build", "cannot import 'fsdp2lite.no_such_module'"),
        ("fsdp2lite.models:no_such_factory", "has no attribute 'no_such_factory'"),
        ("fsdp2lite.models:GPTConfig.vocab_size", "is not callable (type int)"),
        ("fsdp2lite.models:GPT", "raised TypeError"),  # needs a config argument
        ("fsdp2lite.models:GPTConfig", "returned a GPTConfig, not an nn.Module"),
    ],
)
def test_explain_bad_model_spec_exits_2_naming_it(spec: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", CONFIGS[0], "--model", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and spec in err[0] and expected in err[0] and "--model" in err[0], err


def test_explain_world_size_the_mesh_cannot_use_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(REPO / "configs" / "hsdp.yaml"), "--model", FACTORY, "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "--world-size" in err and "replicate(2)" in err


def test_explain_warns_about_large_modules_left_in_the_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "wrap: []\n")
    assert main(["explain", path, "--model", FACTORY]) == 0  # a warning, not an error
    out = capsys.readouterr().out
    assert "large modules left in the root group" in out and "- match: {class: Block}" in out


# ---- explain: the numbers -----------------------------------------------------------------------
def test_group_numbers_for_one_block_match_a_hand_computation() -> None:
    explanation = _explain(FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}}]}), world_size=3)
    # One Block at d_model=128 over 3 ranks: rows are padded to ceil(dim0 / 3) = 43, 128 or 171.
    #   norm1 w+b, proj.bias, norm2 w+b, mlp.2.bias: 6 x 43      qkv.weight 128 x 128, qkv.bias 128
    #   proj.weight 43 x 128      mlp.0.weight 171 x 128, mlp.0.bias 171      mlp.2.weight 43 x 512
    sharded_numel = 6 * 43 + 128 * 128 + 128 + 43 * 128 + 171 * 128 + 171 + 43 * 512
    unsharded_numel = 4 * 128 + 3 * 128 * 128 + 3 * 128 + 128 * 128 + 128 + 2 * 512 * 128 + 512 + 128
    assert (sharded_numel, unsharded_numel) == (66_349, 198_272)
    block = explanation.rows[0]
    assert block.paths == ("blocks.0",) and block.rule == "wrap[0]: class=Block" and len(block.param_names) == 12
    assert (block.numel, block.sharded_bytes, block.unsharded_bytes) == (198_272, 4 * 66_349, 4 * 198_272)
    root = explanation.rows[-1]
    assert root.label == "<root>" and root.rule == "top-level"
    # tok_emb (tied to head) 256 x 128 -> 86 rows, pos_emb 64 x 128 -> 22 rows, norm w+b 128 -> 43 each
    assert root.param_names == ("tok_emb.weight", "pos_emb.weight", "norm.weight", "norm.bias")
    assert root.sharded_bytes == 4 * (86 * 128 + 22 * 128 + 2 * 43)


def test_groups_partition_the_model_and_cover_a_world_size_share() -> None:
    for config in CONFIGS:
        explanation = _explain(
            FSDPConfig.from_yaml(config), world_size=8, model=_llama() if config in HF_CONFIGS else None
        )
        assert sum(row.numel for row in explanation.rows) == explanation.total_numel  # tied head counted once
        assert sum(row.unsharded_bytes for row in explanation.rows) == explanation.total_bytes
        assert explanation.sharded_bytes * explanation.shard >= explanation.total_bytes
        assert explanation.rows[-1].is_root and not (explanation.unmatched or explanation.refused)


def _llama() -> nn.Module:
    with torch.device("meta"):
        return tiny_llama(layers=3, tied=True)


def test_hf_config_gives_one_group_per_decoder_layer_and_a_bf16_root() -> None:
    """One group per decoder layer, and the tied embedding and head (Llama-3.2-1B's) one group of their own:
    ``group: tied`` puts modules sharing a parameter together; the root keeps the final norm."""
    explanation = _explain(FSDPConfig.from_yaml(HF_CONFIG), world_size=8, model=_llama())
    assert [row.paths for row in explanation.rows] == [
        ("model.layers.0",),
        ("model.layers.1",),
        ("model.layers.2",),
        ("model.embed_tokens", "lm_head"),
        ("",),
    ]
    tied, root = explanation.rows[-2], explanation.rows[-1]
    assert tied.param_names == ("model.embed_tokens.weight",), "tied to the head: one parameter, counted once"
    assert tied.rule == "wrap[1]: path=[*embed_tokens, *wte, *embed_in, *lm_head, *embed_out] (tied modules grouped)"
    assert root.param_names == ("model.norm.weight",)
    assert all(row.policy.mixed_precision.param_dtype is torch.bfloat16 for row in explanation.rows)


def test_tied_group_and_policies_of_bf16_config() -> None:
    explanation = _explain(FSDPConfig.from_yaml(REPO / "configs" / "bf16.yaml"))
    tied = next(row for row in explanation.rows if row.paths == ("tok_emb", "head"))
    assert tied.param_names == ("tok_emb.weight",) and tied.rule == "wrap[1]: path=[tok_emb, head] (group)"
    assert tied.policy.mixed_precision.param_dtype == torch.float32
    assert explanation.rows[0].policy.mixed_precision.param_dtype == torch.bfloat16


def test_tie_across_groups_and_0_dim_parameters_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    explanation = _explain(FSDPConfig.model_validate({"wrap": [{"match": {"path": "head"}}]}))
    assert [p.location for p in explanation.refused] == ["tok_emb.weight"]
    assert "already owns" in explanation.refused[0].message

    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("scale", nn.Parameter(torch.ones(())))
    explanation = _explain(FSDPConfig(), world_size=2, model=model)
    assert [p.location for p in explanation.refused] == ["scale"]


def test_ignored_parameters_stay_whole_on_every_rank() -> None:
    config = FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}}], "ignore": [{"path": "*.norm1.*"}]})
    explanation = _explain(config, world_size=8)
    assert [p.name for p in explanation.ignored][:2] == ["blocks.0.norm1.weight", "blocks.0.norm1.bias"]
    assert all(not name.endswith("norm1.weight") for row in explanation.rows for name in row.param_names)
    ignored_bytes = sum(p.nbytes for p in explanation.ignored)
    assert ignored_bytes == 8 * 128 * 4
    assert explanation.sharded_bytes == sum(row.sharded_bytes for row in explanation.rows) + ignored_bytes


def test_large_modules_in_the_root_get_a_wrap_rule() -> None:
    explanation = _explain(FSDPConfig(), world_size=8)
    assert [m.path for m in explanation.large_in_root] == [f"blocks.{i}" for i in range(4)]
    assert {m.suggestion for m in explanation.large_in_root} == {"- match: {class: Block}"}
    explanation = _explain(FSDPConfig.model_validate({"wrap": [{"match": {"path": "blocks.[1-3]"}}]}))
    assert [(m.path, m.suggestion) for m in explanation.large_in_root] == [("blocks.0", "- match: {path: blocks.0}")]


def test_explain_counts_and_shows_shard_placement_and_group_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Shard(1) parameter's bytes per rank pad its columns, not its rows; the group's node names
    the placements and the non-default flags."""
    text = (
        "wrap:\n  - match: {class: Block}\n    unshard_in_backward: false\n"
        "shard_placement:\n  - {path: 'blocks.*.mlp.*.weight', dim: 1}\nreduce_scatter_unused_params: true\n"
    )
    config = FSDPConfig.from_yaml(_write(tmp_path, text))
    with torch.device("meta"):
        model = GPT(GPTConfig())
    rows = explain_config(model, config, 3).rows
    mlp = dict(model.blocks[0].mlp.named_parameters())
    expected = sum(sharded_nbytes(p, 3, 1 if n.endswith("weight") else 0) for n, p in mlp.items())
    block_bytes = rows[0].sharded_bytes - sum(
        sharded_nbytes(p, 3) for n, p in model.blocks[0].named_parameters() if not n.startswith("mlp.")
    )
    assert block_bytes == expected
    assert main(["explain", _write(tmp_path, text), "--model", FACTORY, "--world-size", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "reduce_scatter_unused_params=true · unshard_in_backward=false · shard_placement: Shard(1) x2" in out


def test_sharded_nbytes_pads_dim0() -> None:
    assert sharded_nbytes(torch.empty(5, 3, device="meta"), 4) == 2 * 3 * 4  # ceil(5/4) = 2 rows
    assert sharded_nbytes(torch.empty(2, dtype=torch.bfloat16, device="meta"), 8) == 2  # 1 padded row
    assert sharded_nbytes(torch.empty(0, 3, device="meta"), 4) == 0
    assert sharded_nbytes(torch.empty(3, 5, device="meta"), 4, dim=1) == 3 * 2 * 4  # ceil(5/4) = 2 columns


# ---- schema -------------------------------------------------------------------------------------
def test_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "FSDPConfig"
    assert list(schema["properties"]) == [
        "mesh",
        "reshard_after_forward",
        "mixed_precision",
        "offload",
        "communication",
        "sharding",
        "zero_stage",
        "wrap",
        "ignore",
        "shard_placement",
        "precision_overrides",
        "reduce_scatter_unused_params",
        "schedule",
    ]


def test_config_reference_doc_is_generated(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/config-reference.md is `fsdp2lite schema --markdown`; regenerate it when this fails."""
    checked_in = (REPO / "docs" / "config-reference.md").read_text()
    assert checked_in == markdown_reference()
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == checked_in
    sections = [line.removeprefix("## ") for line in checked_in.splitlines() if line.startswith("## ")]
    assert sections == [
        "FSDPConfig",
        "MeshConfig",
        "MixedPrecisionPolicy",
        "OffloadConfig",
        "CommPolicy",
        "ShardingPolicy",
        "WrapRule",
        "Match",
        "ShardPlacementRule",
        "PrecisionOverride",
        "ScheduleConfig",
    ]


# ---- the demo's --config ------------------------------------------------------------------------
def test_demo_default_policy_is_configs_demo_yaml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    policy, source = load_policy(None)
    assert source.endswith("demo.yaml") and policy == FSDPConfig.from_yaml(REPO / "configs" / "demo.yaml")
    assert builtin_policy() == policy  # the fallback says the same
    monkeypatch.setattr("fsdp2lite.cli.demo.DEFAULT_CONFIG_PATH", tmp_path / "demo.yaml")
    policy, source = load_policy(None)
    assert policy == builtin_policy() and source.startswith("built-in")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("wrap: [{match: {clas: Block}}]\n", "did you mean 'class'?"),
        ("wrap: [{match: {class: Blok}}]\n", "the model's classes: Attention, Block"),
    ],
)
def test_demo_bad_config_exits_2_before_spawning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    path = _write(tmp_path, content)
    assert main(["demo", "--config", path]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_demo_mesh_that_does_not_fit_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--config", str(REPO / "configs" / "hsdp.yaml"), "--world-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--world-size" in err[0] and "hsdp.yaml" in err[0]


def test_demo_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read the file" in capsys.readouterr().err


def test_explain_model_is_built_on_meta() -> None:
    from fsdp2lite.cli.explain import build_on_meta, load_factory

    model = build_on_meta(load_factory(FACTORY), FACTORY)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert math.isclose(sum(p.numel() for p in model.parameters()), 834_304)
