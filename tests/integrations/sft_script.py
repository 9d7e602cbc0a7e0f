"""A standard TRL SFT script (trl/scripts/sft.py's shape): SFTTrainer, peft's LoRA from ModelConfig, an
optional bitsandbytes 4-bit base, the command line deciding FSDP (issue 44 item 6).

    torchrun --standalone --nproc-per-node 2 tests/integrations/sft_script.py \
        --model_name_or_path MODEL --dataset_name DATA_DIR --output_dir OUT --out OUT \
        --fsdp full_shard --fsdp_config cfg.json --use_peft [--load_in_4bit --bnb_4bit_quant_storage uint8] ...
    torchrun --standalone --nproc-per-node 2 -m fsdp2lite.run tests/integrations/sft_script.py ...

The arguments are TRL's own (``TrlParser`` over ``ScriptArguments``, ``SFTConfig``, ``ModelConfig``), plus
``--out``: where each rank writes rank{r}.json (the logged losses, what the model became, the 4-bit bytes
this rank holds). ``trainer.save_model`` writes the adapter to ``--output_dir``. Run plainly it shards with
torch's ``fully_shard``; under ``python -m fsdp2lite.run`` with fsdp2lite's. The test-only parts: FSDP on
CPU ranks (tests/integrations/cpu_fsdp.py), and ``--configurations FILE`` ([Note: configurations in one run]).

[Note: configurations in one run]
Process start and the imports of TRL, transformers and datasets are most of a run's time, so the test trains
several configurations in the same processes: FILE is a JSON list of argument lists, each added to the
command line's (its ``--out`` and ``--output_dir`` among them: the last value of an option wins), and each
trained in turn as its own run would be. What a run leaves behind in the process is Accelerate's state
(``PartialState`` and ``AcceleratorState`` are singletons; enable_fsdp_on_cpu writes FSDP into them), so it
is cleared before each configuration, as in a new process (the process group stays, and ``PartialState``
takes it up again; transformers' TrainingArguments clears it too when it sets up its devices). Each record
says whether its Trainer found Accelerate fresh (on CPU Accelerate drops FSDP, which the mixin then
enables); SFTTrainer seeds itself (``set_seed(args.seed)``) before it builds the model and the adapter.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from cpu_fsdp import CpuFsdpMixin, implementation
from datasets import load_dataset
from torch.distributed.tensor import DTensor
from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config, get_quantization_config


@dataclass
class Report:
    out: str = field(default="", metadata={"help": "where each rank writes rank{r}.json"})
    configurations: str = field(
        default="", metadata={"help": "a JSON list of argument lists, one run each ([Note: configurations in one run])"}
    )


class CpuFsdpSFTTrainer(CpuFsdpMixin, SFTTrainer):
    pass


def four_bit_bytes(model: Any) -> dict[str, int]:
    """The 4-bit codes of the base's Linear4bit layers: the bytes this rank holds, and the whole weights'."""
    from bitsandbytes.nn import Linear4bit

    held = whole = 0
    for module in model.modules():
        if isinstance(module, Linear4bit):
            weight = module.weight
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            held += local.numel() * local.element_size()
            whole += weight.numel() * weight.element_size()
    return {"held": held, "whole": whole}


def train(parser: TrlParser, argv: list[str]) -> None:
    """One run: train, save the adapter, write this rank's record."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # [Note: configurations in one run]
    script_args, training_args, model_args, report = parser.parse_args_and_config(argv)
    training_args.model_init_kwargs = {"dtype": model_args.dtype}
    dataset = load_dataset(script_args.dataset_name)
    trainer = CpuFsdpSFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    model = trainer.model_wrapped
    result = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "fsdp2": trainer.accelerator.is_fsdp2,
        "fsdp_enabled_on_cpu": trainer.fsdp_enabled_on_cpu,
        "model": implementation(model),
        "four_bit": four_bit_bytes(model) if model_args.load_in_4bit else None,
    }
    Path(report.out).mkdir(parents=True, exist_ok=True)
    (Path(report.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


def main() -> None:
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, Report))
    argv = sys.argv[1:]
    *_, report = parser.parse_args_and_config(argv)
    runs = json.loads(Path(report.configurations).read_text()) if report.configurations else [[]]
    for extra in runs:
        train(parser, [*argv, *extra])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
