"""The one error class of checkpoint reading and writing."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, is damaged, or is unsafe to read; the message names the
    checkpoint and every offending key (or the refused pickle global)."""
