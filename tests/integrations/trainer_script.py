"""A user's HF Trainer script, unaware of fsdp2lite: the command line decides FSDP (issue 30 item 5).

    torchrun --standalone --nproc-per-node 2 tests/integrations/trainer_script.py \
        --out OUT --fsdp full_shard --fsdp_config cfg.json --output_dir OUT/trainer ...
    torchrun --standalone --nproc-per-node 2 -m fsdp2lite.run tests/integrations/trainer_script.py ...

The arguments are the Trainer's own (``HfArgumentParser``), plus ``--out`` (where each rank writes
rank{r}.json: the losses, what the model became, how the script was run) and ``--lora`` (peft's LoRA
adapters on the attention and MLP projections, the base frozen). Run plainly it shards with torch's
``fully_shard``; under ``python -m fsdp2lite.run`` with fsdp2lite's. The test-only parts: FSDP on CPU
ranks (tests/integrations/cpu_fsdp.py, which only sets Accelerate's state), and ``--configurations FILE``,
several runs in the same processes as in tests/integrations/sft_script.py ([Note: configurations in one
run] there): FILE a JSON list of argument lists, each added to the command line's and trained in turn,
Accelerate's state cleared before each.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cpu_fsdp import CpuFsdpMixin, implementation
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig, Trainer, TrainingArguments


@dataclass
class ScriptArguments:
    out: str = field(default="", metadata={"help": "where each rank writes rank{r}.json"})
    lora: bool = field(default=False, metadata={"help": "train peft LoRA adapters on a frozen base"})
    configurations: str = field(default="", metadata={"help": "a JSON list of argument lists, one run each"})


class CpuFsdpTrainer(CpuFsdpMixin, Trainer):
    pass


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def with_lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))


def dataset(n: int = 32, seq: int = 12, vocab: int = 96) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": t, "labels": t} for t in tokens]


def train(parser: HfArgumentParser, argv: list[str]) -> None:
    """One run: train, write this rank's record."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # as in a new process (module docstring)
    script_args, training_args = parser.parse_args_into_dataclasses(argv)
    model = tiny_llama()
    if script_args.lora:
        model = with_lora(model)
    trainer = CpuFsdpTrainer(model=model, args=training_args, train_dataset=dataset())
    trainer.train()
    wrapped = trainer.model_wrapped
    result = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "fsdp_enabled_on_cpu": trainer.fsdp_enabled_on_cpu,
        "model": implementation(wrapped),
        "argv0": sys.argv[0],
        "path0": sys.path[0],
        "name": __name__,
    }
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(script_args.out).mkdir(parents=True, exist_ok=True)
    (Path(script_args.out) / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    argv = sys.argv[1:]
    script_args, _ = parser.parse_args_into_dataclasses(argv)
    runs = json.loads(Path(script_args.configurations).read_text()) if script_args.configurations else [[]]
    for extra in runs:
        train(parser, [*argv, *extra])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
