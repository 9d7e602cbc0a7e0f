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
Either way, bitsandbytes 4-bit weights are made shardable first (``make_4bit_shardable``: Accelerate
would leave uint8-storage ones out of sharding, replicated on every rank), so a QLoRA base is sharded in
either storage. ``uninstall()`` puts Accelerate's function and torch's names back.

``enable_fsdp_on_cpu(accelerator, plugin)`` puts an Accelerator on CPU ranks into FSDP mode, for a
rehearsal of a GPU job on gloo ([Note: FSDP on CPU ranks]); with torch's ``fully_shard`` as with ours.

[Note: FSDP on CPU ranks]
Accelerate enables FSDP on accelerators only: on CPU ranks it drops the plugin and the Trainer wraps the
model in DDP. Its distributed type lives in two shared records, ``AcceleratorState``'s and
``PartialState``'s, and every ``AcceleratorState()`` made later copies ``PartialState``'s over its own
(``AcceleratorOptimizer`` makes one in ``prepare``). Setting the first alone is therefore undone by
``prepare``: ``is_fsdp2`` turns false, ``get_state_dict`` hands out the sharded DTensors, and peft's
``save_pretrained`` fails on them ("Attempted to access the data pointer on an invalid python
storage"), so ``trainer.save_model`` writes no adapter. ``enable_fsdp_on_cpu`` sets both, as Accelerate
does when it enables FSDP itself, and gives the plugin the Accelerator's mixed precision as Accelerate
would (``set_mixed_precision``).

[Note: 4-bit models in Accelerate's preparation]
``fsdp2_prepare_model`` treats a model holding ``Params4bit`` weights apart: it leaves uint8-storage ones
out of sharding (torch's ``fully_shard`` cannot shard them), it does not upcast trainable parameters to
fp32 under mixed precision (TRL makes QLoRA adapters bf16 on purpose), and it skips
``cpu_ram_efficient_loading``. Once ``make_4bit_shardable`` has made them ``Bnb4bitWeight``s it no longer
recognises the model, so the first rule is gone (fsdp2lite shards them) and the other two are kept: the
preparation reads the accelerator's mixed precision as "no" (read only by that check) and the plugin's
``cpu_ram_efficient_loading`` as off, for the call.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
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
        prepare = functools.partial(prepare_4bit_too, prepare)
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


def prepare_4bit_too(prepare: Callable[[Any, nn.Module], nn.Module], accelerator: Any, model: nn.Module) -> nn.Module:
    """``prepare`` (Accelerate's ``fsdp2_prepare_model`` contract), with the model's bitsandbytes 4-bit
    weights made shardable first and Accelerate's rules for 4-bit models kept ([Note: 4-bit models in
    Accelerate's preparation])."""
    from ..module import FSDPModule

    made: list[str] = []
    if "bitsandbytes" in sys.modules and not isinstance(model, FSDPModule):  # a 4-bit model has imported it
        from .bitsandbytes import make_4bit_shardable

        made = make_4bit_shardable(model)
    if not made:
        return prepare(accelerator, model)
    with _without_cpu_ram_efficient_loading(accelerator.state.fsdp_plugin):
        return prepare(_AsFor4bitModels(accelerator), model)


class _AsFor4bitModels:
    """``accelerator`` as Accelerate's preparation reads it, but for its check of mixed precision before
    the fp32 upcast of trainable parameters, which it skips for 4-bit models ([Note: 4-bit models in
    Accelerate's preparation])."""

    mixed_precision = "no"

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


@contextlib.contextmanager
def _without_cpu_ram_efficient_loading(plugin: Any) -> Iterator[None]:
    """The plugin's ``cpu_ram_efficient_loading`` off for the call, then put back: Accelerate skips it for
    4-bit models ([Note: 4-bit models in Accelerate's preparation])."""
    if not plugin.cpu_ram_efficient_loading:
        yield
        return
    plugin.cpu_ram_efficient_loading = False
    try:
        yield
    finally:
        plugin.cpu_ram_efficient_loading = True


def enable_fsdp_on_cpu(accelerator: Any, fsdp_plugin: Any) -> None:
    """Put ``accelerator`` (built on CPU ranks, where Accelerate drops FSDP) into FSDP mode with
    ``fsdp_plugin`` (a ``FullyShardedDataParallelPlugin`` or a dict of its arguments, such as a Trainer's
    ``args.fsdp_plugin_args``), as Accelerate does on accelerators ([Note: FSDP on CPU ranks])."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if isinstance(fsdp_plugin, dict):
        fsdp_plugin = FullyShardedDataParallelPlugin(**fsdp_plugin)
    if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            "enable_fsdp_on_cpu(accelerator, fsdp_plugin): fsdp_plugin must be a FullyShardedDataParallelPlugin "
            f"or a dict of its arguments, got {type(fsdp_plugin).__name__}"
        )
    state = accelerator.state
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # what AcceleratorState() copies


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
