"""Accelerate configs (YAML, FSDP1 and FSDP2 keys) and the HF Trainer's ``fsdp_config`` plus its ``--fsdp`` words.

Accelerate's DeepSpeed plugin is ``accelerate_deepspeed``; the Trainer's TrainingArguments are ``hf_trainer``."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from .common import (
    DTYPES,
    Handler,
    KeyReport,
    Migration,
    MigrationError,
    Rule,
    add_block_rule,
    as_int,
    checkpoint_blocks,
    set_key,
    set_return,
)


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
    set_key(m, "reshard_after_forward", reshard, origin)
    mapped = f"reshard_after_forward: {str(reshard).lower()}"
    if name.startswith("HYBRID"):
        machines = m.data.pop("_machines", None)
        if machines is None:
            return f"unsupported: the HSDP mesh (replicate = number of machines) needs num_machines ({mapped} is set)"
        machines = as_int(m, "num_machines", machines)
        set_key(m, "mesh.replicate", machines, f"{origin} + num_machines")
        mapped += f", mesh.replicate: {machines} (one replica per machine)"
    return mapped


def _wrap_policy(m: Migration, value: Any, origin: str) -> str:
    if value in ("TRANSFORMER_BASED_WRAP", "transformer_based_wrap"):
        return "class rules from the transformer layer classes"
    if value in ("NO_WRAP", "no_wrap"):
        m.root_only = True
        return "nothing: the whole model is one group, as NO_WRAP asks (no block rule is added)"
    if value is None:
        return "nothing (no policy named)"
    if value in ("SIZE_BASED_WRAP", "size_based_wrap"):
        return "size-based: path rules from min_num_params and --model"
    raise MigrationError(f"{m.path}: {origin} {value!r}: expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")


def _layer_classes(m: Migration, value: Any, origin: str) -> str:
    classes = [c.strip() for c in value.split(",")] if isinstance(value, str) else [str(c) for c in value]
    add_block_rule(m, [c for c in classes if c], origin)
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


_TRUE = ("true", "1", "yes", "y", "t", "on")  # the strings Accelerate's str_to_bool reads as true ...
_FALSE = ("false", "0", "no", "n", "f", "off")  # ... and as false


def _offload(m: Migration, value: Any, origin: str) -> str:
    """FSDP's parameter offload (torch's ``CPUOffloadPolicy``, FSDP1's ``CPUOffload(offload_params=True)``):
    the sharded parameters, their gradients and so the optimizer state live on the host; not ZeRO-Offload."""
    flag = str(value).lower()
    if flag not in _TRUE + _FALSE:
        raise MigrationError(f"{m.path}: {origin} {value!r}: expected true or false")
    if flag in _FALSE:
        return "nothing (off)"
    set_key(m, "offload.device", "cpu", origin)
    set_key(m, "offload.optimizer_only", False, origin)
    return (
        "offload: {device: cpu, optimizer_only: false} (FSDP's parameter offload: parameters, gradients and "
        "optimizer state on the host; the optimizer steps there)"
    )


def _reshard(m: Migration, value: Any, origin: str) -> str:
    set_key(m, "reshard_after_forward", bool(value), origin)
    return f"reshard_after_forward: {str(bool(value)).lower()}"


def _ac(m: Migration, value: Any, origin: str) -> str:
    if str(value).lower() not in ("true", "1"):
        return "nothing (off)"
    result = checkpoint_blocks(m, origin)
    return result if result != "unsupported" else "unsupported: no block rule to checkpoint (name the layer classes)"


def _forward_prefetch(m: Migration, value: Any, origin: str) -> str:
    depth = 1 if str(value).lower() in ("true", "1") else 0
    set_key(m, "schedule.forward_prefetch_depth", depth, origin)
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
    "parallelism_config.parallelism_config_dp_replicate_size": lambda m, v: set_return(
        m,
        "mesh.replicate",
        as_int(m, "parallelism_config_dp_replicate_size", v),
        "parallelism_config_dp_replicate_size",
    ),
    "parallelism_config.parallelism_config_dp_shard_size": lambda m, v: set_return(
        m, "mesh.shard", as_int(m, "parallelism_config_dp_shard_size", v), "parallelism_config_dp_shard_size"
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
        )
    },  # fmt: skip
    "deepspeed_config.*": (
        "dropped",
        "the DeepSpeed plugin's settings, which an FSDP launch does not read; migrate a DeepSpeed setup's "
        "JSON config with --from deepspeed",
    ),
}

HF_TRAINER: dict[str, Rule] = {
    **_fsdp_keys(""),
    **_fsdp_keys("fsdp_"),
    "cpu_offload": lambda m, v: _offload(m, v, "cpu_offload"),  # the Trainer's own name for it (transformers 5)
}


def _accelerate_mixed(m: Migration, value: Any) -> str:
    if value in ("no", None):
        return "nothing (fp32)"
    dtype = DTYPES.get(str(value))
    if dtype is None:
        raise MigrationError(f"{m.path}: mixed_precision {value!r}: expected no, fp16 or bf16")
    set_key(m, "mixed_precision.param_dtype", dtype, "mixed_precision")
    set_key(m, "mixed_precision.reduce_dtype", "fp32", "mixed_precision")
    return f"mixed_precision: param_dtype {dtype}, reduce_dtype fp32"


def hf_option(m: Migration, option: str, label: str = "--fsdp") -> list[KeyReport]:
    """The Trainer's ``--fsdp "full_shard auto_wrap offload"`` words (``label``: where they came from, the
    command line or the TrainingArguments' ``fsdp``)."""
    reports = []
    for word in option.split():
        key = f"{label} {word}"
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
