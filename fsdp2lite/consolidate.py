"""``fsdp2lite.consolidate``, the module path of earlier releases: the same module object as
``fsdp2lite.checkpoint.consolidate``, where the code now lives."""

from __future__ import annotations

import sys

from .checkpoint import consolidate as _moved

sys.modules[__name__] = _moved
