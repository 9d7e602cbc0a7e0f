"""The planner's fine-tuning (estimate.finetune), reserved memory (estimate.reserved) and step time in the
CLI: adapters of peft's shapes, a frozen base without gradients or optimizer state, NF4's bytes, pinned
sizes, the layerwise activation trace, the stream tags of the allocation recorder. Single process."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers", reason="tiny Hugging Face Llama models need transformers (fsdp2lite[dev])")

from _models import example_train, tiny_llama  # noqa: E402

import fsdp2lite as fl  # noqa: E402
from fsdp2lite.cli import main  # noqa: E402
from fsdp2lite.cli.estimate_search import search_order  # noqa: E402
from fsdp2lite.estimate import estimate_memory, sharded_nbytes  # noqa: E402
from fsdp2lite.estimate.finetune import (  # noqa: E402
    NF4_BITS,
    Finetune,
    PlannedLora,
    nf4_bytes,
    pinned_nbytes,
    plan_model,
)

LLAMA = functools.partial(tiny_llama, layers=3, hidden=64, intermediate=128)


def _planned(kind: str = "lora", rank: int = 4) -> nn.Module:
    with torch.device("meta"):
        model = LLAMA()
    plan_model(model, Finetune(kind, rank))
    return model


def test_nf4_bits_and_the_pinned_allocators_sizes() -> None:
    assert round(NF4_BITS, 3) == 4.127  # 4-bit codes, an int8 scale per 64, an fp32 factor per 256 scales
    # one scaler block: 16,384 4-bit codes, 256 int8 scales, one fp32 factor
    assert nf4_bytes(64 * 256) == math.ceil(64 * 256 * NF4_BITS / 8) == 8192 + 256 + 4
    assert [pinned_nbytes(n) for n in (0, 1, 3, 1024, 1025, 3 << 20)] == [0, 1, 4, 1024, 2048, 4 << 20]


def test_planned_adapters_have_peft_shapes_and_freeze_the_base() -> None:
    peft = pytest.importorskip("peft", reason="peft (the [finetune] extra) is the reference for the adapters")
    planned = _planned(rank=4)
    with torch.device("meta"):
        reference = peft.get_peft_model(
            LLAMA().to(torch.bfloat16),
            peft.LoraConfig(r=4, target_modules=list(Finetune().targets), bias="none"),
        )
    for model in (planned, reference):
        assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    shapes = sorted(tuple(p.shape) for p in planned.parameters() if p.requires_grad)
    assert shapes == sorted(tuple(p.shape) for p in reference.parameters() if p.requires_grad)
    assert sum(p.numel() for p in planned.parameters()) == sum(p.numel() for p in reference.parameters())
    assert all(p.dtype == torch.float32 for p in planned.parameters() if p.requires_grad)
    assert all(p.dtype == torch.bfloat16 for p in planned.parameters() if not p.requires_grad)


def test_bad_targets_name_the_linear_layers_and_change_nothing() -> None:
    with torch.device("meta"):
        model = LLAMA()
    before = [(n, p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match=r"lora targets wq match no Linear layer of LlamaForCausalLM; its Linear "):
        plan_model(model, Finetune("lora", 4, ("wq",)))
    assert [(n, p.dtype, p.requires_grad) for n, p in model.named_parameters()] == before
    with pytest.raises(ValueError, match="finetune 'dora': expected one of full, lora, qlora"):
        Finetune("dora")


def _adapter_state(world: int) -> tuple[int, int]:
    """(bytes of the adapters' padded fp32 shards, AdamW's state for them: 2 x shards + a 4-byte step each)."""
    adapters = [p for p in _planned().parameters() if p.requires_grad]
    shards = sum(sharded_nbytes(p, world) for p in adapters)
    return shards, 2 * shards + 4 * len(adapters)


@pytest.mark.parametrize("method", ["analytic", "simulate"])
def test_lora_trains_only_the_adapters(method: str) -> None:
    estimate = estimate_memory(LLAMA, world_size=2, seq=16, method=method, finetune=Finetune("lora", 4))
    _, state = _adapter_state(2)
    assert estimate.finetune == "lora"
    assert estimate.breakdown["optimizer"] == state  # the frozen base has none
    full = estimate_memory(LLAMA, world_size=2, seq=16, method=method)
    assert full.breakdown["optimizer"] > 10 * state
    assert estimate.reserved_bytes >= estimate.reserved_expandable_bytes >= estimate.peak_bytes  # 2 MiB segments


def test_qlora_stores_the_adapted_weights_in_nf4() -> None:
    common = {"world_size": 2, "seq": 16, "method": "analytic"}
    lora = estimate_memory(LLAMA, **common, finetune=Finetune("lora", 4))
    qlora = estimate_memory(LLAMA, **common, finetune=Finetune("qlora", 4))
    adapted = [m.base_layer.weight for m in _planned().modules() if isinstance(m, PlannedLora)]
    saved = sum(sharded_nbytes(w, 2) - nf4_bytes(w.numel() // 2) for w in adapted)  # bf16 shard -> NF4 shard
    assert len(adapted) == 3 * 7 and lora.breakdown["params"] - qlora.breakdown["params"] == saved
    assert any("base weights in NF4" in note for note in qlora.notes)


def test_the_layerwise_trace_equals_the_whole_models() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp2lite.estimate.analytic import _layerwise, _saved_bytes
    from fsdp2lite.estimate.common import step_inputs

    with FakeTensorMode():
        model = tiny_llama(layers=5, hidden=64, intermediate=128)
        inputs, token = step_inputs(model, None, 2, 16)
        whole = _saved_bytes(model, inputs, token, None)
        assert _layerwise(model, lambda: _saved_bytes(model, inputs, token, None)) == whole
        assert len(model.model.layers) == 5  # restored


def test_the_recorder_tags_side_stream_allocations() -> None:
    from fsdp2lite._runtime.comm import Comm
    from fsdp2lite.estimate.reserved import AllocationRecorder, streams_tagged

    recorder = AllocationRecorder()
    comm = Comm.__new__(Comm)
    comm.streams = None  # CPU: on() runs the block in place
    records = [object(), object(), object()]
    with streams_tagged(recorder):
        recorder.added(records[0], 4096)
        with comm.on("all_gather_copy_in"):
            recorder.added(records[1], 1 << 20)
        recorder.deleted(records[1])
        recorder.resized(records[2], 0)  # a resize to nothing frees and allocates nothing
    assert recorder.events == [
        ("alloc", 0, 4096, "compute"),
        ("alloc", 1, 1 << 20, "all_gather_copy_in"),
        ("free", 1, 0, "compute"),
    ]
    assert Comm.on.__name__ == "on" and Comm.on.__qualname__.startswith("Comm.")  # restored


# every projection of this Llama is whole NF4 units with rows of whole 64-value blocks: qlora at any degree
QLORA_LLAMA = functools.partial(tiny_llama, layers=2, hidden=256, intermediate=512)
# ... and of this one, down_proj (512, 96) is not: 96 columns are 1.5 blocks a row, so it shards only where
# torchao's own chunks hold whole 64 * 256-value units: 1 rank
ODD_LLAMA = functools.partial(tiny_llama, layers=2, hidden=512, intermediate=96)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    with torch.device("meta"):
        QLORA_LLAMA().config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def odd_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("odd_llama")
    with torch.device("meta"):
        ODD_LLAMA().config.save_pretrained(path)
    return path


def test_one_feasibility_rule_names_what_works_instead() -> None:
    """[Note: one feasibility rule]: qlora runs at any degree where each row holds whole NF4 blocks; where a
    weight's rows do not (and torchao's own chunks are not whole units), it is refused with the first
    problems, a count of the rest and the degrees that work."""
    from fsdp2lite.finetune import DEFAULT_TARGETS, check_finetune, finetune_problems
    from fsdp2lite.finetune.feasible import qlora_shard_degrees

    with torch.device("meta"):
        model, odd = QLORA_LLAMA(), ODD_LLAMA()
    assert (
        finetune_problems(model, "qlora", DEFAULT_TARGETS, 3)
        == []
        == finetune_problems(odd, "lora", DEFAULT_TARGETS, 3)
    )
    assert qlora_shard_degrees(model, DEFAULT_TARGETS, 8) == list(range(1, 9))
    problems = finetune_problems(odd, "qlora", DEFAULT_TARGETS, 3)
    assert len(problems) == 2 and problems[0].startswith("model.layers.0.mlp.down_proj.weight (512, 96): ")
    assert qlora_shard_degrees(odd, DEFAULT_TARGETS, 8) == [1]
    with pytest.raises(ValueError) as refused:
        check_finetune(odd, "qlora", DEFAULT_TARGETS, 3)
    lines = str(refused.value).splitlines()
    assert lines[0] == "--finetune qlora cannot run sharded over 3 ranks (2 weights):", lines
    assert lines[1] == f"  {problems[0]}; and 1 more like it" and len(lines) == 3
    assert lines[-1] == "  qlora works sharded over: 1 rank; --finetune lora (a bf16 base) works over 3"
    with pytest.raises(ValueError, match=r"^--finetune lora: lora targets wq match no Linear layer of LlamaFor"):
        check_finetune(model, "lora", ("wq",), 2)


def test_qlora_refuses_a_target_tied_to_another_parameter() -> None:
    """A tied lm_head made NF4 would leave the embedding its own bf16 copy: qlora refuses it by name, lora
    (which keeps the base weight) takes it."""
    from fsdp2lite.finetune import check_finetune, finetune_problems

    with torch.device("meta"):
        model = tiny_llama(layers=2, hidden=256, intermediate=512, vocab=256, tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert finetune_problems(model, "lora", ("q_proj", "lm_head"), 2) == []
    assert finetune_problems(model, "qlora", ("q_proj",), 2) == []
    with pytest.raises(ValueError) as refused:
        check_finetune(model, "qlora", ("q_proj", "lm_head"), 2)
    assert str(refused.value).splitlines() == [
        "--finetune qlora cannot run sharded over 2 ranks (1 weight):",
        "  lm_head.weight is tied to model.embed_tokens.weight: NF4 would untie them (the other keeps the bf16 "
        "weight); leave lm_head out of --lora-targets, or use --finetune lora",
    ]


def test_the_planner_and_train_py_refuse_an_infeasible_qlora_alike(
    odd_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At world size 3: ``estimate --finetune qlora`` exits 2 with the rule's message, ``--budget`` leaves
    qlora out of its search saying why, and examples/train.py refuses before building anything, word for
    word (a fake process group of 3 ranks)."""

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp2lite.finetune import DEFAULT_TARGETS, check_finetune

    with torch.device("meta"):
        model = ODD_LLAMA()
    with pytest.raises(ValueError) as rule:
        check_finetune(model, "qlora", DEFAULT_TARGETS, 3)
    args = ["estimate", "--model", str(odd_llama_dir), "--world-size", "3", "--seq", "16"]
    assert main([*args, "--finetune", "qlora"]) == 2
    assert f"cannot plan {odd_llama_dir}: {rule.value}" in capsys.readouterr().err
    assert main([*args, "--budget", "1GiB", "--json"]) == 0
    captured = capsys.readouterr()
    searched = {row["finetune"] for row in json.loads(captured.out)["budget"]["tried"]}
    flat = " ".join(captured.err.split())  # the text answer wraps at the terminal's width
    assert searched == {"full", "lora"} and " ".join(f"not searched: {rule.value}".split()) in flat
    train = example_train()
    options = train.parse_args(["--model-config", str(odd_llama_dir), "--finetune", "qlora", "--device", "cpu"])
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        job = train.Job(0, 3, torch.device("cpu"), "fake")
        with pytest.raises(ValueError) as refused:
            train.finetune_model(options, train.resolve_model(options), fl.FSDPConfig(), job)
    finally:
        torch.distributed.destroy_process_group()
    assert str(refused.value) == str(rule.value)


def test_the_planner_searches_qlora_at_a_degree_rows_do_not_divide(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """3 ranks, 256- and 512-row projections: qlora is planned and searched (a rank's rows padded)."""
    args = ["estimate", "--model", str(llama_dir), "--world-size", "3", "--seq", "16"]
    assert main([*args, "--finetune", "qlora", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finetune"] == "qlora"
    assert main([*args, "--budget", "1GiB", "--json"]) == 0
    captured = capsys.readouterr()
    assert {row["finetune"] for row in json.loads(captured.out)["budget"]["tried"]} == {"full", "lora", "qlora"}
    assert "not searched" not in captured.err


def test_cli_finetune_time_and_reserved(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", str(llama_dir), "--world-size", "2", "--seq", "16", "--finetune", "qlora"]
    records = {}
    for link in (["--link", "nvlink4"], ["--link-gbps", "0.001"]):
        assert main([*args, *link, "--gpu", "rtx4090", "--lora-rank", "4", "--json"]) == 0
        captured = capsys.readouterr()
        records[link[0]], out = json.loads(captured.out), captured.err
        assert "step time on rtx4090" in out and "reserved (caching allocator)" in out
    fast, slow = records["--link"], records["--link-gbps"]
    assert fast["finetune"] == "qlora" and fast["reserved_bytes"] >= fast["peak_bytes"] > 0
    assert fast["tokens_per_s"] > slow["tokens_per_s"] > 0  # 1 MB/s: the collectives are exposed
    assert slow["step_time"]["exposed_comm_s"] > 0 and fast["host_bytes_per_machine"] == 0


def test_cli_budget_writes_the_fastest_fitting_setting_and_its_command(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "fits.yaml"
    args = ["estimate", "--model", str(llama_dir), "--world-size", "2", "--seq", "16", "--budget", "1GiB"]
    assert main([*args, "--write-config", str(out_path), "--json", "--link", "pcie4", "--gpu", "rtx4090"]) == 0
    captured = capsys.readouterr()
    record, out = json.loads(captured.out), captured.err
    fitting = [row for row in record["budget"]["tried"] if row["fits"]]
    fastest = min(search_order(row)[0] for row in fitting)  # tokens/s to 3 digits: the model is not finer
    assert search_order(record["budget"]["choice"])[0] == fastest
    assert f"examples/train.py --config {out_path}" in record["train_command"]
    assert f"--finetune {record['finetune']}" in record["train_command"] and "recommended:" in out
    assert fl.FSDPConfig.from_yaml(out_path).wrap  # a policy file fsdp2lite reads back
    assert main([*args, "--json", "--method", "simulate", "--finetune", "lora", "--lora-rank", "4"]) == 0
    checked = json.loads(capsys.readouterr().out)
    simulated = checked["budget"]["simulated"]  # --method simulate: the choice run on the real runtime too
    assert simulated["method"] == "simulate" and simulated["finetune"] == checked["finetune"] == "lora"
    assert 0.7 <= simulated["peak_bytes"] / checked["peak_bytes"] <= 1.3
    assert main([*args[:-1], "1KiB", "--host-ram", "1GiB", "--cuda-context", "0"]) == 1  # nothing fits 1 KiB
    assert main([*args[:-1], "512MiB"]) == 2  # a card the CUDA context takes whole: refused, naming both
    captured = capsys.readouterr()
    assert "--budget: 512.0 MiB leaves nothing beside the CUDA context of 619.0 MiB" in captured.out + captured.err
