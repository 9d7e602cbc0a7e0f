"""Fine-tuning (issue 30): peft's LoRA and QLoRA's torchao NF4 base on fsdp2lite, 2 gloo ranks, a tiny
Llama whose projections hold whole NF4 scale blocks per rank (64 * 256 values). Losses equal torch's
fully_shard with the same peft/NF4 setup bit for bit; the NF4 bytes after fsdp2lite's all-gather equal
the unsharded quantization; per-rank quantization equals the whole tensor's, chunked; the saved adapter
reproduces rank 0's evaluation loss in peft on one process; a resumed run has the uninterrupted losses;
bad input is refused by name."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _dist import cpu_mesh, spawn_checks
from _models import example_train

import fsdp2lite as fl
from fsdp2lite import finetune
from fsdp2lite.config import checkpoint_forward

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
SETTINGS = finetune.LoraSettings(rank=4, alpha=8.0)


def _have(*names: str) -> bool:
    try:
        finetune.require_libraries("qlora" if "torchao" in names else "lora")
    except finetune.MissingExtraError:
        return False
    return True


needs_peft = pytest.mark.skipif(not _have("peft"), reason=f"peft is not installed: {finetune.INSTALL_HINT}")
needs_torchao = pytest.mark.skipif(
    not _have("peft", "torchao"), reason=f"peft or torchao is not installed: {finetune.INSTALL_HINT}"
)


def llama(seed: int = 0) -> nn.Module:
    """A 2-layer Llama in bf16: q/o 256x256, k/v 128x256, MLP 512x256 (each half a whole scale block)."""
    from _models import tiny_llama

    torch.manual_seed(seed)
    return tiny_llama(hidden=256, intermediate=512).to(torch.bfloat16)


def finetune_model(mode: str, seed: int = 0, shard_size: int | None = None, torchao: bool = False) -> nn.Module:
    """``torchao``: the oracle's base, torchao's own ``NF4Tensor`` on every adapted weight (its ``linear_nf4``
    dequantizes it), where fsdp2lite's ``quantize_base`` makes ``NF4Rows`` that gather into ``NF4Weight``s."""
    model = finetune.apply_lora(llama(seed), SETTINGS)
    if mode == "qlora" and torchao:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        for module in model.modules():
            if hasattr(module, "lora_A"):
                module.base_layer.weight = nn.Parameter(to_nf4(module.base_layer.weight.detach()), requires_grad=False)
    elif mode == "qlora":
        finetune.quantize_base(model, shard_size=shard_size or dist.get_world_size())
    return model


def shard_fsdp2lite(model: nn.Module, mesh: Any = None) -> None:
    config = finetune.finetune_config(fl.FSDPConfig.from_yaml(REPO / "configs" / "hf_causal_lm.yaml"))
    fl.apply_config(model, config, mesh or cpu_mesh())


def shard_torch(model: nn.Module) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        checkpoint_forward(layer)
        torch_fully_shard(layer, mesh=cpu_mesh(), mp_policy=mp)
    torch_fully_shard(model, mesh=cpu_mesh(), mp_policy=mp, reshard_after_forward=False)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, batch(step, rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(finetune.trainable_parameters(model), lr=1e-2)


def run(mode: str, shard: Any, rank: int) -> tuple[nn.Module, list[float]]:
    model = finetune_model(mode, torchao=shard is shard_torch)
    shard(model)
    return model, train(model, adamw(model), range(STEPS), rank)


def check_lora_and_qlora_against_torch(rank: int, world_size: int, adapter_dir: str) -> None:
    """bit for bit against torch's fully_shard with torchao's own NF4 (fsdp2lite's dequantization equals
    torchao's); the adapters are fp32 masters, the base frozen."""
    for mode in ("lora", "qlora"):
        mine_model, mine = run(mode, shard_fsdp2lite, rank)
        _, theirs = run(mode, shard_torch, rank)
        assert mine == theirs, (mode, mine, theirs)
        assert mine[-1] < mine[0], (mode, mine)  # the adapters learn
        trainable = dict((n, p) for n, p in mine_model.named_parameters() if p.requires_grad)
        assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
        if mode == "lora":
            check_saved_adapter(mine_model, rank, Path(adapter_dir))


def check_saved_adapter(model: nn.Module, rank: int, directory: Path) -> None:
    """peft's files from rank 0, loaded into the unsharded base on one process: rank 0's eval loss."""
    model.eval()
    with torch.no_grad():
        sharded_loss = loss_of(model, batch(99, 0))
    finetune.save_adapter(model, directory)
    if rank != 0:
        return
    from peft import PeftModel

    assert {p.name for p in directory.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    loaded = PeftModel.from_pretrained(llama(), directory).to(torch.bfloat16)  # bf16 compute, as sharded
    loaded.eval()
    with torch.no_grad():
        single_loss = loss_of(loaded, batch(99, 0))
    assert torch.equal(single_loss, sharded_loss), (single_loss, sharded_loss)


def check_nf4_bytes(rank: int, world_size: int, adapter_dir: str) -> None:
    """Per-rank quantization equals the whole tensor's chunk; fsdp2lite's all-gather rebuilds the whole
    tensor's NF4 byte for byte (quantized codes, int8 scales, their factors and the scale mean)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    reference = llama()
    model = finetune_model("qlora")
    shard_fsdp2lite(model)
    layer = model.base_model.model.model.layers[1]
    layer.unshard()
    for name in ("self_attn.k_proj", "mlp.down_proj"):
        full = reference.get_submodule(f"model.layers.1.{name}").weight.detach()
        whole = to_nf4(full)
        gathered = layer.get_submodule(name).base_layer.weight
        assert same_nf4(gathered, whole), name
        rows = full.chunk(world_size)[rank]
        assert same_nf4(finetune.quantize_rows(rows), whole.chunk(world_size)[rank]), name
    layer.reshard()


def check_qlora_at_any_shard_degree(rank: int, world_size: int) -> None:
    """3 ranks: no projection splits into 3 row shards of whole NF4 scale blocks (256 or 512 rows), so each is
    an NF4Rows padded by rows. Gathered, every weight is to_nf4 of the whole byte for byte; each rank's
    row_parts are its rows of it; 5 steps on the same batch everywhere have the losses of the same NF4 model
    trained alone on one rank (torchao's own NF4Tensor and its dequantization, a 1-rank mesh), bit for bit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from fsdp2lite.finetune.nf4_rows import NF4Rows, rows_of

    model = finetune_model("qlora")
    bases = [m.base_layer.weight for m in model.modules() if hasattr(m, "base_layer")]
    assert bases and all(type(w) is NF4Rows for w in bases)
    shard_fsdp2lite(model)
    reference = llama()
    layer = model.base_model.model.model.layers[1]
    layer.unshard()
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "mlp.down_proj"):
        full = reference.get_submodule(f"model.layers.1.{name}").weight.detach()
        whole = to_nf4(full)
        assert same_nf4(layer.get_submodule(name).base_layer.weight, whole), name
        rows, start = full.chunk(world_size)[rank], math.ceil(full.shape[0] / world_size) * rank
        parts, expected = finetune.row_parts(rows, full.shape[0]), rows_of(whole)
        assert torch.equal(parts.codes, expected.codes[start : start + rows.shape[0]]), name
        assert torch.equal(parts.scalers, expected.scalers[start : start + rows.shape[0]]), name
        assert torch.equal(raw(parts.quantization_factor), raw(whole.quantization_factor)), name
    layer.reshard()
    check_offloaded_nf4_rows(rows_of(to_nf4(full)), to_nf4(full))
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank makes every group
    single = finetune_model("qlora", shard_size=1, torchao=True)
    shard_fsdp2lite(single, DeviceMesh.from_group(alone, "cpu", mesh_dim_names=("shard",)))
    mine = train(model, adamw(model), range(STEPS), rank=0)
    theirs = train(single, adamw(single), range(STEPS), rank=0)
    assert mine == theirs, (mine, theirs)
    trained = [p.to_local() for n, p in model.named_parameters() if "lora_B" in n]  # zero at init
    assert trained and all(p.abs().sum() > 0 for p in trained)


def check_offloaded_nf4_rows(weight: Any, whole: Any) -> None:
    """An NF4Rows under CPU offload: its padded shard on the host, gathered byte for byte."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    fl.fully_shard(linear, mesh=cpu_mesh(), offload_policy=fl.CPUOffloadPolicy(pin_memory=False))
    assert type(linear.weight.to_local()).__name__ == "NF4Rows" and linear.weight.to_local().codes.device.type == "cpu"
    linear.unshard()
    assert same_nf4(linear.weight, whole)
    linear.reshard()


def same_nf4(a: Any, b: Any) -> bool:
    as_bytes = [(raw(x), raw(y)) for x, y in zip(nf4_parts(a), nf4_parts(b))]
    return a.shape == b.shape and all(torch.equal(x, y) for x, y in as_bytes)


def nf4_parts(weight: Any) -> tuple[torch.Tensor, ...]:
    """(codes, int8 scales, their factors, the scale mean) of torchao's NF4Tensor or fsdp2lite's NF4Weight."""
    if hasattr(weight, "whole"):
        return weight.codes, weight.scalers, weight.whole.quantization_factor, weight.whole.scaler_mean
    return weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean


def raw(tensor: torch.Tensor) -> torch.Tensor:  # (a 1-element factor may have stride 256: contiguous_format)
    return tensor.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def check_resume(rank: int, world_size: int, checkpoint_dir: str) -> None:
    """2 steps, adapters + optimizer saved, a new model (other adapter init) loads them: steps 3-5 have the
    uninterrupted run's losses, bit for bit; the base is not in the checkpoint."""
    model = finetune_model("lora")
    shard_fsdp2lite(model)
    uninterrupted = train(model, adamw(model), range(STEPS), rank)
    first = finetune_model("lora")
    shard_fsdp2lite(first)
    opt = adamw(first)
    assert train(first, opt, range(2), rank) == uninterrupted[:2]
    path = Path(checkpoint_dir) / "step-2"
    finetune.save_trainable(path, first, opt)
    torch.manual_seed(7)  # other adapter values before the load
    resumed = finetune.apply_lora(llama(), SETTINGS)
    shard_fsdp2lite(resumed)
    opt = adamw(resumed)
    finetune.load_trainable(path, resumed, opt)
    assert train(resumed, opt, range(2, STEPS), rank) == uninterrupted[2:]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert not [k for k in saved if k.startswith("trainable.") and "lora_" not in k]


@needs_torchao
def check_chunked_loss_and_one_gather_each(rank: int, world_size: int) -> None:
    """examples/train.py's loss (the frozen head and the cross-entropy run by run: finetune.head_loss, here runs
    of 8 tokens, 2 a batch) trains as the full logits' loss does (bf16 compute: the same logits, summed in
    another order); and with configs/hf_causal_lm.yaml the embedding and the head are groups of their own: the
    embedding all-gathered once a step (nothing flows back to it, so backward never gathers it), the head once
    in its forward and once more for its backward (resharded after forward in between)."""
    import fsdp2lite.finetune.head_loss as head_loss
    from fsdp2lite.finetune.data.text import window_loss

    head_loss.CHUNK_LOGIT_BYTES = 4 * 96 * 8  # 8 tokens a run at the tiny Llama's vocabulary of 96
    chunked, full = finetune_model("lora"), finetune_model("lora")
    for model in (chunked, full):
        shard_fsdp2lite(model)
    optimizers = [adamw(chunked), adamw(full)]
    for step in range(STEPS):
        window = batch(step, rank)
        with fl.record_trace(chunked) as trace:
            losses = [window_loss(chunked, window), loss_of(full, window)]
            for loss in losses:
                loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-3, atol=2e-3)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        gathers = {group: trace.names(group).count("all_gather_issue") for group in {e.group for e in trace.events}}
        assert gathers["base_model.model.model.embed_tokens"] == 1, gathers
        assert gathers["base_model.model.lm_head"] == 2, gathers


def test_finetune_world2(tmp_path: Path) -> None:
    from functools import partial

    spawn_checks(
        2,
        partial(check_lora_and_qlora_against_torch, adapter_dir=str(tmp_path / "adapter")),
        partial(check_nf4_bytes, adapter_dir=""),
        partial(check_resume, checkpoint_dir=str(tmp_path / "ckpt")),
        check_chunked_loss_and_one_gather_each,
    )


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["peft", "torchao"])
def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ImportError
    with pytest.raises(
        finetune.MissingExtraError,
        match=rf'needs (peft and )?{missing}, not installed: pip install -e "\.\[finetune\]"$',
    ):
        finetune.require_libraries("qlora")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rank", 0, r"lora rank 0: expected an integer from 1 to 4096"),
        ("rank", 2.5, r"lora rank 2.5: expected an integer"),
        ("alpha", 0.0, r"lora alpha 0.0: expected a number greater than 0"),
        ("dropout", 1.0, r"lora dropout 1.0: expected a number in \[0, 1\)"),
        ("targets", (), r"lora targets \(\): expected one or more module names"),
    ],
)
def test_settings_out_of_range_are_refused_by_name(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        finetune.LoraSettings(**{field: value})


@needs_peft
def test_targets_that_match_nothing_list_the_layers_and_change_nothing() -> None:
    from _models import tiny_llama

    model = tiny_llama()
    before = [name for name, _ in model.named_modules()]
    with pytest.raises(
        ValueError,
        match=r"lora targets qproj, w1 match no Linear layer of LlamaForCausalLM; "
        r"its Linear layers are named: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj",
    ):
        finetune.apply_lora(model, finetune.LoraSettings(targets=("qproj", "q_proj", "w1")))
    assert [name for name, _ in model.named_modules()] == before


@needs_torchao
def test_qlora_at_world3() -> None:
    spawn_checks(3, check_qlora_at_any_shard_degree)


@needs_torchao
def test_qlora_refuses_weights_of_partial_scale_units_before_changing_any() -> None:
    from _models import tiny_llama

    model = finetune.apply_lora(tiny_llama(), finetune.LoraSettings(rank=2))
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"q_proj.base_layer \(32, 32\): NF4 quantizes a 2D weight of a multiple of "
        r"64 \* 256 = 16384 values \(1024 here\), at any shard degree",
    ):
        finetune.quantize_base(model, shard_size=2)
    assert all(p is before[n] for n, p in model.named_parameters())


# ---- examples/train.py ---------------------------------------------------------------------------------
@needs_torchao
def test_train_qlora_saves_a_peft_adapter_and_resumes_exactly(tmp_path: Path) -> None:
    """torchrun, 2 CPU ranks: --finetune qlora 4 steps saving at 2; a run resumed from step 2 has the
    uninterrupted losses of steps 3 and 4; the checkpoint holds adapters + optimizer and peft's adapter; no
    other package's import-time line in the output (issue 44)."""
    import json

    import transformers
    from test_example_train import foreign_lines, losses, record, torchrun

    transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(tmp_path / "model")  # fmt: skip
    common = ["--model-config", "model", "--finetune", "qlora", "--lora-rank", "4", "--seq", "32", "--batch", "2"]
    common += ["--warmup-steps", "2", "--log-every", "1", "--checkpoint-dir", "ckpt", "--save-every", "2"]
    run = torchrun(*common, "--steps", "4", "--metrics", "a.jsonl", cwd=tmp_path)
    assert foreign_lines(run.stderr) == [], "torchao's, torch's, bitsandbytes' and peft's import noise left out"
    first = record(run)
    assert first["final_loss"] < losses(tmp_path / "a.jsonl")[1]
    step2 = tmp_path / "ckpt" / "step-0000002"
    config = json.loads((step2 / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 32.0) and (
        step2 / "adapter" / "adapter_model.safetensors"
    ).is_file()
    resumed = record(torchrun(*common, "--steps", "4", "--resume", str(step2), "--metrics", "b.jsonl", cwd=tmp_path))
    assert resumed["start_step"] == 2
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert [b[3], b[4]] == [a[3], a[4]], (a, b)


def test_train_refuses_lora_settings_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    train = example_train()
    for flag, value, message in (
        ("--lora-rank", "0", "--lora-rank 0: expected an integer from 1 to 4096"),
        ("--lora-alpha", "-1", "--lora-alpha -1.0: expected a number greater than 0"),
        ("--lora-dropout", "1.5", "--lora-dropout 1.5: expected a number in [0, 1)"),
    ):
        with pytest.raises(SystemExit) as exit_:
            train.parse_args(["--finetune", "lora", flag, value])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_train_qlora_without_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    train = example_train()
    monkeypatch.setitem(sys.modules, "torchao", None)
    args = train.parse_args(["--finetune", "qlora"])
    with pytest.raises(
        train.UsageError,
        match=r'--finetune qlora needs (peft and )?torchao, not installed: pip install -e "\.\[finetune\]"',
    ):
        train.read_inputs(args, train.HF_CONFIG)
