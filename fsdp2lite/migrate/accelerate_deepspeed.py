"""Accelerate's DeepSpeed plugin (``distributed_type: DEEPSPEED``): its ``deepspeed_config`` keys, mapped as the
DeepSpeed config they stand for.

    distributed_type: DEEPSPEED
    deepspeed_config:
      zero_stage: 3                         # zero_optimization.stage
      offload_optimizer_device: nvme        # zero_optimization.offload_optimizer.device
      offload_optimizer_nvme_path: /nvme    # zero_optimization.offload_optimizer.nvme_path
      offload_param_device: cpu             # zero_optimization.offload_param.device

The plugin builds a DeepSpeed config from these keys (no ``pin_memory``: DeepSpeed's default, false); the
offload keys go through ``deepspeed_offload`` with Accelerate's key names, so ``offload_optimizer_device: cpu``
is ZeRO-Offload, ``nvme`` the optimizer state on NVMe, and ``offload_param_device`` parameter offload (to
host RAM, also for ``nvme``). A ``deepspeed_config_file`` is read instead (Accelerate then refuses the plugin's
own stage and offload keys beside it, as here) and walked as a DeepSpeed config, its keys under
``deepspeed_config.deepspeed_config_file.``. ``nested_config`` reads such a file for the HF Trainer too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .accelerate import ACCELERATE
from .common import MigrationError, Rule
from .deepspeed import DEEPSPEED, deepspeed_table, stage_key
from .deepspeed_offload import SECTIONS, OffloadKeys, deepspeed_keys, device_key, nvme_path_key

PLUGIN = "deepspeed_config"
CONFIG_FILE = f"{PLUGIN}.deepspeed_config_file"
ACCELERATE_DEFAULT_STAGE = 2  # DeepSpeedPlugin's zero_stage when the config names none

ACCELERATE_OFFLOAD_KEYS = OffloadKeys(
    device={s: f"{PLUGIN}.offload_{s}_device" for s in SECTIONS},
    pin={s: None for s in SECTIONS},
    nvme_path={s: f"{PLUGIN}.offload_{s}_nvme_path" for s in SECTIONS},
    stage=f"{PLUGIN}.zero_stage",
    default_stage=ACCELERATE_DEFAULT_STAGE,
    deprecated={},
    deprecated_pin=None,
)
# the plugin keys Accelerate refuses beside a deepspeed_config_file (they would be ignored)
_BESIDE_FILE = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_save_16bit_model",
)


def _plugin_rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {
        f"{PLUGIN}.zero_stage": stage_key(f"{PLUGIN}.zero_stage"),
        f"{PLUGIN}.gradient_accumulation_steps": DEEPSPEED["gradient_accumulation_steps"],
        f"{PLUGIN}.gradient_clipping": DEEPSPEED["gradient_clipping"],
        f"{PLUGIN}.zero3_save_16bit_model": DEEPSPEED["zero_optimization.stage3_gather_16bit_weights_on_model_save"],
        f"{PLUGIN}.zero3_init_flag": ("dropped", "build the model on meta, to_empty, then load (zero.Init's job)"),
        f"{PLUGIN}.deepspeed_moe_layer_cls_names": (
            "unsupported",
            "ZeRO-3 leaf MoE layers: name their classes in a wrap rule by hand",
        ),
        f"{PLUGIN}.transformer_moe_cls_names": (
            "unsupported",
            "ZeRO-3 leaf MoE layers: name their classes in a wrap rule by hand",
        ),
        **{
            f"{PLUGIN}.{key}": ("dropped", "a launcher setting, not sharding")
            for key in (
                "deepspeed_multinode_launcher",
                "deepspeed_hostfile",
                "deepspeed_exclusion_filter",
                "deepspeed_inclusion_filter",
            )
        },
        "fsdp_config.*": ("dropped", "an FSDP setting, which a DeepSpeed launch does not read"),
        "fsdp_config": ("dropped", "an FSDP setting, which a DeepSpeed launch does not read"),
        **deepspeed_table(f"{CONFIG_FILE}."),
    }
    for section in SECTIONS:
        rules[f"{PLUGIN}.offload_{section}_device"] = device_key(section)
        rules[f"{PLUGIN}.offload_{section}_nvme_path"] = nvme_path_key(section)
    return rules


ACCELERATE_DEEPSPEED: dict[str, Rule] = {
    **{key: rule for key, rule in ACCELERATE.items() if not key.startswith(("fsdp_config.", f"{PLUGIN}."))},
    "distributed_type": ("dropped", "checked: DEEPSPEED, the plugin's keys are read"),
    **_plugin_rules(),
}


def prepare_plugin(path: str | Path, data: dict[str, Any]) -> tuple[dict[str, Any], OffloadKeys, list[str]]:
    """The input to walk for a DeepSpeed launch, the keys its offload settings are under, and notes: the
    ``deepspeed_config_file`` read in place of its name, else Accelerate's default stage where none is given."""
    plugin = data.get(PLUGIN)
    if not isinstance(plugin, dict):
        raise MigrationError(f"{path}: distributed_type DEEPSPEED needs a {PLUGIN}: mapping, got {plugin!r}")
    name = plugin.get("deepspeed_config_file")
    if name in (None, "", "none"):
        if "zero_stage" in plugin:
            return data, ACCELERATE_OFFLOAD_KEYS, []
        plugin = {**plugin, "zero_stage": ACCELERATE_DEFAULT_STAGE}
        note = f"{PLUGIN}.zero_stage not given: Accelerate's default, {ACCELERATE_DEFAULT_STAGE}"
        return {**data, PLUGIN: plugin}, ACCELERATE_OFFLOAD_KEYS, [note]
    beside = [key for key in _BESIDE_FILE if plugin.get(key) not in (None, "auto", "none")]
    if beside:
        raise MigrationError(
            f"{path}: {PLUGIN}.deepspeed_config_file is given, and so are {', '.join(beside)}: Accelerate refuses "
            "plugin settings beside a DeepSpeed config file; set them in the file (or to auto)"
        )
    file_config, where = nested_config(path, CONFIG_FILE, name)
    plugin = {key: value for key, value in plugin.items() if key not in _BESIDE_FILE}
    plugin["deepspeed_config_file"] = file_config
    return {**data, PLUGIN: plugin}, deepspeed_keys(f"{CONFIG_FILE}."), [f"{CONFIG_FILE}: read {where}"]


def nested_config(
    path: str | Path, key: str, value: Any, *, required: str | None = "zero_optimization"
) -> tuple[dict[str, Any], str]:
    """A config another tool's input names under ``key`` (a DeepSpeed config, or with ``required=None`` any JSON
    mapping): a mapping as it is, or a JSON file, looked for beside the input, then from the working directory.
    Returns it and where it was read."""
    what = "a DeepSpeed config" if required else "a mapping"
    if isinstance(value, dict):
        config: Any = value
        where = "inline"
    elif isinstance(value, str):
        config, where = _read_json(path, key, value)
    else:
        raise MigrationError(f"{path}: {key} {value!r}: expected {what} or its JSON file")
    if not isinstance(config, dict) or (required and required not in config):
        source = "" if where == "inline" else f" ({where})"
        raise MigrationError(f"{path}: {key}{source} is not {what}: no {required or 'mapping'} at the top level")
    return config, where


def _read_json(path: str | Path, key: str, name: str) -> tuple[Any, str]:
    """The JSON file ``name``, beside the input or else from the working directory, and where it was."""
    tried = [Path(path).parent / name, Path(name)]
    found = next((p for p in tried if p.is_file()), None)
    if found is None:
        raise MigrationError(f"{path}: {key} {name!r}: no such file (looked at {', '.join(map(str, tried))})")
    try:
        return json.loads(found.read_text(encoding="utf-8")), str(found)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MigrationError(f"{path}: {key}: {found} is not a JSON file: {exc}") from None
