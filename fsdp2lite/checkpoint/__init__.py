"""Checkpoints: DCP save/load with up-front checks (``dcp``), and a DCP directory as one file with no
process group (``consolidate``). ``CheckpointError`` is the one error class of both."""

from __future__ import annotations

from .dcp import CheckpointError, load_checkpoint, read_metadata, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "read_metadata", "save_checkpoint"]
