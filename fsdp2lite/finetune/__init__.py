"""Parameter-efficient fine-tuning on fsdp2lite: peft's LoRA adapters on a frozen base, QLoRA's NF4 base
(torchao), one group per decoder layer holding base and adapters, and adapter-only saving.

The recipe (docs/finetune.md): ``require_libraries`` -> on the meta device ``apply_lora`` (``quantize_base``
for qlora) -> ``finetune_config`` + ``fl.apply_config`` -> ``to_empty`` -> ``fl.load_sharded_weights`` (with
``load_nf4_rows`` for qlora: each rank reads and quantizes its own rows) -> ``init_adapters`` -> train ->
``save_adapter`` (peft's format) and ``save_trainable`` / ``load_trainable`` (adapters + optimizer, for
resuming). Needs the ``[finetune]`` extra (peft and torchao: ``pip install -e ".[finetune]"`` in a clone);
nothing here imports them before it is called.
"""

from __future__ import annotations

from .adapter import save_adapter
from .checkpoint import load_trainable, save_trainable
from .deps import INSTALL_HINT, MissingExtraError, require_libraries
from .feasible import check_finetune, finetune_problems
from .lora import ADAPTER_LR, DEFAULT_TARGETS, LoraSettings, apply_lora, init_adapters, trainable_parameters
from .nf4_rows import NF4Rows
from .qlora import BLOCK_SIZE, SCALER_BLOCK_SIZE, load_nf4_rows, quantize_base, quantize_rows, row_parts
from .sharding import finetune_config

__all__ = [
    "ADAPTER_LR",
    "BLOCK_SIZE",
    "DEFAULT_TARGETS",
    "INSTALL_HINT",
    "LoraSettings",
    "MissingExtraError",
    "NF4Rows",
    "SCALER_BLOCK_SIZE",
    "apply_lora",
    "check_finetune",
    "finetune_config",
    "finetune_problems",
    "init_adapters",
    "load_nf4_rows",
    "load_trainable",
    "quantize_base",
    "quantize_rows",
    "require_libraries",
    "row_parts",
    "save_adapter",
    "save_trainable",
    "trainable_parameters",
]
