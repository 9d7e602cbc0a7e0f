"""Checkpoints for resuming a fine-tune: the trainable parameters (adapters) and the optimizer only.
The frozen base is not saved: a resumed run builds it again from the same weights (--weights or seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ..checkpoint.safe import SafeFileSystemReader, SafeLoadPlanner


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return {"trainable": trainable, "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_trainable(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the adapters and their optimizer state (collective)."""
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))


def load_trainable(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read ``save_trainable``'s checkpoint into ``model``'s adapters (in place) and ``optimizer``;
    a missing or extra adapter name is an error from torch's planner naming it; a ``.metadata`` or value
    that is not plain DCP data is refused without running it (collective)."""
    state = _state(model, optimizer)
    # the safe reader and planner, as every fsdp2lite load: nothing in the checkpoint runs ([Note: safe metadata])
    reader, planner = SafeFileSystemReader(str(path)), SafeLoadPlanner(path)
    dcp.load(state, storage_reader=reader, planner=planner)  # fills the sharded adapters in place
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
