"""``fl.patch()`` / ``fl.unpatch()``: torch's public FSDP2 names rebound to fsdp2lite's, wherever tools
hold them, so code written for torch's ``fully_shard`` (Accelerate, transformers, Lightning, TRL,
torchtitan, torchtune) shards with fsdp2lite unchanged.

    with fl.patch() as report:        # or fl.patch() ... fl.unpatch()
        print(report)                 # every (module, name) rebound
        model = AutoModelForCausalLM.from_pretrained(..., distributed_config=...)

A name is rebound where it is *torch's own object*: in torch's homes (``torch.distributed.fsdp``, its
``_fully_shard`` package, ``torch.distributed._composable.fsdp`` and its ``fully_shard`` module) and in
every already-imported module of a known tool that bound it at import time (``from
torch.distributed.fsdp import fully_shard`` copies the function into that module). Modules imported
after ``patch()`` read the rebound homes. ``unpatch()`` puts back exactly what was rebound, in reverse.
Patching is process-wide by nature: one record, guarded by a lock, so launchers may call it from any
thread, any number of times (each call also catches modules imported since the last).
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..api import fully_shard
from ..forward_pass import register_fsdp_forward_method
from ..module import FSDPModule, UnshardHandle, share_comm_ctx
from ..policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

NAMES = (
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "register_fsdp_forward_method",
    "share_comm_ctx",
)
TORCH_HOMES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
TOOLS = ("transformers", "accelerate", "trl", "torchtitan", "torchtune", "lightning", "pytorch_lightning",
         "lightning_fabric", "peft")  # fmt: skip


@dataclass
class PatchReport:
    """What ``patch()`` rebound (``module.name`` each); a context manager that unpatches on exit."""

    rebound: list[str] = field(default_factory=list)  # by this call
    total: int = 0  # rebound in all, since the first patch()

    def __enter__(self) -> PatchReport:
        return self

    def __exit__(self, *exc: object) -> None:
        unpatch()

    def __str__(self) -> str:
        lines = [f"fsdp2lite.patch(): {len(self.rebound)} name(s) rebound by this call, {self.total} in all"]
        lines += [f"  {entry}" for entry in self.rebound]
        return "\n".join(lines)


class _Patcher:
    """The one record of what is rebound ([module docstring]: patching is process-wide)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.originals: dict[str, Any] = {}  # name -> torch's object, captured at the first patch()
        self.done: list[tuple[ModuleType, str, Any]] = []  # (module, name, torch's object), in order

    def replacements(self) -> dict[str, Any]:
        return {
            "fully_shard": fully_shard,
            "FSDPModule": FSDPModule,
            "UnshardHandle": UnshardHandle,
            "MixedPrecisionPolicy": MixedPrecisionPolicy,
            "OffloadPolicy": OffloadPolicy,
            "CPUOffloadPolicy": CPUOffloadPolicy,
            "register_fsdp_forward_method": register_fsdp_forward_method,
            "share_comm_ctx": share_comm_ctx,
        }

    def capture_originals(self) -> None:
        if self.originals:
            return
        torch_fsdp = importlib.import_module("torch.distributed.fsdp")
        self.originals = {name: getattr(torch_fsdp, name) for name in NAMES if hasattr(torch_fsdp, name)}

    def targets(self) -> Iterator[tuple[ModuleType, str]]:
        """(module, name) pairs that hold torch's object now."""
        for package in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):  # and their submodules
            importlib.import_module(package)
        for module_name, module in list(sys.modules.items()):
            if not isinstance(module, ModuleType) or not _in_scope(module_name):
                continue
            namespace = vars(module)
            for name, original in self.originals.items():
                if namespace.get(name) is original:
                    yield module, name


def _in_scope(module_name: str) -> bool:
    return module_name in TORCH_HOMES or module_name.split(".", 1)[0] in TOOLS


_PATCHER = _Patcher()


def patch() -> PatchReport:
    """Rebind torch's FSDP2 names to fsdp2lite's wherever they are held (see the module docstring);
    idempotent. Returns what this call rebound; usable as a context manager (unpatches on exit)."""
    with _PATCHER.lock:
        _PATCHER.capture_originals()
        replacements = _PATCHER.replacements()
        report = PatchReport()
        for module, name in list(_PATCHER.targets()):
            setattr(module, name, replacements[name])
            _PATCHER.done.append((module, name, _PATCHER.originals[name]))
            report.rebound.append(f"{module.__name__}.{name}")
        report.total = len(_PATCHER.done)
        return report


def unpatch() -> list[str]:
    """Put torch's objects back where ``patch()`` rebound them (in reverse); returns the entries."""
    with _PATCHER.lock:
        restored = []
        while _PATCHER.done:
            module, name, original = _PATCHER.done.pop()
            setattr(module, name, original)
            restored.append(f"{module.__name__}.{name}")
        return restored


def planned() -> list[str]:
    """What ``patch()`` would rebind now, without rebinding anything (``fsdp2lite doctor``)."""
    with _PATCHER.lock:
        _PATCHER.capture_originals()
        return [f"{module.__name__}.{name}" for module, name in _PATCHER.targets()]


def is_patched() -> bool:
    return bool(_PATCHER.done)
