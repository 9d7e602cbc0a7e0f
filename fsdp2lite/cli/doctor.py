"""``fsdp2lite doctor``: what this environment has: versions, devices and backends, host memory for CPU
offload (RAM, the locked-memory limit; ``--nvme-path DIR``: whether optimizer state can live there), which
integrations can be imported, what ``fl.patch()`` would rebind here, the fine-tuning extras' versions, and
last one verdict line per job kind (train, lora, qlora, offload), from the check the jobs themselves make
(``finetune.require_libraries``). Other packages' import-time warnings stay out of it ([Note: quiet commands]).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shutil
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import __version__
from .._units import human_bytes
from ..finetune.deps import EXTRAS, INSTALL_HINT, NEEDED, MissingExtraError, require_libraries

DESCRIPTION = (
    "Print versions (Python, torch, fsdp2lite and the libraries it works with), devices and process-group "
    "backends, host memory for CPU offload (and, with --nvme-path, whether optimizer state can live there), "
    "which integrations are importable, what fsdp2lite.patch() would rebind in this process, the fine-tuning "
    "extras, and a verdict per job kind (train, lora, qlora, offload): ready, or what to install."
)
PACKAGES = ("torch", "pydantic", "pytorch-lightning", "lightning", "safetensors", "torchtitan", "torchtune")
# what each extra's library is for (deps.EXTRAS names them, as pyproject.toml's extras do)
USES = {
    "peft": "--finetune lora|qlora: the LoRA adapters",
    "torchao": "--finetune qlora: the NF4 base",
    "trl": "TRL trainers (SFTTrainer) run under fsdp2lite.run",
    "bitsandbytes": "4-bit bases of transformers / TRL scripts",
    "transformers": "Hugging Face models (--weights, presets), the native FSDP2 integration",
    "accelerate": "Trainer / Accelerate scripts (fsdp2lite.integrations.accelerate)",
}
NOT_INSTALLED = "not installed"
INTEGRATIONS = (
    ("transformers native FSDP2", "transformers.distributed.fsdp", "fl.patch() before importing model classes"),
    ("Accelerate FSDP2", "accelerate.utils.fsdp_utils", "fsdp2lite.integrations.accelerate.install()"),
    ("Lightning ModelParallelStrategy", "pytorch_lightning.strategies", "fl.fully_shard in configure_model"),
    ("torchao (NF4/float8 weights)", "torchao", "fully_shard as usual: all-gather hooks are honoured"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import-tools", action="store_true", help="import the tools first, so the patch plan covers them"
    )
    parser.add_argument(
        "--nvme-path", metavar="DIR", help="check DIR for optimizer state on NVMe (offload: {optimizer: nvme}): "
        "that it is a writable directory, its free space and its filesystem; exit 1 when it cannot serve",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    console = Console()
    console.print(_versions())
    console.print(_devices())
    host, usable = _host(args.nvme_path)
    console.print(host)
    console.print(_integrations(args.import_tools))
    console.print(_patch_plan())  # before the verdicts import peft and torchao, which would change the plan
    console.print(_extras())
    for line in verdicts(None if usable else args.nvme_path):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    return 0 if usable else 1


def _version(package: str) -> str:
    if package == "torch":
        import torch

        return str(torch.__version__)  # the build's own: "2.11.0+cu130" where pip's metadata says "2.11.0"
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _versions() -> Table:
    table = Table(title=f"fsdp2lite {__version__}")
    table.add_column("package")
    table.add_column("version")
    table.add_row("python", f"{platform.python_version()} ({sys.executable})")
    for package in PACKAGES:
        table.add_row(package, _version(package))
    return table


def _devices() -> Table:
    import torch
    import torch.distributed as dist

    table = Table(title="devices and backends")
    table.add_column("what")
    table.add_column("here")
    table.add_row("CUDA", f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "not available")
    table.add_row("distributed", "available" if dist.is_available() else "not available")
    for backend, check in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"), ("mpi", "is_mpi_available")):
        available = dist.is_available() and getattr(dist, check, lambda: False)()
        table.add_row(f"backend {backend}", "yes" if available else "no")
    return table


def _host(nvme_path: str | None) -> tuple[Table, bool]:
    """Host RAM, the locked-memory limit (pinning can fail under it: [Note: pinning fails]) and, with
    ``nvme_path``, that directory's fitness for optimizer state; and whether that directory can serve."""
    table = Table(title="host memory and NVMe (CPU offload)")
    table.add_column("what")
    table.add_column("here")
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    table.add_row("host RAM", human_bytes(pages * page) if pages > 0 and page > 0 else "unknown")
    table.add_row("locked-memory limit (ulimit -l)", _memlock())
    if nvme_path is None:
        return table, True
    from ..host.nvme import nvme_path_problem

    problem = nvme_path_problem(nvme_path)
    if problem is not None:
        table.add_row("nvme_path", f"[red]--nvme-path: {problem[0]}; {problem[1]}[/red]")
        return table, False
    table.add_row("nvme_path", f"{os.path.abspath(nvme_path)}: a writable directory")
    table.add_row("free there", human_bytes(shutil.disk_usage(nvme_path).free))
    table.add_row("filesystem", _filesystem(nvme_path))
    return table, True


def _memlock() -> str:
    try:
        import resource
    except ImportError:  # not a Unix
        return "unknown"
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else human_bytes(soft)


def _filesystem(path: str) -> str:
    """The filesystem type of ``path``'s mount (Linux ``/proc/mounts``); tmpfs is RAM, not a disk."""
    target, best = os.path.realpath(path), ("", "unknown")
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and (target + "/").startswith(fields[1].rstrip("/") + "/"):
                    best = max(best, (fields[1], fields[2]), key=lambda m: len(m[0]))
    except OSError:
        return "unknown"
    kind = best[1]
    return f"{kind} (RAM, not a disk: the state would take host memory)" if kind in ("tmpfs", "ramfs") else kind


def _integrations(import_tools: bool) -> Table:
    table = Table(title="integrations")
    for column in ("integration", "module", "importable", "how"):
        table.add_column(column)
    for name, module, how in INTEGRATIONS:
        table.add_row(name, module, _importable(module, import_tools), how)
    return table


def _importable(module: str, import_tools: bool) -> str:
    """Whether ``module`` imports (``--import-tools``, or its tool is loaded already), else whether its
    package is installed: importing every tool would take seconds and change what the patch plan shows."""
    import importlib.util

    try:
        if import_tools or module.split(".")[0] in sys.modules:
            importlib.import_module(module)
            return "yes"
        return "installed" if importlib.util.find_spec(module.split(".")[0]) is not None else "no (not installed)"
    except Exception as exc:  # noqa: BLE001  (any failure to import is the answer)
        return f"no ({type(exc).__name__}: {exc})"


def _patch_plan() -> Table:
    from ..integrations.patch import is_patched, planned

    table = Table(title="fsdp2lite.patch() would rebind" + (" (already patched)" if is_patched() else ""))
    table.add_column("module.name")
    for entry in planned():
        table.add_row(entry)
    return table


def _extras() -> Table:
    """The libraries of the extras fine-tuning and Hugging Face jobs use, with their versions."""
    table = Table(title=escape(f'extras, from a clone: {INSTALL_HINT} (or ".[hf]")'))
    for column in ("extra", "package", "version", "for"):
        table.add_column(column)
    for extra, packages in EXTRAS.items():
        for package in packages:
            table.add_row(extra, package, _version(package), USES[package])
    return table


def verdicts(unusable_nvme_path: str | None = None) -> list[str]:
    """One line per job kind: ``ready (the libraries it uses, with versions)`` or ``not ready: why; what to
    install``, from ``require_libraries``, the check the job makes when it starts. ``unusable_nvme_path``: a
    ``--nvme-path`` that cannot hold optimizer state (offload's line says so)."""
    import torch.distributed as dist

    lines = []
    for kind, needed in NEEDED.items():
        if not dist.is_available():
            lines.append(f"{kind}: not ready: torch {_version('torch')} was built without torch.distributed")
            continue
        try:
            require_libraries(kind)
        except MissingExtraError as exc:
            lines.append(f"{kind}: not ready: {'; '.join(exc.reasons())}; {INSTALL_HINT}")
            continue
        used = ", ".join(f"{name} {_version(name)}" for name in needed or ("torch",))  # what the kind adds
        lines.append(f"{kind}: ready ({used}{_offload_note(kind, unusable_nvme_path)})")
    return lines


def _offload_note(kind: str, unusable_nvme_path: str | None) -> str:
    """What offload's line adds: pinning needs CUDA; the --nvme-path that cannot serve."""
    import torch

    if kind != "offload":
        return ""
    note = "" if torch.cuda.is_available() else "; no CUDA here: offload with pin_memory: false"
    if unusable_nvme_path is not None:
        note += f"; not optimizer: nvme at {unusable_nvme_path} (see nvme_path above)"
    return note
