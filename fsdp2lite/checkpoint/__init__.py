"""Checkpoints: DCP save/load with up-front checks (``dcp``), and a DCP directory as one file with no
process group (``consolidate``); every read runs no code from the checkpoint (``safe``: [Note: safe
metadata]). ``CheckpointError`` is the one error class of all three."""

from __future__ import annotations

from .dcp import load_checkpoint, read_metadata, save_checkpoint
from .errors import CheckpointError
from .safe import ALLOWED_GLOBALS, SafeFileSystemReader, SafeLoadPlanner, SafeUnpickler, load_metadata

__all__ = [
    "ALLOWED_GLOBALS",
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SafeUnpickler",
    "load_checkpoint",
    "load_metadata",
    "read_metadata",
    "save_checkpoint",
]
