"""The trained adapter in peft's own format (adapter_config.json + adapter_model.safetensors), written by
rank 0 from the gathered adapter shards: ``PeftModel.from_pretrained(base, directory)`` loads it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def gathered_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full tensor} of the trainable parameters (the adapters), on the host. Collective: every
    rank gathers every shard in the same (registration) order."""
    full = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        value = param.full_tensor() if isinstance(param, DTensor) else param
        full[name] = value.detach().cpu()
    return full


def save_adapter(model: nn.Module, directory: str | Path) -> Path | None:
    """Write ``model``'s adapter (a PeftModel, sharded or not) to ``directory`` in peft's format, from
    rank 0; returns the directory on rank 0, None elsewhere. Collective when a process group is up."""
    if not hasattr(model, "peft_config"):
        raise TypeError(f"save_adapter: {type(model).__name__} is not a peft model (apply_lora makes one)")
    full = gathered_trainable(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    directory = Path(directory)
    model.save_pretrained(directory, state_dict=full, safe_serialization=True)  # type: ignore[operator]
    return directory
