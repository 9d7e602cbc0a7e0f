"""Reading a DCP checkpoint without running code from it.

[Note: safe metadata]
A DCP checkpoint's ``.metadata`` is a pickle, and torch's ``FileSystemReader.read_metadata`` loads it
with plain ``pickle.load``: a ``.metadata`` whose object reduces to ``os.system(...)`` runs that call the
moment the directory is read, before any check can look at it. DCP's default load planner then reads
every non-tensor value of the state dict (optimizer hyperparameters, step counters, user values) with
``torch.load(weights_only=False)``: the same hole again, in the data files.

fsdp2lite reads checkpoints only through this module:

- ``load_metadata`` unpickles ``.metadata`` with ``SafeUnpickler``, which resolves only the globals DCP
  metadata is made of (``ALLOWED_GLOBALS``: what torch 2.6 to 2.13 write with ``FileSystemWriter``,
  plus the plain containers pickle may name) and refuses every other one, by name, before it is
  imported or called. The result is then checked for shape (a ``Metadata`` whose entries have the
  right types and whose data-file paths stay inside the checkpoint directory).
- ``SafeFileSystemReader`` is a ``FileSystemReader`` whose ``read_metadata`` is ``load_metadata``:
  what ``dcp.load`` itself calls.
- ``SafeLoadPlanner`` is a ``DefaultLoadPlanner`` that first decodes each non-tensor value with
  ``torch.load(weights_only=True)`` (plain data only), so torch's own ``weights_only=False`` load that
  follows only ever sees bytes proven to hold plain data. Tensors are read by torch with
  ``weights_only=True`` already.

Unpickling what is allowed constructs dataclasses, ``torch.Size``, enums, dtypes, layouts and paths:
none of them runs code of the file's choosing. A refused global raises ``CheckpointError`` naming the
checkpoint and the global; nothing of the model has been touched at that point.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .errors import CheckpointError

_PATHS = frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"})

# (module, name) -> what torch 2.6-2.13's FileSystemWriter pickles into .metadata, and nothing else
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),  # per-item file, offset, length
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles: a name lookup
    "torch": frozenset({"Size"}),  # and every torch.dtype, torch.layout and torch.memory_format by name
    "pathlib": _PATHS,  # StorageMeta.checkpoint_id when the writer was given a Path
    "pathlib._local": _PATHS,  # the same classes, as Python 3.13+ names them
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside ``ALLOWED_GLOBALS``."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``ALLOWED_GLOBALS`` ([Note: safe metadata])."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)  # a dtype, layout or memory format: a value, not code
        raise RefusedGlobal(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"a persistent id ({str(pid)[:60]!r}), which DCP metadata never holds")


def allowed_globals() -> list[str]:
    """Every allowed global as ``module.name``, for messages and docs."""
    names = [f"{module}.{name}" for module, names in ALLOWED_GLOBALS.items() for name in sorted(names)]
    return names + ["torch.<dtype|layout|memory_format>"]


def load_metadata(path: str | Path, stream: Any = None) -> Metadata:
    """Unpickle and check the ``.metadata`` of checkpoint directory ``path`` (read from ``stream`` when
    given) without running code from it; ``CheckpointError`` names what is wrong."""
    path = Path(path)
    where = path / ".metadata"
    try:
        if stream is None:
            with open(where, "rb") as file:
                metadata = SafeUnpickler(file).load()
        else:
            metadata = SafeUnpickler(stream).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no .metadata file, so not a complete DCP checkpoint") from None
    except RefusedGlobal as exc:
        raise CheckpointError(
            f"{where}: refused to unpickle {exc.qualified!r}: DCP metadata is made of "
            "torch.distributed.checkpoint.metadata classes, torch.Size, dtypes and plain containers only, so "
            "this file was not written by DCP and could run code if loaded with pickle (do not dcp.load or "
            "torch.load it); nothing was loaded"
        ) from None
    except Exception as exc:  # truncated or foreign: pickle fails with many exception types
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
        raise CheckpointError(
            f"{where}: the .metadata file is damaged ({type(exc).__name__}: {text}); nothing was loaded"
        ) from None
    problem = _shape_problem(metadata)
    if problem:
        raise CheckpointError(f"{where}: not DCP metadata: {problem}; nothing was loaded")
    return metadata


def _shape_problem(metadata: Any) -> str | None:
    """What makes an unpickled object unusable as DCP metadata, or None: the types DCP relies on, and
    data-file paths that stay inside the checkpoint directory."""
    if not isinstance(metadata, Metadata):
        return f"the file holds a {type(metadata).__name__}, not a Metadata"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return f"state_dict_metadata is a {type(entries).__name__}, not a dict"
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata | BytesStorageMetadata):
            return f"entry {key!r} is a {type(entry).__name__}, not tensor or bytes storage metadata"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return f"storage_data is a {type(storage).__name__}, not a dict"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex):
            return f"a storage key is a {type(index).__name__}, not a MetadataIndex"
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(relative, str) or not _inside(relative):
            return f"{index.fqn}: data file {relative!r} is not a file name inside the checkpoint directory"
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            return f"{index.fqn}: byte range offset={offset!r} length={length!r} is not two non-negative ints"
    return None


def _inside(relative: str) -> bool:
    """A relative path with no ``..`` part, in either path flavour: it cannot leave the directory."""
    for flavour in (PurePosixPath(relative), PureWindowsPath(relative)):
        if flavour.is_absolute() or flavour.anchor or ".." in flavour.parts:
            return False
    return relative not in ("", ".")


class RefusedMetadata:
    """What ``SafeFileSystemReader.read_metadata`` hands ``dcp.load`` for a ``.metadata`` it refused: any
    use of it raises that refusal.

    [Note: refusal inside dcp.load]
    ``dcp.load`` calls ``read_metadata`` inside ``except Exception`` and falls back to per-rank metadata:
    torch 2.11 then reports only ``AssertionError: metadata is None`` and 2.13 logs the refusal as a
    warning with a traceback. Handed this object instead, the load goes on to its first use of the
    metadata (the planner's or reader's set-up, before any tensor is read) and fails there with
    fsdp2lite's own message, naming the refused global and the path, on every torch version.
    """

    def __init__(self, refusal: CheckpointError) -> None:
        self._refusal = refusal

    def __getattr__(self, name: str) -> Any:
        raise self._refusal


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` (what ``dcp.load`` calls) is ``load_metadata``; given
    ``metadata`` (already read that way), it hands that back instead of reading the file again."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._read = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._read
        if metadata is None:
            metadata_path = getattr(self, "_get_metadata_path", None)  # newer torch: per-rank metadata files
            path = metadata_path(kwargs.get("rank")) if metadata_path else Path(self.path) / ".metadata"
            try:
                with self.fs.create_stream(path, "rb") as stream:
                    metadata = load_metadata(Path(self.path), stream)
            except CheckpointError as refusal:
                return RefusedMetadata(refusal)  # type: ignore[return-value]  # [Note: refusal inside dcp.load]
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None and hasattr(storage_meta, "load_id"):
            storage_meta.load_id = self.load_id  # as torch's reader does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values must decode with ``torch.load(weights_only=True)``
    before torch's own load of them runs ([Note: safe metadata])."""

    def __init__(self, checkpoint: str | Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = str(checkpoint)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raw = value.getvalue()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"{self.checkpoint}: the value {read_item.dest_index.fqn!r} is not plain data "
                f"(torch.load(weights_only=True) refuses it: {text[:200]}); nothing was loaded"
            ) from None
        super().load_bytes(read_item, io.BytesIO(raw))
