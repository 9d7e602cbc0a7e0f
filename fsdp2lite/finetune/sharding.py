"""The sharding plan for fine-tuning: the user's policy file, with bf16 compute and activation
checkpointing on its wrap rules (the per-decoder-layer groups that hold base and adapters alike)."""

from __future__ import annotations

import torch

from ..config import FSDPConfig


def finetune_config(config: FSDPConfig, activation_checkpointing: bool = True) -> FSDPConfig:
    """``config`` with ``param_dtype`` bf16 unless it names one (fp32 adapter masters and optimizer state
    stay sharded in fp32) and ``activation_checkpointing`` set on every wrap rule (each decoder layer's
    forward recomputed in backward). peft keeps the decoder layers' class names, so class rules such as
    configs/hf_causal_lm.yaml's still match them. A new config; ``config`` is unchanged."""
    mixed = config.mixed_precision
    if mixed.param_dtype is None:
        mixed = mixed.model_copy(update={"param_dtype": torch.bfloat16})
    rules = [rule.model_copy(update={"activation_checkpointing": activation_checkpointing}) for rule in config.wrap]
    return config.model_copy(update={"mixed_precision": mixed, "wrap": rules})
