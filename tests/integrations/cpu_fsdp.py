"""What the Trainer scripts here share: FSDP on CPU ranks (their one test-only part), and what a model became.

Accelerate runs FSDP on accelerators only (on CPU it drops the plugin and the Trainer wraps the model in
DDP), so a Trainer whose arguments ask for FSDP is put into FSDP mode after its Accelerator is built, by
``fsdp2lite.integrations.accelerate.enable_fsdp_on_cpu`` ([Note: FSDP on CPU ranks] there). It only sets
Accelerate's state: the script still shards with torch's ``fully_shard`` when run plainly, and with
fsdp2lite's under ``python -m fsdp2lite.run``.
"""

from __future__ import annotations

from typing import Any

from fsdp2lite.integrations.accelerate import enable_fsdp_on_cpu


class CpuFsdpMixin:
    """Mixed into a Trainer class (``class T(CpuFsdpMixin, SFTTrainer)``): FSDP as its arguments ask.
    ``fsdp_enabled_on_cpu`` says whether it did so (Accelerate had dropped FSDP, as on CPU it does)."""

    fsdp_enabled_on_cpu: bool = False

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        args = self.args  # type: ignore[attr-defined]
        if args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:  # type: ignore[has-type]
            enable_fsdp_on_cpu(self.accelerator, args.fsdp_plugin_args)  # type: ignore[attr-defined]
            self.is_fsdp_enabled = True
            self.fsdp_enabled_on_cpu = True


def implementation(model: Any) -> dict[str, Any]:
    """What the model became: its classes' modules (fsdp2lite's or torch's FSDPModule among them)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_home  # torch's class, even when patched

    return {
        "mro_modules": sorted({cls.__module__ for cls in type(model).__mro__}),
        "torch_fsdp_module": isinstance(model, torch_home.FSDPModule),
        "groups": sum(1 for m in model.modules() if isinstance(m, torch_home.FSDPModule)),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
