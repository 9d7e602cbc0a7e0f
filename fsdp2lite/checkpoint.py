"""Checkpoints with torch.distributed.checkpoint (DCP), checked before they are loaded.

    fl.save_checkpoint(path, model, optimizer)      # every rank writes its shards
    fl.load_checkpoint(path, model, optimizer)      # any world size or mesh: DCP reshards on load

fsdp2lite models hold DTensor parameters with the placements torch's ``fully_shard`` uses, so DCP and
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` & co.) work on them directly and
checkpoints move both ways between the two libraries. These two functions add what a user needs on
top: before anything is read, every rank checks the checkpoint against the model (missing and
unexpected keys, shape mismatches, truncated or missing files) from the metadata file alone, so a bad
checkpoint raises the same clear error on every rank instead of failing on some and hanging the rest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model (or is damaged); the message lists every offending key."""


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``{"model": ..., "optim": ...}`` with DCP; collective: call it on every rank."""
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Check, then load a DCP checkpoint into ``model`` (and ``optimizer``) in place; collective."""
    state = _state(model, optimizer)
    check_checkpoint(path, state)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def read_metadata(path: str | Path) -> Metadata:
    """The checkpoint's metadata; a clear ``CheckpointError`` when the directory is not a checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass the directory a checkpoint was saved to")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no .metadata file, so not a complete DCP checkpoint") from None
    except Exception as exc:  # unpickling a damaged file raises many kinds of errors
        raise CheckpointError(f"{path}: the .metadata file is damaged ({type(exc).__name__}: {exc})") from None


def check_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Compare a checkpoint with the state it would load into; raise listing every problem."""
    metadata = read_metadata(path)
    problems = _key_problems(metadata, _flatten(state)) + _file_problems(Path(path), metadata)
    if problems:
        listing = "\n  ".join(problems)
        raise CheckpointError(f"{path} does not fit this model ({len(problems)} problem(s)):\n  {listing}")


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """DCP's flat keys: nested dicts joined with '.', lists by index."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        elif isinstance(value, list | tuple):
            flat.update(_flatten({str(i): item for i, item in enumerate(value)}, f"{name}."))
        else:
            flat[name] = value
    return flat


def _key_problems(metadata: Metadata, expected: dict[str, Any]) -> list[str]:
    saved = metadata.state_dict_metadata
    problems = []
    model_keys = {k for k in expected if k.startswith("model.")}
    missing = sorted(k for k in model_keys if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith("model.") and k not in model_keys)
    if missing:
        problems.append(f"missing in the checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    for key, value in expected.items():
        entry = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            if tuple(entry.size) != tuple(value.shape):
                problems.append(
                    f"{key}: shape {tuple(entry.size)} in the checkpoint, {tuple(value.shape)} in the model"
                )
    optim_missing = sorted(
        k for k, v in expected.items() if k.startswith("optim.") and isinstance(v, torch.Tensor) and k not in saved
    )
    if optim_missing:
        problems.append(f"optimizer state missing in the checkpoint: {', '.join(optim_missing[:8])}")
    return problems


def _file_problems(path: Path, metadata: Metadata) -> list[str]:
    """Every data file the metadata points into must exist and be long enough."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    problems = []
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.exists():
            problems.append(f"data file {relative} is missing")
        elif os.path.getsize(file) < size:
            problems.append(f"data file {relative} is truncated: {os.path.getsize(file)} bytes, needs {size}")
    return problems
