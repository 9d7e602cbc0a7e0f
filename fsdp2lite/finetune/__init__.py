"""Parameter-efficient fine-tuning on fsdp2lite: peft's LoRA adapters on a frozen base, QLoRA's NF4 base
(torchao), one group per decoder layer holding base and adapters, and adapter-only saving.

The recipe (docs/finetune.md): ``require_libraries`` -> ``apply_lora`` (``quantize_base`` for qlora) ->
``finetune_config`` + ``fl.apply_config`` -> train -> ``save_adapter`` (peft's format) and
``save_trainable`` / ``load_trainable`` (adapters + optimizer, for resuming). Needs the
``fsdp2lite[finetune]`` extra (peft and torchao); nothing here imports them before it is called.
"""

from __future__ import annotations

from .adapter import save_adapter
from .checkpoint import load_trainable, save_trainable
from .deps import INSTALL_HINT, MissingExtraError, require_libraries
from .lora import DEFAULT_TARGETS, LoraSettings, apply_lora, trainable_parameters
from .qlora import BLOCK_SIZE, SCALER_BLOCK_SIZE, quantize_base, quantize_rows
from .sharding import finetune_config

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_TARGETS",
    "INSTALL_HINT",
    "LoraSettings",
    "MissingExtraError",
    "SCALER_BLOCK_SIZE",
    "apply_lora",
    "finetune_config",
    "load_trainable",
    "quantize_base",
    "quantize_rows",
    "require_libraries",
    "save_adapter",
    "save_trainable",
    "trainable_parameters",
]
