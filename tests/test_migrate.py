"""``fsdp2lite migrate``: real-world configs of Accelerate, the HF Trainer, DeepSpeed, torchtitan and Megatron-FSDP.

Each fixture (tests/migrate/) becomes a config that plans the sharding the source tool would do:
the groups (one per block class), the mesh, reshard after forward, the dtypes, offload; every input
key is reported mapped, dropped (with why) or unsupported; bad inputs get clear errors. An input that
names no layer class still gets one group per repeated block (--model's, else the Hugging Face decoder
layers), and ``explain`` suggests the block class for a large module left in the root.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fsdp2lite as fl
from fsdp2lite.cli import main
from fsdp2lite.migrate import MigrationError, migrate
from fsdp2lite.models import GPT, GPTConfig

FIXTURES = Path(__file__).resolve().parent / "migrate"
TINY = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2, tie_embeddings=False)


class TransformerBlock(nn.Module):  # torchtitan's block class name
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class Titan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(2))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def statuses(m) -> dict[str, str]:
    return {k.key: k.status for k in m.keys}


def groups_of(config: fl.FSDPConfig, model: nn.Module) -> list[tuple[str, ...]]:
    plan = fl.plan_config(model, config)
    assert not plan.problems and not plan.refused, plan.problems + plan.refused
    return [g.paths for g in plan.groups]


CASES = {
    # fixture: (source, extra kwargs, expected config fields)
    "accelerate_fsdp2.yaml": (
        "accelerate",
        {},
        {
            "reshard_after_forward": True,
            "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32,
            "offload": "none",
            "replicate": 1,
            "checkpointing": False,
        },
    ),
    "accelerate_fsdp1_hybrid.yaml": (
        "accelerate",
        {},
        {"reshard_after_forward": True, "param_dtype": None, "offload": "cpu", "replicate": 2, "checkpointing": False},
    ),
    "hf_trainer.json": (
        "hf-trainer",
        {"fsdp_option": "shard_grad_op auto_wrap"},
        {"reshard_after_forward": False, "param_dtype": None, "offload": "none", "replicate": 1, "checkpointing": True},
    ),
    "deepspeed_zero3_offload.json": (
        "deepspeed",
        {},
        {
            "reshard_after_forward": True,
            "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32,
            "offload": "cpu",
            "replicate": 1,
            "checkpointing": False,
        },
    ),
    "deepspeed_zero2_offload.json": (  # ZeRO-Offload: shards on the device, the optimizer on the host
        "deepspeed",
        {},
        {
            "resident": True,
            "reshard_after_forward": "auto",
            "param_dtype": torch.bfloat16,
            "offload": "cpu",
            "optimizer_only": True,
            "replicate": 1,
            "checkpointing": False,
        },
    ),
    "deepspeed_zero2.json": (
        "deepspeed",
        {},
        {
            "resident": True,  # zero_stage: 2, ZeRO-1/2's resident parameters (they keep them: never resharded)
            "reshard_after_forward": "auto",
            "param_dtype": torch.float16,
            "offload": "none",
            "replicate": 1,
            "checkpointing": False,
        },
    ),
    "deepspeed_hpz.json": (
        "deepspeed",
        {},
        {
            "reshard_after_forward": 4,
            "param_dtype": torch.bfloat16,
            "offload": "none",
            "replicate": 1,
            "checkpointing": False,
        },
    ),
    "deepspeed_mics.json": (
        "deepspeed",
        {"world_size": 16},
        {
            "reshard_after_forward": True,
            "param_dtype": torch.bfloat16,
            "offload": "none",
            "replicate": 4,
            "shard": 4,
            "checkpointing": False,
        },
    ),
    "megatron_fsdp_zero2.json": (
        "megatron-fsdp",
        {},
        {
            "resident": True,  # optim_grads: sharding.shard optimizer
            "reshard_after_forward": "auto",
            "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32,
            "offload": "none",
            "replicate": 1,
            "checkpointing": False,
        },
    ),
    "megatron_bridge_hsdp.yaml": (
        "megatron-fsdp",
        {},
        {
            "reshard_after_forward": True,
            "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32,
            "offload": "none",
            "replicate": 2,
            "checkpointing": False,
        },
    ),
    "torchtitan_llama3_8b.toml": (
        "torchtitan",
        {},
        {
            "reshard_after_forward": "auto",
            "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32,
            "offload": "none",
            "replicate": 1,
            "shard": -1,
            "checkpointing": True,
        },
    ),
}


@pytest.mark.parametrize("fixture", sorted(CASES))
def test_fixture_migrates_to_the_same_sharding(fixture: str, tmp_path: Path) -> None:
    source, kwargs, expected = CASES[fixture]
    m = migrate(source, FIXTURES / fixture, **kwargs)
    config = m.config
    assert not m.unknown, m.unknown
    assert not m.notes, m.notes  # every fixture names its layer class: no default block rule
    assert config.reshard_after_forward == expected["reshard_after_forward"]
    assert config.sharding.resident == expected.get("resident", False)
    assert config.mixed_precision.param_dtype == expected["param_dtype"]
    if "reduce_dtype" in expected:
        assert config.mixed_precision.reduce_dtype == expected["reduce_dtype"]
    assert config.offload.device == expected["offload"]
    assert config.offload.optimizer_only == expected.get("optimizer_only", False)
    assert config.mesh.replicate == expected["replicate"]
    if "shard" in expected:
        assert config.mesh.shard == expected["shard"]
    assert all(rule.activation_checkpointing == expected["checkpointing"] for rule in config.wrap)
    model = Titan() if source == "torchtitan" else GPT(TINY)
    blocks = "layers" if source == "torchtitan" else "blocks"
    assert groups_of(config, model) == [(f"{blocks}.0",), (f"{blocks}.1",), ("",)]  # a group per block, then the root
    out = tmp_path / "out.yaml"
    out.write_text(m.yaml())
    assert fl.FSDPConfig.from_yaml(out) == config  # the written file reads back, comments and all
    assert main(["validate", str(out)]) == 0
    assert "# from " in m.yaml()
    if config.mixed_precision.param_dtype is not None:  # nested keys name their own source
        line = next(x for x in m.yaml().splitlines() if x.strip().startswith("param_dtype:"))
        assert "# from " in line, line
    for report in m.keys:
        assert report.detail, report  # every key says to what, or why not


def test_mics_without_a_world_size_infers_the_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSpeed config does not know its world size: mics_shard_size 4 becomes shard 4 with replicate -1,
    resolved at launch (issue 24); the CLI needs no --world-size."""
    m = migrate("deepspeed", FIXTURES / "deepspeed_mics.json")
    assert (m.config.mesh.replicate, m.config.mesh.shard) == (-1, 4)
    assert [m.config.mesh.resolve(n) for n in (4, 16)] == [(1, 4), (4, 4)]
    report = {k.key: k for k in m.keys}["zero_optimization.mics_shard_size"]
    assert report.status == "mapped" and "replicate -1 (world size / 4 at launch)" in report.detail
    out = tmp_path / "mics.yaml"
    assert main(["migrate", "--from", "deepspeed", str(FIXTURES / "deepspeed_mics.json"), "-o", str(out)]) == 0
    assert fl.FSDPConfig.from_yaml(out).mesh.replicate == -1
    assert main(["validate", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out), "--model", "fsdp2lite.models:gpt_small", "--world-size", "8"]) == 0
    assert "(shard degree 4, replicate 2)" in capsys.readouterr().out
    with pytest.raises(MigrationError, match=r"mics_shard_size 4 does not divide --world-size 6"):
        migrate("deepspeed", FIXTURES / "deepspeed_mics.json", world_size=6)


def test_reports_say_why() -> None:
    m = migrate("deepspeed", FIXTURES / "deepspeed_zero3_offload.json")
    by_key = {k.key: k for k in m.keys}
    assert by_key["zero_optimization.reduce_bucket_size"].status == "dropped"
    assert "one flat buffer per group" in by_key["zero_optimization.reduce_bucket_size"].detail
    assert by_key["gradient_accumulation_steps"].status == "dropped"
    assert "set_requires_gradient_sync" in by_key["gradient_accumulation_steps"].detail
    assert by_key["zero_optimization.stage"].detail.startswith("reshard_after_forward: true")
    titan = statuses(migrate("torchtitan", FIXTURES / "torchtitan_llama3_8b.toml"))
    assert titan["training.steps"] == "dropped" and titan["parallelism.data_parallel_shard_degree"] == "mapped"


def test_unknown_keys_get_a_suggestion_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_com": True}, "bf16": {"enabled": True}}))
    m = migrate("deepspeed", bad)
    [unknown] = m.unknown
    assert unknown.key == "zero_optimization.overlap_com" and "zero_optimization.overlap_comm" in unknown.detail
    assert main(["migrate", "--from", "deepspeed", str(bad), "-o", str(tmp_path / "o.yaml")]) == 1
    assert main(["migrate", "--from", "deepspeed", str(FIXTURES / "deepspeed_zero2.json"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["config"]["zero_stage"] == 2 and record["source"] == "deepspeed"


@pytest.mark.parametrize(
    ("source", "text", "name", "match"),
    [
        ("deepspeed", '{"zero_optimization": {"stage": 0}}', "ds.json", r"ZeRO stage 0 shards nothing .*use DDP"),
        (
            "deepspeed",
            '{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}',
            "ds.json",
            r"zero_optimization.offload_param.device 'gpu': expected one of none, cpu, nvme",
        ),
        ("deepspeed", '{"train_batch_size": 8}', "ds.json", r"does not look like a deepspeed config.*--from right"),
        ("deepspeed", "{not json", "ds.json", r"not valid JSON for --from deepspeed"),
        ("accelerate", "distributed_type: MULTI_GPU\n", "a.yaml", r"distributed_type is 'MULTI_GPU'; only FSDP"),
        ("accelerate", "fsdp_config:\n\tfsdp_version: 2\n", "a.yaml", r"not valid YAML for --from accelerate"),
        (
            "accelerate",
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n",
            "a.yaml",
            r"NO_SHARD.*use DDP",
        ),
        ("torchtitan", "[parallelism\n", "t.toml", r"not valid TOML"),
        ("megatron-fsdp", "{not json", "m.json", r"not valid JSON for --from megatron-fsdp"),
        ("megatron-fsdp", "ddp: [optim\n", "m.yaml", r"not valid YAML for --from megatron-fsdp"),
        (
            "torchtitan",
            '[parallelism]\nfsdp_reshard_after_forward = "sometimes"\n',
            "t.toml",
            r"default, always or never",
        ),
    ],
)
def test_bad_inputs(source: str, text: str, name: str, match: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MigrationError, match=match):
        migrate(source, path)


def test_cli_bad_source_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--from", "megatron", "x"]) == 2
    assert "invalid choice: 'megatron'" in capsys.readouterr().err
    assert main(["migrate", "--from", "deepspeed", str(tmp_path / "none.json")]) == 1
    captured = capsys.readouterr()
    assert "cannot read the file" in " ".join((captured.out + captured.err).split())


def torch_size_based_paths(model: nn.Module, min_num_params: int) -> list[str]:
    """The oracle: which modules torch's FSDP1 ``size_based_auto_wrap_policy`` wraps, bottom-up, counting
    the parameters not yet wrapped (modules without a forward and the root left out, as fsdp2lite must)."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    wrapped: list[str] = []

    def visit(module: nn.Module, path: str) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            remaining += visit(child, f"{path}.{name}" if path else name)
        wrap = size_based_auto_wrap_policy(
            module, recurse=False, nonwrapped_numel=remaining, min_num_params=min_num_params
        )
        if path and wrap and type(module).forward is not nn.Module.forward:
            wrapped.append(path)
            return 0
        return remaining

    visit(model, "")
    return wrapped


def test_size_based_wrapping_names_the_modules_torch_would_wrap(tmp_path: Path) -> None:
    fixture = FIXTURES / "accelerate_size_based.yaml"
    without = migrate("accelerate", fixture)
    assert statuses(without)["fsdp_config.fsdp_min_num_params"] == "unsupported"
    model = GPT(TINY)
    m = migrate("accelerate", fixture, model=model)
    expected = torch_size_based_paths(model, 3000)
    assert expected == ["blocks.0", "blocks.1"]
    assert m.config.wrap[0].match.path == expected
    assert groups_of(m.config, GPT(TINY)) == [("blocks.0",), ("blocks.1",), ("",)]
    for threshold in (1000, 2000):
        text = fixture.read_text().replace("3000", str(threshold))
        path = tmp_path / f"size{threshold}.yaml"
        path.write_text(text)
        paths = migrate("accelerate", path, model=model).config.wrap[0].match.path
        assert paths == torch_size_based_paths(model, threshold), threshold
    out = tmp_path / "cli.yaml"
    argv = ["migrate", "--from", "accelerate", str(fixture), "--model", "test_migrate:tiny_gpt", "-o", str(out)]
    assert main(argv) == 0
    assert fl.FSDPConfig.from_yaml(out).wrap[0].match.path == expected


def tiny_gpt() -> GPT:
    return GPT(TINY)


@pytest.mark.parametrize(
    "fixture",
    [
        "accelerate_fsdp2.yaml",
        "hf_trainer.json",
        "deepspeed_zero3_offload.json",
        "deepspeed_zero2.json",
        "deepspeed_zero2_offload.json",
        "megatron_fsdp_zero2.json",
        "torchtitan_llama3_8b.toml",
    ],
)
def test_apply_config_shards_as_the_source_would(fixture: str, single_rank_pg: None) -> None:
    """Applied for real (one gloo rank): one group per block plus the root, each with the reshard
    setting and all-gather dtype the source asked for, and a step that runs."""
    import warnings

    source, kwargs, expected = CASES[fixture]
    config = migrate(source, FIXTURES / fixture, **kwargs).config
    model = Titan() if source == "torchtitan" else GPT(TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory on a CPU mesh
        fl.apply_config(model, config)
    groups = {name: m._fsdp_state.group for name, m in model.named_modules() if isinstance(m, fl.FSDPModule)}
    blocks = "layers" if source == "torchtitan" else "blocks"
    assert sorted(groups) == ["", f"{blocks}.0", f"{blocks}.1"]
    for name, group in groups.items():
        if name:  # the root's auto is resolved at the first forward
            requested = None if expected["reshard_after_forward"] == "auto" else expected["reshard_after_forward"]
            assert group.post_forward_reshard.requested == (False if expected.get("resident") else requested)
        dtype = expected["param_dtype"] or torch.float32
        assert all(p.param_dtype == dtype for p in group.params), name
        assert group.keeps_unsharded == expected.get("resident", False), name
        host_masters = expected.get("optimizer_only", False)  # ZeRO-Offload: shards on the device, masters on the host
        assert all(p.home.on_host == (expected["offload"] == "cpu" and not host_masters) for p in group.params)
        assert all(p.policy.host_masters == host_masters for p in group.params), name
    x = torch.randn(2, 8) if source == "torchtitan" else torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    model(x).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- one group per repeated block when the input names no layer class ---------------------------
ZERO3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


def hf_decoder_layers() -> list[str]:
    """The one list of known decoder layers: configs/hf_causal_lm.yaml's first rule."""
    rule = fl.FSDPConfig.from_yaml(Path(__file__).resolve().parents[1] / "configs" / "hf_causal_lm.yaml").wrap[0]
    return list(rule.match.class_)


def meta_llama(layers: int = 3) -> nn.Module:
    from _models import tiny_llama

    with torch.device("meta"):
        return tiny_llama(layers=layers)


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    """A tiny Llama as --model takes it: its config.json (built locally; nothing is downloaded)."""
    meta_llama().config.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def write(tmp_path: Path, name: str, data: dict | str) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_no_layer_class_and_no_model_wraps_the_known_decoder_layers(
    tmp_path: Path, llama_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO-3 from DeepSpeed names no layer class: the policy still makes one group per decoder layer (not
    one all-gather of the whole model), says so in a note, and explain shows the per-layer groups."""
    m = migrate("deepspeed", write(tmp_path, "ds.json", ZERO3))
    assert [rule.match.class_ for rule in m.config.wrap] == [hf_decoder_layers()]
    [note] = m.notes
    assert note.startswith("no --model: wrapped the known Hugging Face decoder-layer classes (LlamaDecoderLayer, ")
    assert note.endswith("pass --model to use your model's own")
    assert groups_of(m.config, meta_llama()) == [(f"model.layers.{i}",) for i in range(3)] + [("",)]
    out = tmp_path / "ds.yaml"
    assert main(["migrate", "--from", "deepspeed", str(tmp_path / "ds.json"), "-o", str(out)]) == 0
    assert "note: no --model: wrapped the known Hugging Face" in " ".join(capsys.readouterr().out.split())
    assert "# note: no --model" in out.read_text() and main(["validate", str(out)]) == 0
    monkeypatch.setenv("COLUMNS", "400")
    capsys.readouterr()
    assert main(["explain", str(out), "--model", str(llama_dir), "--world-size", "2", "--all"]) == 0  # every group
    shown = capsys.readouterr().out
    assert all(f"model.layers.{i}  wrap[0]" in shown for i in range(3)) and "in 4 groups" in shown
    assert "large modules left in the root" not in shown


@pytest.mark.parametrize(
    ("source", "text", "kwargs"),
    [
        ("accelerate", "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n", {}),
        ("hf-trainer", '{"fsdp_config": {"activation_checkpointing": true}}', {"fsdp_option": "full_shard auto_wrap"}),
        ("deepspeed", json.dumps(ZERO3), {}),
    ],
)
def test_with_model_wraps_its_own_block(source: str, text: str, kwargs: dict, tmp_path: Path) -> None:
    """--model: a Hugging Face model's _no_split_modules (what Accelerate and the Trainer wrap when no class
    is named); checkpointing asked for applies to those rules."""
    m = migrate(source, write(tmp_path, "in.txt", text), model=meta_llama(), **kwargs)
    assert [rule.match.class_ for rule in m.config.wrap] == [["LlamaDecoderLayer"]]
    assert m.notes == ["the input names no layer class: wrapped --model's LlamaDecoderLayer (_no_split_modules)"]
    assert groups_of(m.config, meta_llama()) == [(f"model.layers.{i}",) for i in range(3)] + [("",)]
    if source == "hf-trainer":  # the rule exists before the key that checkpoints it
        assert m.config.wrap[0].activation_checkpointing
        assert statuses(m)["activation_checkpointing"] == "mapped"


class Stack(nn.Module):
    """A model without _no_split_modules: a GPT's Block list inside a wrapper, and a large leaf table."""

    def __init__(self) -> None:
        super().__init__()
        self.body = GPT(TINY)
        self.table = nn.Embedding(600, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.table(x).sum()


def test_model_without_no_split_modules_uses_its_largest_repeated_list(tmp_path: Path) -> None:
    m = migrate("deepspeed", write(tmp_path, "ds.json", ZERO3), model=Stack())
    assert [rule.match.class_ for rule in m.config.wrap] == [["Block"]]
    assert "wrapped --model's Block (2 repeated Block modules)" in m.notes[0]
    assert groups_of(m.config, Stack()) == [("body.blocks.0",), ("body.blocks.1",), ("",)]
    # no repeated block (an MLP's two Linears are not blocks): the whole model stays one group, and the note says so
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    m = migrate("deepspeed", write(tmp_path, "ds.json", ZERO3), model=mlp)
    assert m.config.wrap == [] and "no repeated block list: the whole model is one group" in m.notes[0]


def test_cli_model_names_the_block_and_a_named_class_or_no_wrap_is_kept(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    ds = write(tmp_path, "ds.json", ZERO3)
    assert main(["migrate", "--from", "deepspeed", str(ds), "--model", str(llama_dir), "-o", str(out)]) == 0
    assert fl.FSDPConfig.from_yaml(out).wrap[0].match.class_ == ["LlamaDecoderLayer"]
    named = write(
        tmp_path, "named.json", {**ZERO3, "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Block"]}}}
    )
    assert [r.match.class_ for r in migrate("deepspeed", named, model=meta_llama()).config.wrap] == [["Block"]]
    no_wrap = "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n"
    m = migrate("accelerate", write(tmp_path, "a.yaml", no_wrap))
    assert m.config.wrap == [] and not m.notes
    assert "whole model is one group" in {k.key: k for k in m.keys}["fsdp_config.fsdp_auto_wrap_policy"].detail


def test_explain_suggests_the_repeated_block_class_for_a_large_module_in_the_root() -> None:
    from fsdp2lite.cli.explain import explain_config

    suggestions = {m.path: m.suggestion for m in explain_config(meta_llama(), fl.FSDPConfig(), 8).large_in_root}
    assert suggestions["model"] == "- match: {class: LlamaDecoderLayer}"  # not {path: model}: the whole stack
    suggestions = {m.path: m.suggestion for m in explain_config(Stack(), fl.FSDPConfig(), 8).large_in_root}
    assert suggestions == {"body": "- match: {class: Block}", "table": "- match: {path: table}"}  # a leaf: itself
    mlp = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
    wrapped = nn.ModuleDict({"mlp": mlp})
    assert [m.suggestion for m in explain_config(wrapped, fl.FSDPConfig(), 8).large_in_root] == ["- match: {path: mlp}"]


# ---- Megatron-FSDP -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "shard", "reshard"),
    [
        ("optim", "optimizer", "auto"),  # ZeRO-1: parameters resident, optimizer state sharded
        ("optim_grads", "optimizer", "auto"),  # ZeRO-2: the same mode here (a reduce-scatter shards gradients)
        ("optim_grads_params", "params", True),  # ZeRO-3
        (1, "optimizer", "auto"),  # fully_shard's ints
        (2, "optimizer", "auto"),
        (3, "params", True),
    ],
)
@pytest.mark.parametrize("layout", ["flat.json", "ddp.yaml", "megatron_fsdp.yaml", "zero_dp_strategy.json"])
def test_megatron_strategies(value: str | int, shard: str, reshard: object, layout: str, tmp_path: Path) -> None:
    keys = {"data_parallel_sharding_strategy": value, "fsdp_unit_modules": ["megatron.core.transformer.Block"]}
    if layout == "zero_dp_strategy.json":  # fully_shard's name for the same key
        keys = {"zero_dp_strategy": value, "fsdp_unit_modules": ["Block"]}
    data = {layout.split(".")[0]: keys} if layout.endswith(".yaml") else keys
    m = migrate("megatron-fsdp", write(tmp_path, layout, json.dumps(data)))
    assert (m.config.sharding.shard, m.config.reshard_after_forward) == (shard, reshard)
    assert groups_of(m.config, GPT(TINY)) == [("blocks.0",), ("blocks.1",), ("",)]  # unit classes by last name
    assert not m.unknown and not m.notes


def test_megatron_hsdp_and_hfsdp(tmp_path: Path) -> None:
    """num_distributed_optimizer_instances is the outer (replicate) size; outer no_shard is HSDP, optim is
    HFSDP (sharding.replicate: optimizer), which needs that size."""
    base = {"data_parallel_sharding_strategy": "optim_grads_params", "num_distributed_optimizer_instances": 4}
    m = migrate("megatron-fsdp", write(tmp_path, "hsdp.json", {**base, "outer_dp_sharding_strategy": "no_shard"}))
    assert (m.config.mesh.replicate, m.config.sharding.replicate) == (4, "none")
    assert m.config.mesh.resolve(16) == (4, 4)
    hfsdp = write(tmp_path, "hfsdp.json", {**base, "outer_dp_sharding_strategy": "optim"})
    m = migrate("megatron-fsdp", hfsdp)
    assert (m.config.mesh.replicate, m.config.sharding.shard, m.config.sharding.replicate) == (4, "params", "optimizer")
    assert "HFSDP" in {k.key: k for k in m.keys}["outer_dp_sharding_strategy"].detail
    no_size = write(tmp_path, "nosize.json", {"data_parallel_sharding_strategy": 3, "outer_dp_sharding_strategy": 1})
    m = migrate("megatron-fsdp", no_size)
    report = {k.key: k for k in m.keys}["outer_dp_sharding_strategy"]
    assert report.status == "unsupported" and "num_distributed_optimizer_instances > 1" in report.detail
    assert m.config.sharding.replicate == "none"


def test_megatron_dtypes_and_report(tmp_path: Path) -> None:
    m = migrate("megatron-fsdp", FIXTURES / "megatron_bridge_hsdp.yaml")
    by_key = {k.key: k for k in m.keys}
    assert by_key["ddp.overlap_grad_reduce"].detail == "schedule.overlap_reduce_scatter: true"
    assert m.config.schedule.overlap_reduce_scatter is True
    assert by_key["ddp.nccl_ub"].status == "dropped" and by_key["train.micro_batch_size"].status == "dropped"
    assert by_key["ddp.keep_fp8_transpose_cache"].detail == "nothing (off)"
    m = migrate("megatron-fsdp", FIXTURES / "megatron_fsdp_zero2.json")
    by_key = {k.key: k for k in m.keys}
    assert "set_gradient_divide_factor(1.0)" in by_key["calculate_per_token_loss"].detail
    assert "ZeRO-2" in by_key["data_parallel_sharding_strategy"].detail
    on = write(tmp_path, "fp8.json", {"data_parallel_sharding_strategy": "optim", "fp8_param_gather": True})
    assert statuses(migrate("megatron-fsdp", on))["fp8_param_gather"] == "unsupported"
    typo = write(tmp_path, "typo.yaml", "ddp:\n  data_parallel_sharding_strategy: optim\n  overlap_grad_reduc: true\n")
    [unknown] = migrate("megatron-fsdp", typo).unknown
    assert unknown.detail == "did you mean 'ddp.overlap_grad_reduce'?"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"data_parallel_sharding_strategy": "no_shard"},
            r"data_parallel_sharding_strategy no_shard shards nothing \(data parallelism\): use DDP; optim, optim_",
        ),
        ({"ddp": {"zero_dp_strategy": 0}}, r"ddp.zero_dp_strategy no_shard shards nothing"),
        (
            {"data_parallel_sharding_strategy": "zero3"},
            r"data_parallel_sharding_strategy 'zero3': expected one of no_shard, optim, optim_grads, "
            r"optim_grads_params \(or 0-3",
        ),
        (
            {"data_parallel_sharding_strategy": "optim", "outer_dp_sharding_strategy": "optim_grads"},
            r"outer_dp_sharding_strategy 'optim_grads': expected one of no_shard, optim \(or 0-1",
        ),
        (
            {
                "data_parallel_sharding_strategy": "optim_grads",
                "outer_dp_sharding_strategy": "optim",
                "num_distributed_optimizer_instances": 2,
            },
            r"outer_dp_sharding_strategy optim \(HFSDP\) needs data_parallel_sharding_strategy optim_grads_params, "
            r"got 'optim_grads'",
        ),
        (
            {"data_parallel_sharding_strategy": "optim", "num_distributed_optimizer_instances": 0},
            r"num_distributed_optimizer_instances 0: expected an int >= 1",
        ),
        (
            {"data_parallel_sharding_strategy": "optim", "zero_dp_strategy": 3},
            r"zero_dp_strategy 'optim_grads_params' contradicts data_parallel_sharding_strategy 'optim'",
        ),
        ({"use_megatron_fsdp": True}, r"names no data_parallel_sharding_strategy \(or zero_dp_strategy\)"),
        ({"data_parallel_sharding_strategy": "optim", "fsdp_unit_modules": 3}, r"fsdp_unit_modules 3: expected a list"),
        ({"data_parallel_sharding_strategy": "optim", "overlap_grad_reduce": "yes"}, r"'yes': expected true or false"),
        ({"train": {"micro_batch_size": 1}}, r"does not look like a megatron-fsdp config"),
    ],
)
def test_megatron_bad_values_name_key_value_and_valid_values(data: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(MigrationError, match=match):
        migrate("megatron-fsdp", write(tmp_path, "m.json", data))


def test_megatron_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.yaml"
    assert (
        main(["migrate", "--from", "megatron-fsdp", str(FIXTURES / "megatron_bridge_hsdp.yaml"), "-o", str(out)]) == 0
    )
    assert main(["validate", str(out)]) == 0
    config = fl.FSDPConfig.from_yaml(out)
    assert (config.mesh.replicate, config.sharding.shard, config.wrap[0].match.class_) == (2, "params", ["Block"])
    assert main(["migrate", "--help"]) == 0
    assert "megatron-fsdp" in capsys.readouterr().out


# ---- Accelerate's strategies and torchtitan's degrees, one by one --------------------------------
@pytest.mark.parametrize(
    ("strategy", "machines", "reshard", "replicate"),
    [
        ("FULL_SHARD", None, True, 1),
        ("1", None, True, 1),
        ("SHARD_GRAD_OP", None, False, 1),  # FSDP1's SHARD_GRAD_OP is FSDP2's reshard_after_forward=False
        ("2", None, False, 1),
        ("HYBRID_SHARD", 2, True, 2),  # shard within a machine, replicate across the machines
        ("4", 3, True, 3),
        ("HYBRID_SHARD_ZERO2", 2, False, 2),  # the same, with SHARD_GRAD_OP within a machine
        ("5", 2, False, 2),
    ],
)
def test_accelerate_strategies(
    strategy: str, machines: int | None, reshard: bool, replicate: int, tmp_path: Path
) -> None:
    text = f"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: '{strategy}'\n"
    text += f"  fsdp_transformer_layer_cls_to_wrap: Block\nnum_machines: {machines}\n" if machines else ""
    m = migrate("accelerate", write(tmp_path, "a.yaml", text))
    assert (m.config.reshard_after_forward, m.config.mesh.replicate) == (reshard, replicate)
    if replicate > 1:
        assert m.config.mesh.resolve(8 * replicate) == (replicate, 8)  # 8 GPUs a machine: shard 8


def test_accelerate_hybrid_without_num_machines_is_unsupported(tmp_path: Path) -> None:
    m = migrate(
        "accelerate",
        write(tmp_path, "a.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"),
    )
    report = {k.key: k for k in m.keys}["fsdp_config.fsdp_sharding_strategy"]
    assert report.status == "unsupported" and "needs num_machines" in report.detail
    bad = "distributed_type: FSDP\nnum_machines: two\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"
    with pytest.raises(MigrationError, match=r"num_machines 'two': expected an int >= 1"):
        migrate("accelerate", write(tmp_path, "b.yaml", bad))


@pytest.mark.parametrize(
    ("replicate", "shard", "world", "expected"),
    [(1, -1, 8, (1, 8)), (2, -1, 8, (2, 4)), (2, 4, 8, (2, 4)), (4, 2, 8, (4, 2))],
)
def test_torchtitan_degrees(replicate: int, shard: int, world: int, expected: tuple[int, int], tmp_path: Path) -> None:
    text = f"[parallelism]\ndata_parallel_replicate_degree = {replicate}\ndata_parallel_shard_degree = {shard}\n"
    config = migrate("torchtitan", write(tmp_path, "t.toml", text)).config
    assert (config.mesh.replicate, config.mesh.shard) == (replicate, shard)
    assert config.mesh.resolve(world) == expected


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (
            'data_parallel_shard_degree = "two"',
            r"parallelism.data_parallel_shard_degree 'two': expected an int >= 1 or -1",
        ),
        (
            "data_parallel_replicate_degree = -1",
            r"parallelism.data_parallel_replicate_degree -1: expected an int >= 1$",
        ),
        ("data_parallel_shard_degree = 0", r"data_parallel_shard_degree 0: expected an int >= 1 or -1"),
    ],
)
def test_torchtitan_bad_degrees(line: str, match: str, tmp_path: Path) -> None:
    with pytest.raises(MigrationError, match=match):
        migrate("torchtitan", write(tmp_path, "t.toml", f"[parallelism]\n{line}\n"))


# ---- offload means what it meant: ZeRO-Offload, parameter offload, NVMe (issue 33) ----------------
ZERO_OFFLOAD = "ZeRO-Offload: the shards and the gradients' reduction stay on the device"
ON_HOST = "parameters, gradients and optimizer state on the host"


def offload_of(m) -> tuple[str, bool, bool]:
    return m.config.offload.device, m.config.offload.optimizer_only, m.config.offload.pin_memory


@pytest.mark.parametrize(
    ("zero", "expected", "rows"),
    [
        # offload_optimizer alone, at every stage: ZeRO-Offload (pin_memory: DeepSpeed's default, false)
        ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, ("cpu", True, False), {"device": ZERO_OFFLOAD}),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, ("cpu", True, False), {"device": ZERO_OFFLOAD}),
        ({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}, ("cpu", True, True), {}),
        (
            {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True},  # deprecated flags: the same
            ("cpu", True, True),
            {"cpu_offload": "deprecated", "cpu_offload_use_pin_memory": "pin_memory: true"},
        ),
        # stage 3 parameter offload: the optimizer goes with the parameters
        ({"stage": 3, "offload_param": {"device": "cpu"}}, ("cpu", False, False), {"device": "optimizer goes with"}),
        ({"stage": 3, "cpu_offload_param": True}, ("cpu", False, False), {"cpu_offload_param": ON_HOST}),
        # both: full offload, whichever key the walk meets first (the deprecated flag sorts before the section)
        (
            {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            ("cpu", False, False),
            {"offload_param.device": "full offload", "offload_optimizer.device": "full offload"},
        ),
        (
            {"stage": 3, "cpu_offload_param": True, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            ("cpu", False, True),
            {"offload_optimizer.device": "full offload", "cpu_offload_param": "full offload"},
        ),
        # parameter offload is read at stage 3 only (DeepSpeed's rule): at stage 2 the optimizer alone moves
        (
            {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            ("cpu", True, False),
            {"offload_param.device": "stage 3 only"},
        ),
        ({"stage": 2, "offload_param": {"device": "cpu", "pin_memory": True}}, ("none", False, True), {}),
        ({"stage": 3, "offload_optimizer": {}, "offload_param": {"device": "none"}}, ("none", False, True), {}),
    ],
)
def test_deepspeed_offload_means_what_it_meant(
    zero: dict, expected: tuple[str, bool, bool], rows: dict[str, str], tmp_path: Path
) -> None:
    m = migrate("deepspeed", write(tmp_path, "ds.json", {"zero_optimization": zero}))
    assert offload_of(m) == expected
    assert m.config.zero_stage == (zero["stage"] if zero["stage"] < 3 else None)
    out = tmp_path / "out.yaml"
    out.write_text(m.yaml())
    assert fl.FSDPConfig.from_yaml(out) == m.config and main(["validate", str(out)]) == 0
    by_key = {k.key.removeprefix("zero_optimization."): k for k in m.keys}
    for key, words in rows.items():
        report = next(r for name, r in by_key.items() if name.endswith(key))
        assert words in report.detail, report
    assert not m.unknown and all(r.status != "unsupported" for r in m.keys), m.keys


@pytest.mark.parametrize("order", [0, 1])
def test_deepspeed_offload_rows_do_not_depend_on_the_walk_order(order: int) -> None:
    """Every offload handler writes the whole section from the record read before the walk."""
    from fsdp2lite.migrate.common import Migration
    from fsdp2lite.migrate.deepspeed import DEEPSPEED
    from fsdp2lite.migrate.deepspeed_offload import record_offload

    flat = {
        "zero_optimization.stage": 3,
        "zero_optimization.offload_optimizer.device": "cpu",
        "zero_optimization.offload_optimizer.pin_memory": False,
        "zero_optimization.offload_param.device": "cpu",
        "zero_optimization.offload_param.pin_memory": True,
    }
    keys = list(flat)[1:]
    m = Migration("deepspeed", "ds.json")
    record_offload(m, flat)
    details = {key: DEEPSPEED[key](m, flat[key]) for key in (keys if order == 0 else keys[::-1])}  # type: ignore[operator]
    assert m.data["offload"] == {"device": "cpu", "optimizer_only": False, "pin_memory": True}
    assert details["zero_optimization.offload_optimizer.device"] == details["zero_optimization.offload_param.device"]
    assert "full offload" in details["zero_optimization.offload_param.device"]
    assert m.origins["offload.device"] == (
        "zero_optimization.offload_optimizer.device + zero_optimization.offload_param.device"
    )


NVME_OPTIMIZER = {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4, "pipeline_read": False,
                  "pipeline_write": False, "fast_init": False, "pin_memory": True, "ratio": 1.0}  # fmt: skip
NVME_PARAM = {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}
AIO = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}
NO_PARAM_NVME = "the parameters go to host RAM, not NVMe"


def offload_nvme(m) -> tuple[str, str | None]:
    return m.config.offload.optimizer, m.config.offload.nvme_path


def check_policy_file(m, tmp_path: Path) -> None:
    """The migrated policy file reads back as the same config and validates."""
    out = tmp_path / "out.yaml"
    out.write_text(m.yaml())
    assert fl.FSDPConfig.from_yaml(out) == m.config and main(["validate", str(out)]) == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_nvme_optimizer_is_fsdp2lite_nvme_optimizer(stage: int, tmp_path: Path) -> None:
    """offload_optimizer: {device: nvme} is ZeRO-Infinity's optimizer offload: optimizer_only with the state in
    files under nvme_path; the swap and aio knobs are each reported by name, dropped, with why."""
    zero = {"stage": stage, "offload_optimizer": NVME_OPTIMIZER, "leaf_module": {"classes": ["Block"]}}
    data = {"zero_optimization": zero, "aio": AIO}
    m = migrate("deepspeed", write(tmp_path, "ds.json", data))
    assert offload_of(m) == ("cpu", True, True) and offload_nvme(m) == ("nvme", "/local_nvme")
    policy = m.config.offload.to_policy()
    assert (policy.optimizer, policy.nvme_path, policy.optimizer_only) == ("nvme", "/local_nvme", True)
    check_policy_file(m, tmp_path)
    assert "nvme_path: /local_nvme  # from zero_optimization.offload_optimizer.device" in m.yaml()
    rows = {k.key.removeprefix("zero_optimization."): k for k in m.keys}
    device = rows["offload_optimizer.device"]
    assert device.status == "mapped" and "optimizer: nvme, nvme_path: /local_nvme" in device.detail
    assert "ZeRO-Infinity's optimizer offload" in device.detail and "one file per rank" in device.detail
    assert rows["offload_optimizer.nvme_path"].detail.startswith("offload.nvme_path: /local_nvme")
    assert rows["offload_optimizer.pin_memory"].detail.startswith("offload.pin_memory: true")
    for name, words in [("buffer_count", "two host buffers"), ("pipeline_read", "reads the next group"),
                        ("pipeline_write", "I/O thread"), ("fast_init", "reserves each rank's file")]:  # fmt: skip
        report = rows[f"offload_optimizer.{name}"]
        assert report.status == "dropped" and words in report.detail, report
    for name in AIO:
        report = rows[f"aio.{name}"]
        assert report.status == "dropped" and "os.preadv/os.pwrite" in report.detail, report
    assert rows["offload_optimizer.ratio"].detail.startswith("nothing")
    assert not m.unknown and not m.notes


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        ({}, ("none", None)),  # parameters (nvme) in host RAM, the optimizer goes with them
        ({"device": "cpu"}, ("cpu", None)),
        (NVME_OPTIMIZER, ("nvme", "/local_nvme")),  # ZeRO-Infinity: the optimizer state stays on NVMe
    ],
)
def test_deepspeed_nvme_params_go_to_host_ram(optimizer: dict, expected: tuple, tmp_path: Path) -> None:
    """fsdp2lite has no parameter offload to NVMe: offload_param nvme is full host offload, and the report,
    a note and the policy file say plainly that the parameters go to host RAM."""
    zero = {"stage": 3, "offload_param": NVME_PARAM, "offload_optimizer": optimizer, "leaf_module": {"classes": ["B"]}}
    m = migrate("deepspeed", write(tmp_path, "ds.json", {"zero_optimization": zero}))
    assert offload_of(m)[:2] == ("cpu", False)
    assert offload_nvme(m) == (expected if expected[0] == "nvme" else ("cpu", None))
    check_policy_file(m, tmp_path)
    rows = {k.key.removeprefix("zero_optimization."): k for k in m.keys}
    device = rows["offload_param.device"]
    assert device.status == "mapped" and "optimizer_only: false" in device.detail and NO_PARAM_NVME in device.detail
    path = rows["offload_param.nvme_path"]
    assert path.status == "unsupported" and "parameter offload to NVMe" in path.detail
    for name in ("buffer_count", "buffer_size", "max_in_cpu"):
        assert (
            rows[f"offload_param.{name}"].status == "dropped"
            and "NVMe parameter swapping" in rows[f"offload_param.{name}"].detail
        )
    [note] = m.notes
    assert note.startswith("zero_optimization.offload_param.device is nvme, but fsdp2lite has no parameter offload")
    assert ("and the optimizer state" in note) == (expected[0] != "nvme") and "# note: " + note in m.yaml()
    assert not m.unknown


def test_deepspeed_nvme_settings_of_a_section_not_on_nvme_are_dropped(tmp_path: Path) -> None:
    """DeepSpeed reads nvme_path and the swap knobs only with device nvme, and offload_param at stage 3 only."""
    zero = {"stage": 2, "offload_param": NVME_PARAM, "offload_optimizer": {"device": "cpu", "buffer_count": 4,
            "nvme_path": "/nvme", "ratio": 0.3}, "leaf_module": {"classes": ["Block"]}}  # fmt: skip
    m = migrate("deepspeed", write(tmp_path, "ds.json", {"zero_optimization": zero}))
    assert offload_of(m) == ("cpu", True, False) and offload_nvme(m) == ("cpu", None)
    rows = {k.key.removeprefix("zero_optimization."): k for k in m.keys}
    assert "only with device nvme (offload_optimizer device is cpu)" in rows["offload_optimizer.buffer_count"].detail
    assert "only with device nvme" in rows["offload_optimizer.nvme_path"].detail
    assert (
        "stage 3 only" in rows["offload_param.device"].detail
        and "stage 3 only" in rows["offload_param.nvme_path"].detail
    )
    assert (
        rows["offload_optimizer.ratio"].status == "unsupported" and "partial" in rows["offload_optimizer.ratio"].detail
    )
    assert not m.notes
    check_policy_file(m, tmp_path)


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        (
            {"offload_optimizer": {"device": "disk"}},
            r"offload_optimizer.device 'disk': expected one of none, cpu, nvme",
        ),
        (
            {"offload_param": {"device": "cpu", "pin_memory": "yes"}},
            r"offload_param.pin_memory 'yes': expected true or",
        ),
        ({"cpu_offload": 1}, r"zero_optimization.cpu_offload 1: expected true or false"),
        (
            {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
            r"cpu_offload \(deprecated\) and zero_optimization.offload_optimizer are both given",
        ),
        ({"offload_optimizer": "cpu"}, r"offload_optimizer 'cpu': expected a mapping such as \{device: cpu\}"),
        ({"offload_optimizer": {"device": "cpu", "ratio": 2}}, r"offload_optimizer.ratio 2: expected a number in"),
        (
            {"offload_optimizer": {"device": "nvme"}},
            r"zero_optimization.offload_optimizer.device is nvme but zero_optimization.offload_optimizer.nvme_path "
            r"is not given: DeepSpeed requires",
        ),
        (
            {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ""}},
            r"offload_param.device is nvme but zero_optimization.offload_param.nvme_path is not given",
        ),
        (
            {"offload_optimizer": {"device": "nvme", "nvme_path": 7}},
            r"offload_optimizer.nvme_path 7: expected a directory path",
        ),
    ],
)
def test_deepspeed_bad_offload_values(zero: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(MigrationError, match=match):
        migrate("deepspeed", write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2, **zero}}))
    if zero.get("offload_param", {}).get("device") == "nvme":  # read at stage 3 only: no path needed below it
        migrate("deepspeed", write(tmp_path, "ds.json", {"zero_optimization": {**zero, "stage": 2}}))


@pytest.mark.parametrize(
    ("source", "text", "kwargs", "key"),
    [
        (
            "accelerate",
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: true\n",
            {},
            "fsdp_offload_params",
        ),
        ("hf-trainer", '{"fsdp_config": {"offload_params": true}}', {}, "offload_params"),
        ("hf-trainer", '{"fsdp_offload_params": "true"}', {}, "fsdp_offload_params"),
        ("hf-trainer", '{"cpu_offload": true}', {}, "cpu_offload"),
        ("hf-trainer", '{"use_orig_params": true}', {"fsdp_option": "full_shard offload"}, "--fsdp offload"),
        ("torchtitan", "[training]\nenable_cpu_offload = true\n", {}, "training.enable_cpu_offload"),
    ],
)
def test_fsdp_parameter_offload_moves_the_optimizer_too(
    source: str, text: str, kwargs: dict, key: str, tmp_path: Path
) -> None:
    """FSDP's offload (Accelerate, the Trainer, torchtitan: torch's CPUOffloadPolicy) is not ZeRO-Offload."""
    name = {"accelerate": "a.yaml", "torchtitan": "t.toml"}.get(source, "t.json")
    m = migrate(source, write(tmp_path, name, text), **kwargs)
    assert offload_of(m) == ("cpu", False, True)
    report = next(r for r in m.keys if r.key.endswith(key))
    assert report.status == "mapped" and ON_HOST in report.detail and "optimizer_only: false" in report.detail
    out = tmp_path / "out.yaml"
    out.write_text(m.yaml())
    assert main(["validate", str(out)]) == 0
    off = migrate(source, write(tmp_path, name, text.replace("true", "false")), **kwargs)
    assert off.config.offload.device == ("cpu" if "fsdp_option" in kwargs else "none")  # the --fsdp word still asks


def test_fsdp_offload_flags_and_accelerates_deepspeed_plugin(tmp_path: Path) -> None:
    with pytest.raises(MigrationError, match=r"fsdp_config.fsdp_offload_params 'maybe': expected true or false"):
        migrate("accelerate", write(tmp_path, "a.yaml", "fsdp_config:\n  fsdp_offload_params: maybe\n"))
    with pytest.raises(MigrationError, match=r"training.enable_cpu_offload 'yes': expected true or false"):
        migrate("torchtitan", write(tmp_path, "t.toml", '[training]\nenable_cpu_offload = "yes"\n'))
    plugin = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_optimizer_device: cpu\n  zero_stage: 2\n"
    m = migrate("accelerate", write(tmp_path, "ds.yaml", plugin))  # the DeepSpeed plugin: ZeRO-Offload
    assert offload_of(m) == ("cpu", True, False) and m.config.zero_stage == 2
    m = migrate("accelerate", write(tmp_path, "fsdp.yaml", plugin.replace("DEEPSPEED", "FSDP")))
    report = {k.key: k for k in m.keys}["deepspeed_config.offload_optimizer_device"]
    assert report.status == "dropped" and "an FSDP launch does not read" in report.detail
    assert m.config.offload.device == "none"


# ---- Accelerate's DeepSpeed plugin and the HF Trainer's deepspeed: the same offload mapping ----------
PLUGIN = "distributed_type: DEEPSPEED\ndeepspeed_config:\n"


@pytest.mark.parametrize(
    ("plugin", "expected", "row", "words"),
    [
        ({"zero_stage": 2, "offload_optimizer_device": "cpu"}, ("cpu", True, "cpu", None), "optimizer", ZERO_OFFLOAD),
        (
            {"zero_stage": 1, "offload_optimizer_device": "nvme", "offload_optimizer_nvme_path": "/nvme"},
            ("cpu", True, "nvme", "/nvme"),
            "optimizer",
            "ZeRO-Infinity's optimizer offload",
        ),
        (
            {"zero_stage": 3, "offload_param_device": "cpu", "offload_param_nvme_path": "none"},
            ("cpu", False, "cpu", None),
            "param",
            "the optimizer goes with them",
        ),
        (
            {
                "zero_stage": 3,
                "offload_param_device": "nvme",
                "offload_param_nvme_path": "/nvme",
                "offload_optimizer_device": "nvme",
                "offload_optimizer_nvme_path": "/nvme",
            },  # fmt: skip
            ("cpu", False, "nvme", "/nvme"),
            "param",
            NO_PARAM_NVME,
        ),
        ({"offload_param_device": "cpu"}, ("none", False, "cpu", None), "param", "stage 3 only"),  # default stage 2
    ],
)
def test_accelerate_deepspeed_plugin_offload(
    plugin: dict, expected: tuple, row: str, words: str, tmp_path: Path
) -> None:
    """distributed_type: DEEPSPEED: the plugin's offload_*_device / _nvme_path map as DeepSpeed's sections do."""
    text = PLUGIN + "".join(f"  {key}: {value}\n" for key, value in plugin.items())
    m = migrate("accelerate", write(tmp_path, "a.yaml", text + "mixed_precision: bf16\n"))
    offload = m.config.offload
    assert (offload.device, offload.optimizer_only, offload.optimizer, offload.nvme_path) == expected
    assert m.config.mixed_precision.param_dtype == torch.bfloat16
    report = {k.key: k for k in m.keys}[f"deepspeed_config.offload_{row}_device"]
    assert words in report.detail, report
    assert not m.unknown
    if "zero_stage" not in plugin:
        assert m.config.zero_stage == 2 and "deepspeed_config.zero_stage not given: Accelerate's default, 2" in m.notes
    check_policy_file(m, tmp_path)


def test_accelerate_deepspeed_fixture_and_config_file(tmp_path: Path) -> None:
    """A whole `accelerate config` DeepSpeed file (every key reported, none unknown), and a plugin that names a
    deepspeed_config_file: that file is read (beside the YAML) and walked as a DeepSpeed config."""
    m = migrate("accelerate", FIXTURES / "accelerate_deepspeed_nvme.yaml")
    assert not m.unknown and m.config.reshard_after_forward is True
    assert (m.config.offload.optimizer_only, m.config.offload.optimizer, m.config.offload.nvme_path) == (
        True,
        "nvme",
        "/local_nvme",
    )
    rows = {k.key: k for k in m.keys}
    assert rows["deepspeed_config.offload_optimizer_nvme_path"].detail.startswith("offload.nvme_path: /local_nvme")
    assert rows["deepspeed_config.offload_param_nvme_path"].status == "dropped"
    assert rows["deepspeed_config.zero3_init_flag"].status == "dropped"
    check_policy_file(m, tmp_path)
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}
    write(tmp_path, "ds.json", ds)
    text = f"{PLUGIN}  deepspeed_config_file: ds.json\n  zero3_init_flag: false\n"
    m = migrate("accelerate", write(tmp_path, "a.yaml", text))
    assert offload_of(m) == ("cpu", True, False) and offload_nvme(m) == ("nvme", "/nvme")
    assert f"deepspeed_config.deepspeed_config_file: read {tmp_path / 'ds.json'}" in m.notes
    key = "deepspeed_config.deepspeed_config_file.zero_optimization.offload_optimizer.device"
    assert "ZeRO-Infinity" in {k.key: k for k in m.keys}[key].detail and not m.unknown
    assert m.config == migrate("deepspeed", tmp_path / "ds.json").config  # the same as --from deepspeed


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "  zero_stage: 2\n  offload_optimizer_device: nvme\n  offload_optimizer_nvme_path: none\n",
            r"deepspeed_config.offload_optimizer_device is nvme but deepspeed_config.offload_optimizer_nvme_path is "
            r"not given: DeepSpeed requires",
        ),
        (
            "  zero_stage: 3\n  offload_param_device: nvme\n",
            r"deepspeed_config.offload_param_device is nvme but deepspeed_config.offload_param_nvme_path",
        ),
        ("  offload_param_device: disk\n", r"deepspeed_config.offload_param_device 'disk': expected one of none, cpu"),
        ("  zero_stage: 0\n", r"ZeRO stage 0 shards nothing"),
        ("  zero_stage: 5\n", r"deepspeed_config.zero_stage must be 0-3, got 5"),
        (
            "  deepspeed_config_file: ds.json\n  offload_optimizer_device: cpu\n",
            r"deepspeed_config_file is given, and so are offload_optimizer_device: Accelerate refuses",
        ),
        ("  deepspeed_config_file: missing.json\n", r"deepspeed_config_file 'missing.json': no such file"),
    ],
)
def test_accelerate_deepspeed_plugin_bad_values(text: str, match: str, tmp_path: Path) -> None:
    write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2}})
    with pytest.raises(MigrationError, match=match):
        migrate("accelerate", write(tmp_path, "a.yaml", PLUGIN + text))


DS_CASES = [  # DeepSpeed configs, each migrated directly and inside the Trainer's deepspeed: the same config
    {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
    {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}},
]


@pytest.mark.parametrize("zero", DS_CASES)
@pytest.mark.parametrize("inline", [True, False])
def test_hf_trainer_deepspeed_maps_as_deepspeed(zero: dict, inline: bool, tmp_path: Path) -> None:
    """TrainingArguments' deepspeed (a mapping or its JSON file) goes through the DeepSpeed mapping."""
    ds = {"zero_optimization": {**zero, "leaf_module": {"classes": ["Block"]}}}
    direct = migrate("deepspeed", write(tmp_path, "ds.json", ds))
    args = {"deepspeed": ds if inline else "ds.json", "learning_rate": 1e-5}
    m = migrate("hf-trainer", write(tmp_path, "args.json", args))
    assert m.config == direct.config and not m.unknown
    rows = {k.key: k for k in m.keys}
    for report in direct.keys:
        assert rows[f"deepspeed.{report.key}"].detail == report.detail, report
    assert rows["learning_rate"].status == "dropped"
    assert [n.removeprefix("deepspeed.") for n in m.notes if not n.startswith("deepspeed: read")] == direct.notes
    check_policy_file(m, tmp_path)


def test_hf_trainer_args_fixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A TrainingArguments JSON with a Hugging Face DeepSpeed template ('auto' values): bf16 comes from the
    Trainer's own bf16; NVMe optimizer state with parameters in host RAM; the CLI writes a valid policy."""
    m = migrate("hf-trainer", FIXTURES / "hf_trainer_args_deepspeed.json", model=GPT(TINY))
    offload = m.config.offload
    assert (offload.device, offload.optimizer_only, offload.optimizer, offload.nvme_path) == (
        "cpu",
        False,
        "nvme",
        "/local_nvme",
    )
    assert m.config.mixed_precision.param_dtype == torch.bfloat16 and not m.unknown
    rows = {k.key: k for k in m.keys}
    assert rows["deepspeed.bf16.enabled"].detail.startswith("nothing ('auto'")
    assert rows["bf16"].detail == "mixed_precision: param_dtype bf16, reduce_dtype fp32"
    assert "activation_checkpointing: true" in rows["gradient_checkpointing"].detail
    assert rows["deepspeed.aio.queue_depth"].status == "dropped"
    out = tmp_path / "out.yaml"
    argv = ["migrate", "--from", "hf-trainer", str(FIXTURES / "hf_trainer_args_deepspeed.json"), "-o", str(out)]
    assert main(argv) == 0 and main(["validate", str(out)]) == 0
    assert fl.FSDPConfig.from_yaml(out).offload.optimizer == "nvme"


@pytest.mark.parametrize("words", ["full_shard auto_wrap offload", ["full_shard", "auto_wrap", "offload"]])
def test_hf_trainer_args_fsdp_offload_word(words: str | list[str], tmp_path: Path) -> None:
    """TrainingArguments' fsdp words: offload is FSDP's parameter offload (full host offload)."""
    args = {"fsdp": words, "fsdp_config": {"transformer_layer_cls_to_wrap": ["Block"]}, "bf16": True, "seed": 1}
    m = migrate("hf-trainer", write(tmp_path, "args.json", args))
    assert offload_of(m) == ("cpu", False, True) and m.config.offload.optimizer == "cpu"
    rows = {k.key: k for k in m.keys}
    assert ON_HOST in rows["fsdp offload"].detail and rows["fsdp full_shard"].status == "mapped"
    assert rows["transformer_layer_cls_to_wrap"].status == "mapped" and rows["seed"].status == "dropped"
    assert groups_of(m.config, GPT(TINY)) == [("blocks.0",), ("blocks.1",), ("",)]
    check_policy_file(m, tmp_path)
    write(tmp_path, "fsdp.json", args["fsdp_config"])  # fsdp_config as its JSON file
    m = migrate("hf-trainer", write(tmp_path, "args.json", {**args, "fsdp_config": "fsdp.json"}))
    assert offload_of(m) == ("cpu", False, True) and m.notes == [f"fsdp_config: read {tmp_path / 'fsdp.json'}"]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            {"fsdp": "full_shard", "deepspeed": {"zero_optimization": {"stage": 3}}},
            {},
            r"deepspeed and fsdp 'full_shard' are both given: the Trainer runs FSDP or DeepSpeed",
        ),
        ({"deepspeed": "nowhere.json"}, {}, r"deepspeed 'nowhere.json': no such file"),
        (
            {"deepspeed": {"train_batch_size": 8}},
            {},
            r"deepspeed is not a DeepSpeed config: no zero_optimization at the top level",
        ),
        (
            {"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}},
            {},
            r"deepspeed.zero_optimization.offload_optimizer.device is nvme but "
            r"deepspeed.zero_optimization.offload_optimizer.nvme_path is not given",
        ),
        ({"fsdp": "full_shard"}, {"fsdp_option": "shard_grad_op"}, r"fsdp 'full_shard' and --fsdp 'shard_grad_op'"),
        ({"fsdp": 3}, {}, r"fsdp 3: expected words"),
        ({"fsdp": "full_shard", "bf16": "yes"}, {}, r"bf16 'yes': expected true or false"),
    ],
)
def test_hf_trainer_bad_args(args: dict, kwargs: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(MigrationError, match=match):
        migrate("hf-trainer", write(tmp_path, "args.json", args), **kwargs)
