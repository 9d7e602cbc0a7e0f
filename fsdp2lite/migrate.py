"""``fsdp2lite migrate``: an Accelerate, HF Trainer, DeepSpeed or torchtitan setup as an fsdp2lite config.

    m = migrate("deepspeed", "ds_config.json")
    m.config            # an FSDPConfig: what apply_config applies
    m.yaml()            # the policy file, a comment on each key naming where it came from
    m.keys              # every input key: mapped (to what), dropped (why), unsupported (what is missing), unknown

Each source is a table from its keys (dotted paths into the parsed file; ``prefix.*`` for whole
sections) to a handler that writes fsdp2lite keys, or to the reason it has no equivalent. A key in no
table is ``unknown``, with the closest key the tool does have. Files are read with ``json``,
``yaml.safe_load`` and ``tomllib``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .config import FSDPConfig, problems_from

Status = Literal["mapped", "dropped", "unsupported", "unknown"]
SOURCES = ("accelerate", "hf-trainer", "deepspeed", "torchtitan")


class MigrationError(ValueError):
    """An input that is not a config of the named tool, or one fsdp2lite cannot represent at all."""


@dataclass(frozen=True)
class KeyReport:
    key: str  # dotted path in the input
    value: str
    status: Status
    detail: str  # mapped: to what; dropped: why; unsupported: what is missing; unknown: did you mean


@dataclass
class Migration:
    source: str
    path: str
    data: dict[str, Any] = field(default_factory=dict)  # FSDPConfig fields
    origins: dict[str, str] = field(default_factory=dict)  # fsdp2lite key -> input key(s)
    keys: list[KeyReport] = field(default_factory=list)
    model: Any = None  # for size-based wrapping: the model (built on meta) whose modules are named

    @property
    def config(self) -> FSDPConfig:
        from pydantic import ValidationError

        try:
            return FSDPConfig.model_validate(self.data)
        except ValidationError as exc:
            problems = "; ".join(f"{p.location}: {p.message}" for p in problems_from(exc))
            raise MigrationError(f"{self.path}: the values do not make a valid fsdp2lite config: {problems}") from None

    @property
    def unknown(self) -> list[KeyReport]:
        return [k for k in self.keys if k.status == "unknown"]

    def yaml(self) -> str:
        """The policy file: ``config.to_yaml()`` with a comment on each key that came from the input
        (top-level keys and the mapping keys under them, e.g. ``mixed_precision.param_dtype``)."""
        lines = [f"# migrated by fsdp2lite migrate --from {self.source} {self.path}"]
        parent = ""
        for line in self.config.to_yaml().splitlines():
            key = line.strip().split(":", 1)[0]
            if line and not line[0].isspace() and not line.startswith("-"):
                parent, path = key, key
            elif line.startswith("  ") and not line.startswith("   ") and not line.lstrip().startswith("-"):
                path = f"{parent}.{key}"
            else:
                path = ""
            origin = self.origins.get(path) if path else None
            lines.append(f"{line}  # from {origin}" if origin else line)
        return "\n".join(lines) + "\n"


Handler = Callable[[Migration, Any], str]  # writes into migration.data; returns what it mapped to
Rule = Handler | tuple[Literal["dropped", "unsupported"], str]


def _set(m: Migration, path: str, value: Any, origin: str) -> None:
    node = m.data
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    m.origins.setdefault(path, origin)
    top = parts[0]
    m.origins[top] = f"{m.origins[top]}, {origin}" if top in m.origins and origin not in m.origins[top] else origin


def _block_rule(m: Migration, classes: list[str], origin: str) -> None:
    wrap = m.data.setdefault("wrap", [])
    if wrap:
        wrap[0]["match"]["class"] = sorted(set(wrap[0]["match"]["class"]) | set(classes))
    else:
        wrap.append({"match": {"class": classes}})
    m.origins["wrap"] = origin


def _checkpoint_blocks(m: Migration, origin: str) -> str:
    if not m.data.get("wrap"):
        return "unsupported"
    for rule in m.data["wrap"]:
        rule["activation_checkpointing"] = True
    m.origins["wrap"] = f"{m.origins.get('wrap', '')}, {origin}".strip(", ")
    return "wrap[*].activation_checkpointing: true"


DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


# ---- DeepSpeed ---------------------------------------------------------------------------------------
def _ds_stage(m: Migration, value: Any) -> str:
    if value in (0, 1):
        raise MigrationError(
            f"{m.path}: ZeRO stage {value} does not shard parameters (stage 1 shards only optimizer state); "
            "fsdp2lite shards parameters, gradients and optimizer state: stage 2 or 3 map to it"
        )
    if value not in (2, 3):
        raise MigrationError(f"{m.path}: zero_optimization.stage must be 0-3, got {value!r}")
    _set(m, "reshard_after_forward", value == 3, "zero_optimization.stage")
    return f"reshard_after_forward: {str(value == 3).lower()} (stage {value})"


def _ds_offload(kind: str) -> Handler:
    def handle(m: Migration, value: Any) -> str:
        if value in ("none", None):
            return "offload.device: none"
        if value != "cpu":
            raise MigrationError(
                f"{m.path}: {kind}.device {value!r}: fsdp2lite offloads to cpu only (nvme has no equivalent)"
            )
        _set(m, "offload.device", "cpu", f"zero_optimization.{kind}.device")
        return "offload.device: cpu (parameters, gradients and optimizer state together)"

    return handle


def _ds_pin(m: Migration, value: Any) -> str:
    _set(m, "offload.pin_memory", bool(value), "zero_optimization.offload_*.pin_memory")
    return f"offload.pin_memory: {str(bool(value)).lower()}"


def _ds_hpz(m: Migration, value: Any) -> str:
    if int(value) <= 1:
        return "nothing (1 = no secondary partition)"
    _set(m, "reshard_after_forward", int(value), "zero_optimization.zero_hpz_partition_size")
    return f"reshard_after_forward: {int(value)} (backward all-gathers over {int(value)} ranks)"


def _ds_mics(m: Migration, value: Any) -> str:
    if int(value) <= 0:
        return "nothing (MiCS off)"
    world = m.data.get("_world_size")
    if world is None:
        raise MigrationError(
            f"{m.path}: zero_optimization.mics_shard_size {value} becomes an HSDP mesh (shard {value}, replicate "
            "world/shard): pass --world-size so the replicate degree can be computed"
        )
    if world % int(value):
        raise MigrationError(f"{m.path}: mics_shard_size {value} does not divide --world-size {world}")
    _set(m, "mesh", {"replicate": world // int(value), "shard": int(value)}, "zero_optimization.mics_shard_size")
    return f"mesh: replicate {world // int(value)} x shard {int(value)}"


def _ds_leaf(m: Migration, value: Any) -> str:
    classes = value if isinstance(value, list) else [value]
    _block_rule(m, [str(c).rsplit(".", 1)[-1] for c in classes], "zero_optimization.leaf_module.classes")
    return f"wrap: a group per {', '.join(map(str, classes))}"


def _ds_dtype(dtype: str) -> Handler:
    def handle(m: Migration, value: Any) -> str:
        if not value:
            return "nothing (disabled)"
        _set(m, "mixed_precision.param_dtype", dtype, f"{dtype}.enabled")
        m.data["mixed_precision"].setdefault("reduce_dtype", "fp32")
        return f"mixed_precision: param_dtype {dtype}, reduce_dtype fp32 (DeepSpeed keeps fp32 master gradients)"

    return handle


def _ds_comm_dtype(m: Migration, value: Any) -> str:
    dtype = DTYPES.get(str(value))
    if dtype is None:
        raise MigrationError(f"{m.path}: communication_data_type {value!r}: expected one of {sorted(DTYPES)}")
    _set(m, "mixed_precision.reduce_dtype", dtype, "communication_data_type")
    return f"mixed_precision.reduce_dtype: {dtype}"


_BUCKETS = "bucket and buffer sizes: fsdp2lite reduces one flat buffer per group, sized by the group"
_LOOP = "a training-loop setting, not sharding"
DEEPSPEED: dict[str, Rule] = {
    "zero_optimization.stage": _ds_stage,
    "zero_optimization.offload_param.device": _ds_offload("offload_param"),
    "zero_optimization.offload_optimizer.device": _ds_offload("offload_optimizer"),
    "zero_optimization.offload_param.pin_memory": _ds_pin,
    "zero_optimization.offload_optimizer.pin_memory": _ds_pin,
    "zero_optimization.zero_hpz_partition_size": _ds_hpz,
    "zero_optimization.mics_shard_size": _ds_mics,
    "zero_optimization.leaf_module.classes": _ds_leaf,
    "bf16.enabled": _ds_dtype("bf16"),
    "fp16.enabled": _ds_dtype("fp16"),
    "communication_data_type": _ds_comm_dtype,
    "zero_optimization.reduce_bucket_size": ("dropped", _BUCKETS),
    "zero_optimization.allgather_bucket_size": ("dropped", _BUCKETS),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "dropped",
        "prefetch is per group (schedule.forward_prefetch_depth)",
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        "dropped",
        "every parameter of a group is sharded; keep small ones whole with ignore:",
    ),
    "zero_optimization.stage3_max_live_parameters": (
        "dropped",
        "live parameters are bounded by the groups and the prefetch depth",
    ),
    "zero_optimization.stage3_max_reuse_distance": (
        "dropped",
        "groups are resharded per reshard_after_forward, not by reuse distance",
    ),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "dropped",
        "checkpoints are DCP (fl.save_checkpoint); fsdp2lite consolidate makes one file",
    ),
    "zero_optimization.overlap_comm": ("dropped", "communication always overlaps (side streams on CUDA)"),
    "zero_optimization.contiguous_gradients": ("dropped", "gradients are reduced from one flat buffer per group"),
    "zero_optimization.reduce_scatter": ("dropped", "gradients are always reduce-scattered"),
    "zero_optimization.allgather_partitions": ("dropped", "parameters are always all-gathered per group"),
    "zero_optimization.round_robin_gradients": ("dropped", "no equivalent needed: one reduce-scatter per group"),
    "zero_optimization.sub_group_size": ("dropped", "the optimizer steps on the DTensor shards directly"),
    "zero_optimization.load_from_fp32_weights": ("dropped", "the shards are the fp32 master weights"),
    "zero_optimization.elastic_checkpoint": ("dropped", "DCP checkpoints reshard to any world size"),
    "zero_optimization.ignore_unused_parameters": ("dropped", "see set_reduce_scatter_unused_params"),
    "zero_optimization.offload_param.buffer_count": ("dropped", "nvme offload buffers: no nvme offload"),
    "zero_optimization.offload_param.buffer_size": ("dropped", "nvme offload buffers: no nvme offload"),
    "zero_optimization.offload_param.nvme_path": ("unsupported", "nvme offload"),
    "zero_optimization.offload_optimizer.nvme_path": ("unsupported", "nvme offload"),
    "zero_optimization.zero_quantized_weights": ("unsupported", "quantized all-gathers (ZeRO++ qwZ)"),
    "zero_optimization.zero_quantized_gradients": ("unsupported", "quantized reduce-scatters (ZeRO++ qgZ)"),
    "gradient_accumulation_steps": ("dropped", "use set_requires_gradient_sync(False) on all but the last microbatch"),
    "fp16.loss_scale": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.initial_scale_power": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.loss_scale_window": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.hysteresis": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.min_loss_scale": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "train_batch_size": ("dropped", _LOOP),
    "train_micro_batch_size_per_gpu": ("dropped", _LOOP),
    "gradient_clipping": ("dropped", "use torch.nn.utils.clip_grad_norm_ on the DTensor gradients"),
    "steps_per_print": ("dropped", _LOOP),
    "wall_clock_breakdown": ("dropped", "use fl.record_trace for the schedule"),
    "zero_allow_untested_optimizer": ("dropped", "any torch optimizer steps the DTensor shards"),
    "optimizer.*": ("dropped", "the optimizer is built in code from model.parameters()"),
    "scheduler.*": ("dropped", _LOOP),
    "activation_checkpointing.*": (
        "unsupported",
        "DeepSpeed's activation partitioning; use activation_checkpointing: true on a wrap rule",
    ),
    "tensorboard.*": ("dropped", "logging"),
    "wandb.*": ("dropped", "logging"),
    "csv_monitor.*": ("dropped", "logging"),
    "flops_profiler.*": ("dropped", "profiling"),
    "comms_logger.*": ("dropped", "use fl.record_trace and fsdp2lite trace summarize"),
    "aio.*": ("dropped", "nvme I/O: no nvme offload"),
}


# ---- torchtitan -------------------------------------------------------------------------------------
def _tt_degree(key: str, target: str) -> Handler:
    def handle(m: Migration, value: Any) -> str:
        _set(m, f"mesh.{target}", int(value), f"parallelism.{key}")
        return f"mesh.{target}: {int(value)}"

    return handle


def _tt_reshard(m: Migration, value: Any) -> str:
    mapping = {"default": "auto", "always": True, "never": False}
    if value not in mapping:
        raise MigrationError(
            f"{m.path}: parallelism.fsdp_reshard_after_forward {value!r}: expected default, always or never"
        )
    _set(m, "reshard_after_forward", mapping[value], "parallelism.fsdp_reshard_after_forward")
    return f"reshard_after_forward: {str(mapping[value]).lower()}"


def _tt_other_parallel(name: str) -> Handler:
    def handle(m: Migration, value: Any) -> str:
        if int(value) > 1:
            return (
                f"unsupported: {name} degree {value} (not in fsdp2lite's config; apply tensor parallel in code first)"
            )
        return "nothing (degree 1)"

    return handle


def _tt_dtype(target: str) -> Handler:
    def handle(m: Migration, value: Any) -> str:
        dtype = DTYPES.get(str(value))
        if dtype is None:
            raise MigrationError(f"{m.path}: training.mixed_precision_{target} {value!r}: expected bfloat16 or float32")
        _set(m, f"mixed_precision.{target}_dtype", dtype, f"training.mixed_precision_{target}")
        return f"mixed_precision.{target}_dtype: {dtype}"

    return handle


def _tt_ac(m: Migration, value: Any) -> str:
    if value == "none":
        return "nothing (no activation checkpointing)"
    if value == "full":
        return _checkpoint_blocks(m, "activation_checkpoint.mode")
    return f"unsupported: {value} (per-op selective checkpointing is not in fsdp2lite; use full)"


_TT_SECTIONS = ("job", "model", "optimizer", "lr_scheduler", "checkpoint", "metrics", "profiling", "comm", "float8",
                "experimental", "compile", "memory_estimation", "fault_tolerance", "validation", "mx")  # fmt: skip
TORCHTITAN: dict[str, Rule] = {
    "parallelism.data_parallel_replicate_degree": _tt_degree("data_parallel_replicate_degree", "replicate"),
    "parallelism.data_parallel_shard_degree": _tt_degree("data_parallel_shard_degree", "shard"),
    "parallelism.fsdp_reshard_after_forward": _tt_reshard,
    "parallelism.tensor_parallel_degree": _tt_other_parallel("tensor parallel"),
    "parallelism.pipeline_parallel_degree": _tt_other_parallel("pipeline parallel"),
    "parallelism.context_parallel_degree": _tt_other_parallel("context parallel"),
    "parallelism.expert_parallel_degree": _tt_other_parallel("expert parallel"),
    "parallelism.enable_async_tensor_parallel": ("unsupported", "async tensor parallel"),
    "parallelism.disable_loss_parallel": ("dropped", "loss parallel is a tensor-parallel setting"),
    "parallelism.pipeline_parallel_schedule": ("unsupported", "pipeline parallel"),
    "parallelism.pipeline_parallel_microbatch_size": ("unsupported", "pipeline parallel"),
    "parallelism.enable_compiled_autograd": (
        "unsupported",
        "compiled autograd (compile blocks instead: block.compile())",
    ),
    "training.mixed_precision_param": _tt_dtype("param"),
    "training.mixed_precision_reduce": _tt_dtype("reduce"),
    "activation_checkpoint.mode": _tt_ac,
    "activation_checkpoint.selective_ac_option": ("unsupported", "per-op selective checkpointing"),
    "training.*": ("dropped", _LOOP),
    **{f"{section}.*": ("dropped", "not a sharding setting") for section in _TT_SECTIONS},
}


# ---- Accelerate and HF Trainer ------------------------------------------------------------------------
def _strategy(m: Migration, value: Any, origin: str) -> str:
    name = str(value).upper()
    name = {
        "1": "FULL_SHARD",
        "2": "SHARD_GRAD_OP",
        "3": "NO_SHARD",
        "4": "HYBRID_SHARD",
        "5": "HYBRID_SHARD_ZERO2",
    }.get(name, name)
    if name == "NO_SHARD":
        raise MigrationError(
            f"{m.path}: {origin} NO_SHARD is data parallelism without sharding: use DDP, not fsdp2lite"
        )
    if name not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        raise MigrationError(
            f"{m.path}: {origin} {value!r}: expected FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2 "
            "or NO_SHARD"
        )
    reshard = name in ("FULL_SHARD", "HYBRID_SHARD")
    _set(m, "reshard_after_forward", reshard, origin)
    mapped = f"reshard_after_forward: {str(reshard).lower()}"
    if name.startswith("HYBRID"):
        machines = m.data.pop("_machines", None)
        if machines is None:
            return f"{mapped}; unsupported: the HSDP mesh (replicate = number of machines) needs num_machines"
        _set(m, "mesh.replicate", int(machines), f"{origin} + num_machines")
        mapped += f", mesh.replicate: {machines} (one replica per machine)"
    return mapped


def _wrap_policy(m: Migration, value: Any, origin: str) -> str:
    if value in ("TRANSFORMER_BASED_WRAP", "transformer_based_wrap"):
        return "class rules from the transformer layer classes"
    if value in ("NO_WRAP", None):
        return "nothing (the root only)"
    if value in ("SIZE_BASED_WRAP", "size_based_wrap"):
        return "size-based: path rules from min_num_params and --model"
    raise MigrationError(f"{m.path}: {origin} {value!r}: expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")


def _layer_classes(m: Migration, value: Any, origin: str) -> str:
    classes = [c.strip() for c in value.split(",")] if isinstance(value, str) else [str(c) for c in value]
    _block_rule(m, [c for c in classes if c], origin)
    return f"wrap: a group per {', '.join(classes)}"


def _min_num_params(m: Migration, value: Any, origin: str) -> str:
    """Size-based wrapping as torch's FSDP1 policy does it, on the model given: bottom-up, a module
    whose parameters not yet in a group reach ``value`` becomes a group. Without a model: unsupported."""
    if m.model is None:
        return "unsupported: size-based wrapping needs the model (--model MODULE:FACTORY) to name the modules"
    paths = size_based_groups(m.model, int(value))
    if not paths:
        return f"nothing: no module below the root has {int(value):,} parameters"
    m.data.setdefault("wrap", []).append({"match": {"path": paths}})
    m.origins["wrap"] = origin
    return f"wrap: a group per {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''} ({len(paths)} modules)"


def size_based_groups(model: Any, min_num_params: int) -> list[str]:
    """Module paths torch's ``size_based_auto_wrap_policy`` would wrap (the root excluded): bottom-up,
    a module (with a forward) whose parameters not already in a group reach ``min_num_params``."""
    import torch.nn as nn

    found: list[str] = []

    def visit(module: Any, path: str) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            remaining += visit(child, f"{path}.{name}" if path else name)
        if path and remaining >= min_num_params and type(module).forward is not nn.Module.forward:
            found.append(path)
            return 0
        return remaining

    visit(model, "")
    return found


def _offload(m: Migration, value: Any, origin: str) -> str:
    if str(value).lower() in ("true", "1"):
        _set(m, "offload.device", "cpu", origin)
        return "offload.device: cpu"
    return "nothing (off)"


def _reshard(m: Migration, value: Any, origin: str) -> str:
    _set(m, "reshard_after_forward", bool(value), origin)
    return f"reshard_after_forward: {str(bool(value)).lower()}"


def _ac(m: Migration, value: Any, origin: str) -> str:
    if str(value).lower() not in ("true", "1"):
        return "nothing (off)"
    result = _checkpoint_blocks(m, origin)
    return result if result != "unsupported" else "unsupported: no block rule to checkpoint (name the layer classes)"


def _forward_prefetch(m: Migration, value: Any, origin: str) -> str:
    depth = 1 if str(value).lower() in ("true", "1") else 0
    _set(m, "schedule.forward_prefetch_depth", depth, origin)
    return f"schedule.forward_prefetch_depth: {depth}"


def _fsdp_keys(prefix: str) -> dict[str, Rule]:
    """The FSDP keys Accelerate (``fsdp_config.fsdp_*``) and the HF Trainer (``fsdp_config``, with or
    without ``fsdp_``) share, under ``prefix``."""

    def bind(handler: Callable[[Migration, Any, str], str], key: str) -> Handler:
        return lambda m, value: handler(m, value, key)

    keys: dict[str, Rule] = {}
    shared: dict[str, Any] = {
        "sharding_strategy": _strategy,
        "auto_wrap_policy": _wrap_policy,
        "transformer_layer_cls_to_wrap": _layer_classes,
        "offload_params": _offload,
        "reshard_after_forward": _reshard,
        "activation_checkpointing": _ac,
        "forward_prefetch": _forward_prefetch,
        "min_num_params": _min_num_params,
        "backward_prefetch": ("dropped", "backward prefetch is always on (set_late_backward_prefetch picks when)"),
        "state_dict_type": (
            "dropped",
            "state_dict() holds DTensors; fl.save_checkpoint writes DCP, consolidate one file",
        ),
        "use_orig_params": ("dropped", "parameters are always the original ones (per-parameter sharding)"),
        "sync_module_states": ("dropped", "build the same model on every rank, or on meta then load a checkpoint"),
        "cpu_ram_efficient_loading": ("dropped", "build on meta, to_empty, then load_state_dict / load_checkpoint"),
        "limit_all_gathers": ("dropped", "all-gathers are bounded by the prefetch depth"),
        "version": ("dropped", "fsdp2lite is FSDP2-style: both versions map the same way"),
        "xla": ("unsupported", "XLA"),
        "xla_fsdp_grad_ckpt": ("unsupported", "XLA"),
        "xla_fsdp_settings": ("unsupported", "XLA"),
        "activation_cpu_offload": ("unsupported", "activation offload"),
        "cpu_offload_pin_memory": ("dropped", "pinned when offloading to a CUDA job"),
    }
    for name, rule in shared.items():
        full = f"{prefix}{name}"
        keys[full] = bind(rule, full) if callable(rule) else rule
    return keys


ACCELERATE: dict[str, Rule] = {
    "distributed_type": ("dropped", "checked: must be FSDP"),
    "mixed_precision": lambda m, v: _accelerate_mixed(m, v),
    "num_machines": ("dropped", "used for HYBRID_SHARD's replicate degree"),
    **_fsdp_keys("fsdp_config.fsdp_"),
    "parallelism_config.parallelism_config_dp_replicate_size": lambda m, v: _set_return(
        m, "mesh.replicate", int(v), "parallelism_config_dp_replicate_size"
    ),
    "parallelism_config.parallelism_config_dp_shard_size": lambda m, v: _set_return(
        m, "mesh.shard", int(v), "parallelism_config_dp_shard_size"
    ),
    "parallelism_config.parallelism_config_tp_size": lambda m, v: (
        "nothing (1)" if int(v) <= 1 else f"unsupported: tensor parallel {v} (apply it in code first)"
    ),
    "parallelism_config.parallelism_config_cp_size": lambda m, v: (
        "nothing (1)" if int(v) <= 1 else f"unsupported: context parallel {v}"
    ),
    **{
        key: ("dropped", "a launcher setting, not sharding")
        for key in (
            "compute_environment",
            "debug",
            "machine_rank",
            "main_training_function",
            "num_processes",
            "rdzv_backend",
            "same_network",
            "tpu_env",
            "tpu_use_cluster",
            "tpu_use_sudo",
            "use_cpu",
            "downcast_bf16",
            "enable_cpu_affinity",
            "gpu_ids",
            "main_process_ip",
            "main_process_port",
            "dynamo_config.*",
            "deepspeed_config.*",
        )
    },  # fmt: skip
}

HF_TRAINER: dict[str, Rule] = {**_fsdp_keys(""), **_fsdp_keys("fsdp_")}


def _set_return(m: Migration, path: str, value: Any, origin: str) -> str:
    _set(m, path, value, origin)
    return f"{path}: {value}"


def _accelerate_mixed(m: Migration, value: Any) -> str:
    if value in ("no", None):
        return "nothing (fp32)"
    dtype = DTYPES.get(str(value))
    if dtype is None:
        raise MigrationError(f"{m.path}: mixed_precision {value!r}: expected no, fp16 or bf16")
    _set(m, "mixed_precision.param_dtype", dtype, "mixed_precision")
    _set(m, "mixed_precision.reduce_dtype", "fp32", "mixed_precision")
    return f"mixed_precision: param_dtype {dtype}, reduce_dtype fp32"


def _hf_option(m: Migration, option: str) -> list[KeyReport]:
    """The Trainer's ``--fsdp "full_shard auto_wrap offload"`` words."""
    reports = []
    for word in option.split():
        key = f"--fsdp {word}"
        if word in ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard"):
            reports.append(KeyReport(key, word, "mapped", _strategy(m, word.upper(), key)))
        elif word == "offload":
            reports.append(KeyReport(key, word, "mapped", _offload(m, True, key)))
        elif word == "auto_wrap":
            reports.append(KeyReport(key, word, "mapped", "class rules from transformer_layer_cls_to_wrap"))
        else:
            close = difflib.get_close_matches(
                word, ["full_shard", "shard_grad_op", "hybrid_shard", "offload", "auto_wrap"], n=1
            )
            reports.append(
                KeyReport(key, word, "unknown", f"did you mean {close[0]!r}?" if close else "not a --fsdp option")
            )
    return reports


# ---- reading and walking ------------------------------------------------------------------------------
TABLES = {"accelerate": ACCELERATE, "hf-trainer": HF_TRAINER, "deepspeed": DEEPSPEED, "torchtitan": TORCHTITAN}


def read_input(source: str, path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MigrationError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise MigrationError(f"{path}: not a text file") from None
    try:
        if source == "torchtitan":
            data: Any = _toml().loads(text)
        elif source == "accelerate":
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # each parser has its own error types
        kind = {"torchtitan": "TOML", "accelerate": "YAML"}.get(source, "JSON")
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
    if source == "hf-trainer" and isinstance(data.get("fsdp_config"), dict):
        data = data["fsdp_config"]  # TrainingArguments as JSON: the FSDP part
    _check_format(source, path, data)
    m = Migration(source, str(path), model=model)
    if world_size is not None:
        m.data["_world_size"] = world_size
    if source == "accelerate" and "num_machines" in data:
        m.data["_machines"] = data["num_machines"]
    if source == "torchtitan":  # its parallelize applies fully_shard to each TransformerBlock, then the model
        _block_rule(m, ["TransformerBlock"], "torchtitan: one fully_shard per TransformerBlock")
    table = TABLES[source]
    flat = _flatten(data)
    first = ("layer_cls_to_wrap", "leaf_module.classes", "min_num_params")  # rules before what checkpoints them
    ordered = sorted(flat, key=lambda k: (not k.endswith(first), k))
    for key in ordered:
        value = flat[key]
        rule = _rule_for(table, key)
        shown = json.dumps(value) if not isinstance(value, str) else value
        if rule is None:
            close = difflib.get_close_matches(key, [k for k in table if not k.endswith(".*")], n=1, cutoff=0.6)
            detail = f"did you mean {close[0]!r}?" if close else f"not a {source} key fsdp2lite knows"
            m.keys.append(KeyReport(key, shown, "unknown", detail))
        elif callable(rule):
            mapped = rule(m, value)
            status: Status = "unsupported" if mapped.startswith("unsupported") else "mapped"
            m.keys.append(KeyReport(key, shown, status, mapped.removeprefix("unsupported: ")))
        else:
            m.keys.append(KeyReport(key, shown, rule[0], rule[1]))
    if fsdp_option:
        m.keys.extend(_hf_option(m, fsdp_option))
    for private in ("_world_size", "_machines"):
        m.data.pop(private, None)
    m.config  # noqa: B018  (raises MigrationError for values that do not make a valid config)
    return m


def _check_format(source: str, path: str | Path, data: dict[str, Any]) -> None:
    """The file must look like the tool's own config, or the report would be all 'unknown'."""
    if source == "accelerate" and data.get("distributed_type") not in ("FSDP", None):
        raise MigrationError(f"{path}: distributed_type is {data.get('distributed_type')!r}; only FSDP setups migrate")
    expected = {
        "accelerate": ("distributed_type", "fsdp_config"),
        "deepspeed": ("zero_optimization",),
        "torchtitan": ("parallelism", "training", "job"),
        "hf-trainer": tuple(k for k in HF_TRAINER),
    }[source]
    if not any(key in data for key in expected):
        raise MigrationError(
            f"{path}: does not look like a {source} config (none of {', '.join(expected[:4])} at the top level); "
            "is --from right?"
        )
