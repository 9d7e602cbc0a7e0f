"""The sharding plan for fine-tuning: the user's policy file, with bf16 compute and activation
checkpointing on its wrap rules (the per-decoder-layer groups that hold base and adapters alike)."""

from __future__ import annotations

import torch

from ..config import FSDPConfig


def finetune_config(
    config: FSDPConfig, activation_checkpointing: bool = True, compute_dtype: torch.dtype | None = torch.bfloat16
) -> FSDPConfig:
    """``config`` with ``param_dtype`` ``compute_dtype`` unless it names one (fp32 adapter masters and
    optimizer state stay sharded in fp32; None: leave it) and ``activation_checkpointing`` set on every
    wrap rule but a ``group: tied`` one (each decoder layer's forward recomputed in backward; an embedding or a
    head saves nothing worth recomputing). peft keeps the decoder layers' class names, so class rules such as
    configs/hf_causal_lm.yaml's still match them. A new config."""
    mixed = config.mixed_precision
    if mixed.param_dtype is None and compute_dtype is not None:
        mixed = mixed.model_copy(update={"param_dtype": compute_dtype})
    rules = [
        rule if rule.group == "tied" else rule.model_copy(update={"activation_checkpointing": activation_checkpointing})
        for rule in config.wrap
    ]
    return config.model_copy(update={"mixed_precision": mixed, "wrap": rules})
