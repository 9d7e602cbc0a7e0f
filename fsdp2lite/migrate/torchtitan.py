"""torchtitan job configs (TOML): data-parallel degrees, reshard after forward, mixed precision, CPU offload,
full AC."""

from __future__ import annotations

from typing import Any

from .common import (
    DTYPES,
    LOOP_SETTING,
    Handler,
    Migration,
    MigrationError,
    Rule,
    as_int,
    checkpoint_blocks,
    set_key,
)


def _tt_degree(key: str, target: str) -> Handler:
    """torchtitan's dp_replicate (>= 1) and dp_shard (-1: the ranks the other degrees leave) degrees."""

    def handle(m: Migration, value: Any) -> str:
        degree = as_int(m, f"parallelism.{key}", value, auto=target == "shard")
        set_key(m, f"mesh.{target}", degree, f"parallelism.{key}")
        return f"mesh.{target}: {degree}"

    return handle


def _tt_reshard(m: Migration, value: Any) -> str:
    mapping = {"default": "auto", "always": True, "never": False}
    if value not in mapping:
        raise MigrationError(
            f"{m.path}: parallelism.fsdp_reshard_after_forward {value!r}: expected default, always or never"
        )
    set_key(m, "reshard_after_forward", mapping[value], "parallelism.fsdp_reshard_after_forward")
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
        set_key(m, f"mixed_precision.{target}_dtype", dtype, f"training.mixed_precision_{target}")
        return f"mixed_precision.{target}_dtype: {dtype}"

    return handle


def _tt_offload(m: Migration, value: Any) -> str:
    """torchtitan's ``CPUOffloadPolicy()`` on every ``fully_shard``: parameters, gradients, optimizer state."""
    if not isinstance(value, bool):
        raise MigrationError(f"{m.path}: training.enable_cpu_offload {value!r}: expected true or false")
    if not value:
        return "nothing (off)"
    set_key(m, "offload.device", "cpu", "training.enable_cpu_offload")
    set_key(m, "offload.optimizer_only", False, "training.enable_cpu_offload")
    return (
        "offload: {device: cpu, optimizer_only: false} (FSDP2's CPUOffloadPolicy: parameters, gradients and "
        "optimizer state on the host; the optimizer steps there)"
    )


def _tt_ac(m: Migration, value: Any) -> str:
    if value == "none":
        return "nothing (no activation checkpointing)"
    if value == "full":
        return checkpoint_blocks(m, "activation_checkpoint.mode")
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
    "training.enable_cpu_offload": _tt_offload,
    "activation_checkpoint.mode": _tt_ac,
    "activation_checkpoint.selective_ac_option": ("unsupported", "per-op selective checkpointing"),
    "training.*": ("dropped", LOOP_SETTING),
    **{f"{section}.*": ("dropped", "not a sharding setting") for section in _TT_SECTIONS},
}
