"""The optional libraries each job kind needs, and the one error that names the extra to install.

``require_libraries(kind)`` is the check: ``examples/train.py --finetune`` and the fine-tuning functions call it
before they import peft or torchao, and ``fsdp2lite doctor`` calls it for its verdict per job kind."""

from __future__ import annotations

import importlib
from typing import Any

# fsdp2lite is installed from a clone (it is not on the package index): `pip install "fsdp2lite[finetune]"`
# would look for it there and fail
INSTALL_HINT = 'pip install -e ".[finetune]"'

# what each job kind imports beyond torch: peft's LoRA for lora and qlora, torchao's NF4 for qlora; training
# every weight (examples/train.py --finetune full) and CPU offload need nothing more
NEEDED: dict[str, tuple[str, ...]] = {
    "train": (),
    "lora": ("peft",),
    "qlora": ("peft", "torchao"),
    "offload": (),
}
# pyproject.toml's extras whose libraries doctor lists (tests/test_cli.py checks them against the file):
# finetune: the libraries above, TRL's trainers and bitsandbytes' 4-bit bases (scripts run under
# fsdp2lite.run); hf: Hugging Face models and the transformers / Accelerate integrations
EXTRAS: dict[str, tuple[str, ...]] = {
    "finetune": ("peft", "torchao", "trl", "bitsandbytes"),
    "hf": ("transformers", "accelerate"),
}


class MissingExtraError(ImportError):
    """A job kind whose libraries are not importable; the message names them and the extra.
    ``missing``: not installed; ``broken``: installed, but importing failed (name -> the error)."""

    def __init__(self, kind: str, missing: list[str], broken: dict[str, str]) -> None:
        self.kind, self.missing, self.broken = kind, tuple(missing), dict(broken)
        needs = [f"{' and '.join(self.missing)}, not installed"] if self.missing else []
        needs += [f"{name}, installed but failing to import ({error})" for name, error in self.broken.items()]
        super().__init__(f"--finetune {kind} needs {'; '.join(needs)}: {INSTALL_HINT}")

    def reasons(self) -> list[str]:
        """What is wrong, one phrase per problem: ``peft and torchao not installed``, ``peft installed but
        failing to import (...)``."""
        reasons = [f"{' and '.join(self.missing)} not installed"] if self.missing else []
        reasons += [f"{name} installed but failing to import ({error})" for name, error in self.broken.items()]
        return reasons


def require_libraries(kind: str) -> dict[str, Any]:
    """Import what job ``kind`` (train, lora, qlora or offload) needs beyond torch; {name: module}. Raises
    MissingExtraError naming every library that is missing or fails to import, with the extra to install;
    ValueError for an unknown kind."""
    if kind not in NEEDED:
        raise ValueError(f"job kind {kind!r}: expected one of {', '.join(NEEDED)}")
    modules: dict[str, Any] = {}
    missing: list[str] = []
    broken: dict[str, str] = {}
    for name in NEEDED[kind]:
        try:
            modules[name] = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the library is there; something it imports is not
                broken[name] = f"{type(exc).__name__}: {exc}"
            else:
                missing.append(name)
        except Exception as exc:  # noqa: BLE001  (any failure to import is the answer, said with its error)
            broken[name] = f"{type(exc).__name__}: {exc}"
    if missing or broken:
        raise MissingExtraError(kind, missing, broken)
    return modules
