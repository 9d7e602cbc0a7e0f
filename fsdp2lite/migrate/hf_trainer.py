"""The HF Trainer's input: a bare ``fsdp_config`` (JSON), or its TrainingArguments (JSON) with ``fsdp``,
``fsdp_config`` and ``deepspeed``.

    {"fsdp": "full_shard auto_wrap offload", "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
     "bf16": true, "learning_rate": 2e-5}
    {"deepspeed": "ds_zero3_nvme.json", "bf16": true}

``fsdp`` is the ``--fsdp`` words (a string, a list of words, or true for ``full_shard``): ``offload`` is
FSDP's parameter offload (full host offload, ``accelerate._offload``). ``fsdp_config`` (a mapping or its JSON
file) is walked as the bare form is, its keys as they are named inside it. ``deepspeed`` (a DeepSpeed config,
a mapping or its JSON file; the Trainer refuses it beside ``fsdp``) is walked with the DeepSpeed table, its
keys under ``deepspeed.``, so its offload sections map as ``--from deepspeed`` maps them; an ``fsdp_config``
beside it is dropped (the Trainer reads it only with ``fsdp``). ``bf16`` / ``fp16`` map to mixed precision (they
also fill a DeepSpeed config's ``"auto"``); every other TrainingArguments field is a training-loop setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from .accelerate import HF_TRAINER
from .accelerate_deepspeed import nested_config
from .common import DTYPES, KeyReport, Migration, MigrationError, Rule, set_key
from .deepspeed import deepspeed_table
from .deepspeed_offload import OffloadKeys, deepspeed_keys

TRAINER_KEYS = ("fsdp", "fsdp_config", "deepspeed")  # TrainingArguments' sharding fields
HF_TRAINER_DEEPSPEED: dict[str, Rule] = deepspeed_table("deepspeed.")
_CHECKPOINTING = (
    "the model's own checkpointing (the Trainer calls model.gradient_checkpointing_enable()): keep it, or use "
    "activation_checkpointing: true on the wrap rules"
)


class TrainerInput(NamedTuple):
    """What ``migrate`` walks for an HF Trainer input, and what it reports after the walk."""

    data: dict[str, Any]  # the keys the table maps
    table: dict[str, Rule]
    offload_keys: OffloadKeys | None  # where a DeepSpeed config's offload sections are (None: FSDP)
    fsdp_option: str | None  # the --fsdp words, from the command line or TrainingArguments' fsdp
    fsdp_label: str  # "--fsdp" or "fsdp", the report's name for them
    args: dict[str, Any]  # the other TrainingArguments fields (trainer_rows)
    notes: list[str]


def prepare_trainer(path: str | Path, data: dict[str, Any], fsdp_option: str | None) -> TrainerInput:
    """The walk for a bare ``fsdp_config`` (as it is) or for TrainingArguments (see the module docstring)."""
    if not any(key in data for key in TRAINER_KEYS):
        return TrainerInput(data, HF_TRAINER, None, fsdp_option, "--fsdp", {}, [])
    args = {key: value for key, value in data.items() if key not in TRAINER_KEYS}
    words = _words(path, data.get("fsdp"))
    if words and fsdp_option and words.split() != fsdp_option.split():
        raise MigrationError(
            f"{path}: fsdp {words!r} and --fsdp {fsdp_option!r} disagree: give the words once (or the same)"
        )
    option, label = (words, "fsdp") if words else (fsdp_option, "--fsdp")
    deepspeed = data.get("deepspeed")
    if deepspeed in (None, "", False):
        fsdp_config, where = nested_config(path, "fsdp_config", data.get("fsdp_config") or {}, required=None)
        notes = [] if where == "inline" else [f"fsdp_config: read {where}"]
        return TrainerInput(fsdp_config, HF_TRAINER, None, option, label, args, notes)
    if option:
        raise MigrationError(
            f"{path}: deepspeed and fsdp {option!r} are both given: the Trainer runs FSDP or DeepSpeed, not both"
        )
    config, where = nested_config(path, "deepspeed", deepspeed)
    if "fsdp_config" in data:
        args["fsdp_config"] = data["fsdp_config"]
    notes = [] if where == "inline" else [f"deepspeed: read {where} (its keys are under deepspeed.)"]
    return TrainerInput(
        {"deepspeed": config}, HF_TRAINER_DEEPSPEED, deepspeed_keys("deepspeed."), None, "", args, notes
    )


def _words(path: str | Path, value: Any) -> str:
    """TrainingArguments' ``fsdp``: a string of words, a list of them, or a bool (true: ``full_shard``)."""
    if value in (None, False, ""):
        return ""
    if value is True:
        return "full_shard"
    if isinstance(value, list) and all(isinstance(word, str) for word in value):
        return " ".join(value)
    if isinstance(value, str):
        return value
    raise MigrationError(f'{path}: fsdp {value!r}: expected words such as "full_shard auto_wrap offload"')


def trainer_rows(m: Migration, args: dict[str, Any], deepspeed: bool) -> list[KeyReport]:
    """A row for each TrainingArguments field beside the sharding ones: ``bf16`` / ``fp16`` map to mixed
    precision; the others are training-loop settings."""
    rows = []
    for key in sorted(args):
        value = args[key]
        shown = value if isinstance(value, str) else json.dumps(value)
        if key in ("bf16", "fp16"):
            rows.append(KeyReport(key, shown, "mapped", _trainer_dtype(m, key, value)))
        elif key == "fsdp_config" and deepspeed:
            why = "the Trainer reads fsdp_config only with fsdp, and this is a DeepSpeed run"
            rows.append(KeyReport(key, shown, "dropped", why))
        elif key == "gradient_checkpointing":
            rows.append(KeyReport(key, shown, "dropped", _CHECKPOINTING))
        else:
            rows.append(
                KeyReport(key, shown, "dropped", "a TrainingArguments setting of the training loop, not sharding")
            )
    return rows


def _trainer_dtype(m: Migration, key: str, value: Any) -> str:
    if not isinstance(value, bool):
        raise MigrationError(f"{m.path}: {key} {value!r}: expected true or false")
    if not value:
        return "nothing (off)"
    dtype = DTYPES[key]
    set_key(m, "mixed_precision.param_dtype", dtype, key)
    if "reduce_dtype" not in m.data["mixed_precision"]:  # a DeepSpeed communication_data_type stays
        set_key(m, "mixed_precision.reduce_dtype", "fp32", key)
    return f"mixed_precision: param_dtype {dtype}, reduce_dtype {m.data['mixed_precision']['reduce_dtype']}"
