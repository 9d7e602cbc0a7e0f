"""``fsdp2lite migrate``: an Accelerate, HF Trainer, DeepSpeed, torchtitan or Megatron-FSDP setup as an fsdp2lite
config.

    m = migrate("deepspeed", "ds_config.json")
    m.config            # an FSDPConfig: what apply_config applies
    m.yaml()            # the policy file, a comment on each key naming where it came from
    m.keys              # every input key: mapped (to what), dropped (why), unsupported (what is missing), unknown

Each source is a table from its keys (dotted paths into the parsed file; ``prefix.*`` for whole
sections) to a handler that writes fsdp2lite keys, or to the reason it has no equivalent. A key in no
table is ``unknown``, with the closest key the tool does have. Files are read with ``json``,
``yaml.safe_load`` and ``tomllib``.

When no key names the layer class (a DeepSpeed config, Accelerate without
``fsdp_transformer_layer_cls_to_wrap``), the config still gets one group per repeated block
(``blocks.add_default_blocks``): ``--model``'s own, else the Hugging Face decoder layers of
``configs/hf_causal_lm.yaml``; ``Migration.notes`` says which.

Two inputs hold another tool's config: the HF Trainer's TrainingArguments (``deepspeed``: ``hf_trainer``) and
Accelerate's DeepSpeed plugin (``accelerate_deepspeed``); ``_prepare`` picks the table each is walked with, and
their DeepSpeed offload sections map as ``--from deepspeed`` maps them (``deepspeed_offload``).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from .accelerate import ACCELERATE, HF_TRAINER, hf_option, size_based_groups
from .accelerate_deepspeed import ACCELERATE_DEEPSPEED, prepare_plugin
from .blocks import add_default_blocks
from .common import SOURCES, KeyReport, Migration, MigrationError, Rule, Status, add_block_rule
from .deepspeed import DEEPSPEED
from .deepspeed_offload import OffloadKeys, deepspeed_keys, record_offload
from .hf_trainer import TRAINER_KEYS, TrainerInput, prepare_trainer, trainer_rows
from .megatron import MEGATRON_FSDP, check_megatron
from .torchtitan import TORCHTITAN

__all__ = ["SOURCES", "KeyReport", "Migration", "MigrationError", "migrate", "read_input", "size_based_groups"]

TABLES = {
    "accelerate": ACCELERATE,
    "hf-trainer": HF_TRAINER,
    "deepspeed": DEEPSPEED,
    "torchtitan": TORCHTITAN,
    "megatron-fsdp": MEGATRON_FSDP,
}


def read_input(source: str, path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MigrationError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise MigrationError(f"{path}: not a text file") from None
    kind = {"torchtitan": "TOML", "accelerate": "YAML"}.get(source, "JSON")
    if source == "megatron-fsdp":
        kind = "JSON" if path.suffix == ".json" else "YAML"  # its own config is either
    try:
        if kind == "TOML":
            data: Any = _toml().loads(text)
        elif kind == "YAML":
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # each parser has its own error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MigrationError(f"{path}: not valid {kind} for --from {source}: {first}") from None
    if not isinstance(data, dict):
        raise MigrationError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def _toml() -> Any:
    """The standard library's TOML reader (Python 3.11+), or ``tomli`` (the same, for 3.10)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _rule_for(table: dict[str, Rule], key: str) -> Rule | None:
    if key in table:
        return table[key]
    for pattern, rule in table.items():
        if pattern.endswith(".*") and key.startswith(pattern[:-1]):
            return rule
    return None


def migrate(
    source: str,
    path: str | Path,
    *,
    fsdp_option: str | None = None,
    world_size: int | None = None,
    model: Any = None,
) -> Migration:
    """Read ``path`` as a config of ``source`` and map every key (see the module docstring)."""
    if source not in TABLES:
        raise ValueError(f"--from must be one of {', '.join(SOURCES)}; got {source!r}")
    data = read_input(source, path)
    _check_format(source, path, data)
    walk = _prepare(source, path, data, fsdp_option)
    flat = _flatten(walk.data)
    if source == "megatron-fsdp":
        check_megatron(path, flat)
    m = Migration(source, str(path), model=model, notes=list(walk.notes))
    if world_size is not None:
        m.data["_world_size"] = world_size
    if walk.offload_keys is not None:  # both offload sections, read before the walk: the key order must not matter
        record_offload(m, flat, walk.offload_keys)
    if source == "accelerate" and "num_machines" in data:
        m.data["_machines"] = data["num_machines"]
    if source == "torchtitan":  # its parallelize applies fully_shard to each TransformerBlock, then the model
        add_block_rule(m, ["TransformerBlock"], "torchtitan: one fully_shard per TransformerBlock")
    phases = [sorted(k for k in flat if _phase(k) == phase) for phase in range(3)]
    for key in phases[0]:  # the keys that name the groups
        m.keys.append(_map_key(m, walk.table, key, flat[key]))
    if not m.data.get("wrap") and not m.root_only:
        add_default_blocks(m, *DEFAULT_UNITS.get(source, ((), "")))
    for key in phases[1] + phases[2]:
        m.keys.append(_map_key(m, walk.table, key, flat[key]))
    trainer = walk.trainer
    option, label = (trainer.fsdp_option, trainer.fsdp_label) if trainer else (fsdp_option, "--fsdp")
    if option:
        m.keys.extend(hf_option(m, option, label))
    if trainer:
        m.keys.extend(trainer_rows(m, trainer.args, deepspeed=trainer.offload_keys is not None))
    for private in [key for key in m.data if key.startswith("_")]:
        m.data.pop(private)
    m.config  # noqa: B018  (raises MigrationError for values that do not make a valid config)
    return m


class _Walk(NamedTuple):
    """What the key walk reads for one input: the keys, the table that maps them, where a DeepSpeed config's
    offload sections are (read before the walk), notes for the report, and the Trainer's extras."""

    data: dict[str, Any]
    table: dict[str, Rule]
    offload_keys: OffloadKeys | None
    notes: list[str]
    trainer: TrainerInput | None


def _prepare(source: str, path: str | Path, data: dict[str, Any], fsdp_option: str | None) -> _Walk:
    """The HF Trainer's TrainingArguments and Accelerate's DeepSpeed plugin are walked with tables of their own
    (``hf_trainer``, ``accelerate_deepspeed``); every other input as it is."""
    if source == "hf-trainer":
        trainer = prepare_trainer(path, data, fsdp_option)
        return _Walk(trainer.data, trainer.table, trainer.offload_keys, trainer.notes, trainer)
    if source == "accelerate" and data.get("distributed_type") == "DEEPSPEED":
        plugin, keys, notes = prepare_plugin(path, data)
        return _Walk(plugin, ACCELERATE_DEEPSPEED, keys, notes, None)
    return _Walk(data, TABLES[source], deepspeed_keys() if source == "deepspeed" else None, [], None)


# keys that name the groups go first (a default block rule is added only when none does, and checkpointing
# needs the rules), keys that read others' values last
_WRAP_KEYS = ("layer_cls_to_wrap", "leaf_module.classes", "min_num_params", "auto_wrap_policy", "fsdp_unit_modules")
_LATE_KEYS = ("outer_dp_sharding_strategy",)
# a source's own default unit, wrapped with the Hugging Face decoder layers when there is no --model
DEFAULT_UNITS = {"megatron-fsdp": (("TransformerLayer",), "Megatron-LM's default unit")}


def _phase(key: str) -> int:
    return 0 if key.endswith(_WRAP_KEYS) else 2 if key.endswith(_LATE_KEYS) else 1


def _map_key(m: Migration, table: dict[str, Rule], key: str, value: Any) -> KeyReport:
    """One input key's report row, running its handler (which writes fsdp2lite keys into ``m``)."""
    rule = _rule_for(table, key)
    shown = json.dumps(value) if not isinstance(value, str) else value
    if rule is None:
        close = difflib.get_close_matches(key, [k for k in table if not k.endswith(".*")], n=1, cutoff=0.6)
        detail = f"did you mean {close[0]!r}?" if close else f"not a {m.source} key fsdp2lite knows"
        return KeyReport(key, shown, "unknown", detail)
    if not callable(rule):
        return KeyReport(key, shown, rule[0], rule[1])
    mapped = rule(m, value)
    statuses: tuple[Status, ...] = ("unsupported", "dropped")  # a handler's "unsupported: why" / "dropped: why"
    for status in statuses:
        if mapped.startswith(status):
            return KeyReport(key, shown, status, mapped.removeprefix(f"{status}: "))
    return KeyReport(key, shown, "mapped", mapped)


def _check_format(source: str, path: str | Path, data: dict[str, Any]) -> None:
    """The file must look like the tool's own config, or the report would be all 'unknown'."""
    if source == "accelerate" and data.get("distributed_type") not in ("FSDP", "DEEPSPEED", None):
        raise MigrationError(
            f"{path}: distributed_type is {data.get('distributed_type')!r}; only FSDP and DEEPSPEED (the DeepSpeed "
            "plugin) setups migrate"
        )
    expected = {
        "accelerate": ("distributed_type", "fsdp_config"),
        "deepspeed": ("zero_optimization",),
        "torchtitan": ("parallelism", "training", "job"),
        "megatron-fsdp": (
            "data_parallel_sharding_strategy",
            "zero_dp_strategy",
            "ddp",
            "megatron_fsdp",
            "use_megatron_fsdp",
        ),
        "hf-trainer": (*TRAINER_KEYS, *HF_TRAINER),
    }[source]
    if not any(key in data for key in expected):
        raise MigrationError(
            f"{path}: does not look like a {source} config (none of {', '.join(expected[:4])} at the top level); "
            "is --from right?"
        )
