"""The optional libraries fine-tuning needs, and the one error that names the extra to install."""

from __future__ import annotations

import importlib
from typing import Any

INSTALL_HINT = 'pip install "fsdp2lite[finetune]"'

# what each mode imports: peft's LoRA for both, torchao's NF4 for qlora
_NEEDED = {
    "lora": ("peft",),
    "qlora": ("peft", "torchao"),
}


class MissingExtraError(ImportError):
    """A fine-tuning mode whose libraries are not installed; the message names them and the extra."""


def require_libraries(mode: str) -> dict[str, Any]:
    """Import what ``mode`` ('lora' or 'qlora') needs; {name: module}. Raises MissingExtraError naming
    every missing library and ``pip install "fsdp2lite[finetune]"``; ValueError for an unknown mode."""
    if mode not in _NEEDED:
        raise ValueError(f"fine-tuning mode {mode!r}: expected one of {', '.join(_NEEDED)}")
    modules, missing = {}, []
    for name in _NEEDED[mode]:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingExtraError(f"--finetune {mode} needs {' and '.join(missing)}, not installed: {INSTALL_HINT}")
    return modules
