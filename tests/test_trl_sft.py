"""TRL's SFTTrainer with peft's LoRA under ``torchrun -m fsdp2lite.run`` (issue 44 item 6).

tests/integrations/sft_script.py, a standard TRL SFT script (TrlParser, SFTTrainer, LoraConfig from
ModelConfig, ``--fsdp full_shard`` with ``fsdp_version: 2``), runs on 2 gloo ranks once plainly (torch's
``fully_shard`` through Accelerate: the oracle) and once under ``python -m fsdp2lite.run``, on a tiny Llama
and a tiny prompt/completion dataset written here (no network). Per base (a bf16 model; bitsandbytes 4-bit
in its default uint8 storage, which torch's path leaves replicated on every rank; 4-bit in bf16 storage):
the logged losses are equal at every step, bit for bit; ``trainer.save_model`` writes the adapter on both
runs (byte-identical files) and peft loads it back; fsdp2lite's ranks each hold exactly half of the 4-bit
bytes, in either storage.

Process start and imports are most of a run's time, so each implementation trains the three bases in one
torchrun, in turn, Accelerate's state cleared between them ([Note: configurations in one run] in the
script; each record shows its Trainer found that state fresh). fsdp2lite's run takes the bases in the
reverse order of torch's: the bit-equal losses and byte-equal adapters then also show that no base's result
depends on what trained before it in the process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _cpu_env import cpu_env

TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "integrations" / "sft_script.py"
STEPS = 4
ARGS = ["--fsdp", "full_shard", "--fsdp_config", "cfg.json", "--per_device_train_batch_size", "2", "--max_steps",
        str(STEPS), "--learning_rate", "5e-3", "--lr_scheduler_type", "constant", "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--use_cpu", "--disable_tqdm", "true",
        "--max_length", "32", "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules",
        "all-linear"]  # fmt: skip
FSDP_CONFIG = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
BASES = {
    "bf16": ["--dtype", "bfloat16"],
    "4bit-uint8": ["--load_in_4bit", "--bnb_4bit_quant_storage", "uint8"],
    "4bit-bf16": ["--load_in_4bit", "--bnb_4bit_quant_storage", "bfloat16"],
}
WORDS = "zero one two three four five six seven eight nine plus is what".split()


def _write_assets(root: Path) -> tuple[Path, Path]:
    """A word-level tokenizer and a tiny Llama (hidden 64: bitsandbytes' blocks of 64 values) in MODEL, and
    64 prompt/completion sums in DATA/train.jsonl."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    model_dir, data_dir = root / "model", root / "data"
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(64):
        a, b = torch.randint(0, 5, (2,), generator=g).tolist()
        rows.append({"prompt": f"what is {WORDS[a]} plus {WORDS[b]}", "completion": f" {WORDS[a + b]}"})
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data_dir


def _train(root: Path, name: str, launch: list[str], bases: list[str]) -> dict[str, list[dict[str, Any]]]:
    """One torchrun of the script on 2 ranks, training each of ``bases`` in turn: each base's rank records."""
    out = root / name
    runs = [["--out", str(out / base), "--output_dir", str(out / base / "adapter"), *BASES[base]] for base in bases]
    (root / f"{name}.json").write_text(json.dumps(runs))
    data = ["--model_name_or_path", "model", "--dataset_name", "data", "--configurations", f"{name}.json"]
    command = [*TORCHRUN_2, *launch, str(SCRIPT), *data, *ARGS]
    # PYTHONHASHSEED: peft writes the target modules ("all-linear" resolved into a set) in the set's order
    env = cpu_env(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONHASHSEED="0")
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name} run failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return {base: [json.loads((out / base / f"rank{rank}.json").read_text()) for rank in range(2)] for base in bases}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Both implementations' runs of every base this machine can train: (root, torch's, fsdp2lite's)."""
    pytest.importorskip("trl", reason="trl is not installed: pip install trl")
    pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[finetune]'")
    bases = [base for base in BASES if not base.startswith("4bit") or importlib.util.find_spec("bitsandbytes")]
    root = tmp_path_factory.mktemp("trl_sft")
    _write_assets(root)
    (root / "cfg.json").write_text(json.dumps(FSDP_CONFIG))
    fl_runs = _train(root, "fsdp2lite", ["-m", "fsdp2lite.run"], bases[::-1])  # the other order (module docstring)
    return root, _train(root, "torch", [], bases), fl_runs


def _check_reload(model_dir: Path, adapter: Path, base: str) -> None:
    """peft loads the saved adapter onto the base, the values as saved, and the model runs."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = None
    if base.startswith("4bit"):
        storage = torch.uint8 if base.endswith("uint8") else torch.bfloat16
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=storage)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization),
                                      adapter)  # fmt: skip
    saved = load_file(adapter / "adapter_model.safetensors")
    loaded = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert len(saved) == len(loaded) == 2 * 7 * 2, (len(saved), len(loaded))  # A and B, 7 projections, 2 layers
    for name, value in saved.items():
        assert torch.equal(loaded[name.replace(".weight", ".default.weight")], value.to(torch.float32)), name
    assert model(input_ids=torch.tensor([[3, 4, 5]])).logits.isfinite().all()


@pytest.mark.parametrize("base", list(BASES))
def test_trl_sft_under_the_launcher_equals_torch(
    trained: tuple[Path, dict[str, Any], dict[str, Any]], base: str
) -> None:
    if base.startswith("4bit"):
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install bitsandbytes")
    root, torch_bases, fl_bases = trained
    torch_runs, fl_runs = torch_bases[base], fl_bases[base]
    for rank, (ref, mine) in enumerate(zip(torch_runs, fl_runs, strict=True)):
        assert mine["losses"] == ref["losses"] and len(mine["losses"]) == STEPS, (rank, mine["losses"], ref["losses"])
        assert mine["fsdp2"] and ref["fsdp2"], "Accelerate must still be in FSDP2 mode at save_model"
        assert mine["fsdp_enabled_on_cpu"] and ref["fsdp_enabled_on_cpu"], "Accelerate's state carried over"
        assert "fsdp2lite.module" in mine["model"]["mro_modules"], mine["model"]  # fsdp2lite's runtime ran
        assert not any(m.startswith("fsdp2lite") for m in ref["model"]["mro_modules"]), ref["model"]
        assert mine["model"]["torch_fsdp_module"] and mine["model"]["groups"] == ref["model"]["groups"] > 1
        assert mine["model"]["trainable"] == ref["model"]["trainable"]
        if base.startswith("4bit"):  # 2 layers' q, o (64x64), k, v (32x64), gate, up, down (64x128): 36,864 bytes
            whole = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) // 2
            assert mine["four_bit"] == {"held": whole // 2, "whole": whole}, mine["four_bit"]  # sharded
            replicated = base == "4bit-uint8"  # torch's path leaves uint8 storage out of sharding
            assert ref["four_bit"] == {"held": whole if replicated else whole // 2, "whole": whole}, ref["four_bit"]
    assert fl_runs[0]["losses"] == fl_runs[1]["losses"], "ranks disagree on the logged loss"
    adapter = root / "fsdp2lite" / base / "adapter"
    files = ("adapter_model.safetensors", "adapter_config.json")
    assert all((adapter / f).read_bytes() == (root / "torch" / base / "adapter" / f).read_bytes() for f in files)
    _check_reload(root / "model", adapter, base)
