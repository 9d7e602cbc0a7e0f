"""The only part of fsdp2lite that touches other tools: torch's FSDP2 names rebound to ours (``patch``),
and one module per tool that needs more than that (``accelerate``, ``bitsandbytes``)."""

from __future__ import annotations

from .patch import PatchReport, patch, unpatch

__all__ = ["PatchReport", "patch", "unpatch"]
