"""Checkpoints with torch.distributed.checkpoint (DCP), checked before they are loaded.

    fl.save_checkpoint(path, model, optimizer)      # every rank writes its shards
    fl.load_checkpoint(path, model, optimizer)      # any world size or mesh: DCP reshards on load

``optimizer`` may also be a list of optimizers over disjoint parameters (``fl.step_in_backward``'s
``handle.optimizers``: one per group): their states are saved as one, keyed by parameter name, as torch's
``get_optimizer_state_dict`` merges them, and split back on load.

fsdp2lite models hold DTensor parameters with the placements torch's ``fully_shard`` uses, so DCP and
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` & co.) work on them directly and
checkpoints move both ways between the two libraries. These two functions add what a user needs on
top: before anything is read, every rank checks the checkpoint against the model (missing and
unexpected keys, shape mismatches, truncated or missing files) from the metadata file alone, so a bad
checkpoint raises the same clear error on every rank instead of failing on some and hanging the rest.
Every read goes through ``safe.py``: a checkpoint cannot run code ([Note: safe metadata]).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .._summary import summarized
from .errors import CheckpointError
from .safe import SafeFileSystemReader, SafeLoadPlanner, load_metadata

Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...]


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizers | None = None) -> None:
    """Save ``{"model": ..., "optim": ...}`` with DCP; collective: call it on every rank."""
    _check_arguments("save_checkpoint", path, model, optimizer)
    if Path(path).exists() and not Path(path).is_dir():
        raise CheckpointError(
            f"{path}: exists and is a file; a checkpoint is a directory: pass a new or existing directory"
        )
    try:
        dcp.save(_state(model, optimizer), checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{path}: saving failed: {_first_failure(exc)}") from None


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizers | None = None) -> None:
    """Check, then load a DCP checkpoint into ``model`` (and ``optimizer``) in place; collective.

    All or nothing: the checkpoint is read into separate tensors first (for a moment, a second copy of
    this rank's model and optimizer state) and copied into the model only once all of it was read, so a
    damaged file raises ``CheckpointError`` naming the tensor and leaves the model and optimizer as they
    were."""
    _check_arguments("load_checkpoint", path, model, optimizer)
    state = _state(model, optimizer)
    metadata = check_checkpoint(path, state)
    staged = _staged(state)
    try:
        # the safe reader (given the metadata just checked) and planner: no code from the checkpoint runs
        reader = SafeFileSystemReader(str(path), metadata)
        dcp.load(staged, storage_reader=reader, planner=SafeLoadPlanner(path))  # [Note: safe metadata]
    except (Exception, CheckpointException) as exc:
        damaged = damaged_items(path, metadata)
        cause = "; ".join(damaged[:4]) if damaged else _first_failure(exc)
        raise CheckpointError(
            f"{path}: reading failed, nothing was loaded (model and optimizer unchanged): {cause}"
        ) from None
    set_model_state_dict(model, staged["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, staged["optim"])


def _check_arguments(caller: str, path: Any, model: Any, optimizer: Any) -> None:
    usage = f"{caller}(path, model, optimizer=None)"
    if not isinstance(path, str | Path):
        raise TypeError(f"{usage}: path must be a str or Path, got {type(path).__name__}")
    if isinstance(model, torch.optim.Optimizer):
        raise TypeError(
            f"{usage}: got an optimizer ({type(model).__name__}) where the model goes; pass the model second"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"{usage}: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    if not isinstance(optimizer, list | tuple) or not optimizer:
        raise TypeError(
            f"{usage}: optimizer must be a torch.optim.Optimizer, a non-empty list of them (one per group: "
            f"fl.step_in_backward's handle.optimizers) or None, got {_describe(optimizer)}"
        )
    for index, item in enumerate(optimizer):
        if not isinstance(item, torch.optim.Optimizer):
            raise TypeError(f"{usage}: optimizer[{index}] must be a torch.optim.Optimizer, got {type(item).__name__}")
    _check_disjoint(usage, model, optimizer)


def _describe(value: Any) -> str:
    return "an empty list" if isinstance(value, list | tuple) else type(value).__name__


def _check_disjoint(usage: str, model: nn.Module, optimizers: list[torch.optim.Optimizer] | tuple[Any, ...]) -> None:
    """Each parameter in one optimizer at most: their states are saved as one dict keyed by parameter name."""
    names = {id(param): name for name, param in model.named_parameters()}
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                first = owner.setdefault(id(param), index)
                if first != index:
                    name = names.get(id(param), f"a {tuple(param.shape)} parameter")
                    raise ValueError(
                        f"{usage}: {name} is in optimizer[{first}] and optimizer[{index}]; a list of optimizers "
                        "is saved as one state keyed by parameter name, so each parameter may be in one of them"
                    )


def _staged(value: Any) -> Any:
    """A copy of a state dict's structure with a fresh, uninitialized tensor (DTensor: same placements) for
    each tensor: what DCP reads into before anything of the model's is overwritten."""
    if isinstance(value, dict):
        return {key: _staged(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_staged(item) for item in value]
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    return value


def _first_failure(exc: BaseException) -> str:
    """One line for what went wrong: the first rank's exception, without DCP's embedded tracebacks."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (error, _) = sorted(failures.items())[0]
        return f"rank {rank}: {type(error).__name__}: {_line(error)}"
    return f"{type(exc).__name__}: {_line(exc)}"


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def damaged_items(path: str | Path, metadata: Metadata) -> list[str]:
    """Tensors whose stored bytes cannot be decoded: ``name (file, bytes a..b)``, read one by one."""
    saved = metadata.state_dict_metadata
    found = []
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda item: str(item[0].fqn)):
        relative = getattr(info, "relative_path", None)
        if relative is None or not isinstance(saved.get(index.fqn), TensorStorageMetadata):
            continue
        where = f"{index.fqn} ({relative}, bytes {info.offset}..{info.offset + info.length})"
        try:
            with open(Path(path) / relative, "rb") as file:
                file.seek(info.offset)
                raw = file.read(info.length)
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:
            found.append(f"damaged data for {where}: {type(exc).__name__}")
    return found


def _state(model: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def read_metadata(path: str | Path) -> Metadata:
    """The checkpoint's metadata, read without running code from it ([Note: safe metadata]); a clear
    ``CheckpointError`` when the directory is not a checkpoint, is damaged or holds foreign pickle."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass the directory a checkpoint was saved to")
    return load_metadata(path)


def check_checkpoint(path: str | Path, state: dict[str, Any]) -> Metadata:
    """Compare a checkpoint with the state it would load into; raise listing every problem. Returns the
    metadata it read, for the load that follows."""
    metadata = read_metadata(path)
    problems = _key_problems(metadata, _flatten(state)) + _file_problems(Path(path), metadata)
    if problems:
        listing = "\n  ".join(summarized(problems))
        raise CheckpointError(f"{path} does not fit this model ({len(problems)} problem(s)):\n  {listing}")
    return metadata


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
