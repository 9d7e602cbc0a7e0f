"""Accelerate's FSDP2 preparation, sharding with fsdp2lite.

    from fsdp2lite.integrations import accelerate as fl_accelerate
    fl_accelerate.install()                       # Accelerate's own plan, fsdp2lite's fully_shard
    fl_accelerate.install("configs/hf_causal_lm.yaml")   # or: a policy file's rules decide the groups
    accelerator = Accelerator(...)                # FSDP with fsdp_version=2, as usual
    model, optimizer = accelerator.prepare(model, optimizer)

``install()`` runs ``fl.patch()``: Accelerate imports torch's FSDP2 names inside its functions
(``fsdp2_prepare_model``), so they resolve to fsdp2lite's from then on. Its own preparation then runs
unchanged: its wrap policy (``transformer_cls_names_to_wrap``, ``_no_split_modules`` or a size) picks the
modules, each gets fsdp2lite's ``fully_shard``, then the final norm and head as one group, then the
root, with the plugin's mixed precision, offload and ``reshard_after_forward``. ``install(config)``
replaces that choice: ``apply_config(model, config, mesh)`` shards by the config's rules (the mesh is
Accelerate's when it has one), so ``fsdp2lite explain`` shows exactly what Accelerate will run.
``uninstall()`` puts Accelerate's function and torch's names back.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..config import FSDPConfig, apply_config
from .patch import PatchReport, patch, unpatch

_MODULES = ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator")  # where it is bound
_lock = threading.Lock()
_original: Any = None  # Accelerate's fsdp2_prepare_model, while ours is installed


def install(config: FSDPConfig | str | Path | None = None) -> PatchReport:
    """Make Accelerate's FSDP2 preparation shard with fsdp2lite (see the module docstring); returns what
    ``fl.patch()`` rebound. Raises ImportError when Accelerate is not installed."""
    global _original
    resolved = _resolve_config(config)
    modules = _accelerate_modules()
    with _lock:
        report = patch()
        if _original is None:
            _original = modules[0].fsdp2_prepare_model
        prepare = _original if resolved is None else functools.partial(prepare_with_config, resolved)
        for module in modules:
            module.fsdp2_prepare_model = prepare
    return report


def uninstall() -> None:
    """Accelerate's own ``fsdp2_prepare_model`` and torch's FSDP2 names back."""
    global _original
    with _lock:
        if _original is not None:
            for module in _accelerate_modules():
                module.fsdp2_prepare_model = _original
            _original = None
        unpatch()


def prepare_with_config(config: FSDPConfig, accelerator: Any, model: nn.Module) -> nn.Module:
    """Accelerate's ``fsdp2_prepare_model`` contract, with the groups a policy file's rules give."""
    from ..module import FSDPModule

    if isinstance(model, FSDPModule) or isinstance(getattr(model, "_orig_mod", None), FSDPModule):
        return model  # already sharded (Accelerate adopts such a model as is)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    return apply_config(model, config, mesh)


def _resolve_config(config: Any) -> FSDPConfig | None:
    if config is None or isinstance(config, FSDPConfig):
        return config
    if isinstance(config, str | Path):
        return FSDPConfig.from_yaml(config)  # ConfigError listing every problem
    raise TypeError(
        f"install(config=...) takes None, an FSDPConfig or the path of a policy file, got {type(config).__name__}"
    )


def _accelerate_modules() -> list[Any]:
    import importlib

    try:
        return [importlib.import_module(name) for name in _MODULES]
    except ImportError as exc:
        raise ImportError(
            f"fsdp2lite.integrations.accelerate needs Accelerate ({exc}); install it with "
            'pip install -e ".[hf]" from a clone of fsdp2lite (or pip install accelerate)'
        ) from None
