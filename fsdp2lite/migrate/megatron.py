"""Megatron-FSDP configs (YAML or JSON): NVIDIA's FSDP in Megatron-LM / Megatron-Core and the ``megatron_fsdp``
package. The keys are its ``DistributedDataParallelConfig`` fields (Megatron-LM's ``--data-parallel-sharding-strategy``
flags with underscores; ``fully_shard``'s ``zero_dp_strategy`` for the same thing), flat at the top level or in a
``ddp:`` or ``megatron_fsdp:`` section. A Megatron-Bridge config keeps them under ``ddp:``; its ``model:`` and
``mixed_precision:`` sections give ``bf16``/``fp16``, ``grad_reduce_in_fp32`` and ``init_model_with_meta_device``, and
its other sections are training settings.

    data_parallel_sharding_strategy      no_shard | optim | optim_grads | optim_grads_params   (or 0-3)
    outer_dp_sharding_strategy           no_shard (HSDP) | optim (HFSDP; needs optim_grads_params)   (or 0-1)
    num_distributed_optimizer_instances  the outer data-parallel size: > 1 turns HSDP on
    fsdp_unit_modules                    classes (or import paths) sharded and gathered as units

The strategy is required: Megatron-LM defaults to no_shard and ``fully_shard`` to optim_grads_params.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import (
    DTYPES,
    LOOP_SETTING,
    Handler,
    Migration,
    MigrationError,
    Rule,
    add_block_rule,
    as_int,
    set_key,
)

INNER = ("no_shard", "optim", "optim_grads", "optim_grads_params")  # index = fully_shard's int form
OUTER = ("no_shard", "optim")
_STRATEGY_KEYS = ("data_parallel_sharding_strategy", "zero_dp_strategy")
_SECTIONS = ("", "ddp.", "megatron_fsdp.")


def check_megatron(path: str | Path, flat: dict[str, Any]) -> None:
    """The input must name its sharding strategy: the two Megatron-FSDP entry points default differently."""
    if not any(key.rsplit(".", 1)[-1] in _STRATEGY_KEYS for key in flat):
        raise MigrationError(
            f"{path}: names no data_parallel_sharding_strategy (or zero_dp_strategy); Megatron-LM defaults to "
            "no_shard and fully_shard to optim_grads_params, so give it: one of " + ", ".join(INNER)
        )


def _strategy(m: Migration, key: str, value: Any, valid: tuple[str, ...]) -> str:
    """A strategy by name, or by ``fully_shard``'s int (its index in ``valid``)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(valid):
        return valid[value]
    if isinstance(value, str) and value in valid:
        return value
    raise MigrationError(
        f"{m.path}: {key} {value!r}: expected one of {', '.join(valid)} (or 0-{len(valid) - 1}, in that order)"
    )


def _inner(m: Migration, value: Any, key: str) -> str:
    name = _strategy(m, key, value, INNER)
    earlier = m.data.get("_inner")
    if earlier is not None and earlier[1] != name:
        raise MigrationError(f"{m.path}: {key} {name!r} contradicts {earlier[0]} {earlier[1]!r}; give one of them")
    m.data["_inner"] = (key, name)
    if name == "no_shard":
        raise MigrationError(
            f"{m.path}: {key} no_shard shards nothing (data parallelism): use DDP; optim, optim_grads and "
            "optim_grads_params map to fsdp2lite"
        )
    if name == "optim_grads_params":
        set_key(m, "sharding.shard", "params", key)
        set_key(m, "reshard_after_forward", True, key)
        return (
            "sharding.shard: params, reshard_after_forward: true (ZeRO-3: parameters, gradients and optimizer "
            "state sharded; each group gathered per use)"
        )
    set_key(m, "sharding.shard", "optimizer", key)
    stage = "ZeRO-1" if name == "optim" else "ZeRO-2"
    return (
        f"sharding.shard: optimizer ({stage}: parameters resident between steps, gradients and optimizer state "
        "sharded; fsdp2lite's ZeRO-1 and ZeRO-2 are one mode)"
    )


def _outer_size(m: Migration, value: Any, key: str) -> str:
    size = as_int(m, key, value)
    m.data["_outer_size"] = size
    if size == 1:
        return "nothing (1: no outer data-parallel group)"
    set_key(m, "mesh.replicate", size, key)
    return f"mesh.replicate: {size} (HSDP: {size} replicas, each sharding over world size / {size} ranks)"


def _outer(m: Migration, value: Any, key: str) -> str:
    """After the inner strategy and the outer size (phase 2 in ``migrate``): HFSDP needs both."""
    name = _strategy(m, key, value, OUTER)
    size = m.data.get("_outer_size", 1)
    if name == "no_shard":
        if size == 1:
            return "nothing (no outer data-parallel group: num_distributed_optimizer_instances is 1)"
        return "sharding.replicate: none (HSDP: each replica holds whole shards)"
    inner_key, inner = m.data.get("_inner", ("data_parallel_sharding_strategy", None))
    if inner != "optim_grads_params":
        raise MigrationError(
            f"{m.path}: {key} optim (HFSDP) needs {inner_key} optim_grads_params, got {inner!r}: Megatron-FSDP "
            "shards the outer axis only on top of full inner sharding"
        )
    if size == 1:
        return (
            "unsupported: HFSDP needs the outer data-parallel size: num_distributed_optimizer_instances > 1 "
            "(Megatron-FSDP turns HSDP off without it)"
        )
    set_key(m, "sharding.replicate", "optimizer", key)
    return f"sharding.replicate: optimizer (HFSDP: optimizer state and fp32 masters sharded across the {size} replicas)"


def _units(m: Migration, value: Any, key: str) -> str:
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise MigrationError(f"{m.path}: {key} {value!r}: expected a list of class names or import paths")
    classes = [c.strip().rsplit(".", 1)[-1] for c in value if c.strip()]
    if not classes:
        return "nothing (an empty list: the default block rule applies)"
    add_block_rule(m, classes, key)
    return f"wrap: a group per {', '.join(classes)}"


def _flag(m: Migration, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise MigrationError(f"{m.path}: {key} {value!r}: expected true or false")
    return value


def _set_reduce_dtype(m: Migration, dtype: str, key: str) -> str:
    earlier = m.data.get("mixed_precision", {}).get("reduce_dtype")
    if earlier is not None and earlier != dtype:
        raise MigrationError(
            f"{m.path}: {key} asks gradients reduced in {dtype}, but {m.origins['mixed_precision.reduce_dtype']} "
            f"asks {earlier}; give one of them"
        )
    set_key(m, "mixed_precision.reduce_dtype", dtype, key)
    return f"mixed_precision.reduce_dtype: {dtype}"


def _grad_fp32(m: Migration, value: Any, key: str) -> str:
    if not _flag(m, key, value):
        return "nothing (gradients reduce in the compute dtype)"
    return _set_reduce_dtype(m, "fp32", key)


def _comm_dtype(m: Migration, value: Any, key: str) -> str:
    if value is None:
        return "nothing (the gradients' own dtype)"
    dtype = DTYPES.get(str(value).removeprefix("torch."))
    if dtype is None:
        raise MigrationError(f"{m.path}: {key} {value!r}: expected one of {', '.join(sorted(DTYPES))}")
    return _set_reduce_dtype(m, dtype, key)


def _half(dtype: str) -> Callable[[Migration, Any, str], str]:
    def handle(m: Migration, value: Any, key: str) -> str:
        if not _flag(m, key, value):
            return "nothing (off)"
        set_key(m, "mixed_precision.param_dtype", dtype, key)
        return f"mixed_precision.param_dtype: {dtype} (compute and all-gathers; the sharded masters keep their dtype)"

    return handle


def _recipe(m: Migration, value: Any, key: str) -> str:
    """Megatron-Bridge's ``mixed_precision: bf16_mixed`` (a recipe name)."""
    for dtype in ("bf16", "fp16"):
        if str(value).startswith(dtype):
            set_key(m, "mixed_precision.param_dtype", dtype, key)
            return f"mixed_precision.param_dtype: {dtype}"
    return f"unsupported: the {value} recipe (fsdp2lite computes in bf16, fp16 or fp32)"


def _overlap_reduce(m: Migration, value: Any, key: str) -> str:
    overlap = _flag(m, key, value)
    set_key(m, "schedule.overlap_reduce_scatter", overlap, key)
    return f"schedule.overlap_reduce_scatter: {str(overlap).lower()}"


def _overlap_gather(m: Migration, value: Any, key: str) -> str:
    if _flag(m, key, value):
        return "nothing: all-gathers overlap compute (a side stream; schedule.forward_prefetch_depth goes further)"
    return "unsupported: all-gathers that do not overlap compute"


def _masters(m: Migration, value: Any, key: str) -> str:
    if _flag(m, key, value):
        return "nothing: the sharded parameters are the masters, fp32 when the model is built in fp32"
    return "dropped: the masters are the model's own parameters: build the model in bf16 for bf16 masters"


def _off_or(reason: str) -> Callable[[Migration, Any, str], str]:
    """A feature fsdp2lite lacks: nothing when the input turns it off, unsupported when on."""

    def handle(m: Migration, value: Any, key: str) -> str:
        return f"unsupported: {reason}" if _flag(m, key, value) else "nothing (off)"

    return handle


_BUFFERS = "NCCL user buffers and persistent double buffers: fsdp2lite's buffers come from the caching allocator"
_FP8 = "FP8/FP4 parameters (Transformer Engine); all-gathers quantize to int8 only (communication.all_gather)"
_KEYS: dict[str, Any] = {
    "data_parallel_sharding_strategy": _inner,
    "zero_dp_strategy": _inner,
    "outer_dp_sharding_strategy": _outer,
    "num_distributed_optimizer_instances": _outer_size,
    "fsdp_unit_modules": _units,
    "grad_reduce_in_fp32": _grad_fp32,
    "grad_comm_dtype": _comm_dtype,
    "megatron_fsdp_grad_comm_dtype": _comm_dtype,
    "overlap_grad_reduce": _overlap_reduce,
    "overlap_param_gather": _overlap_gather,
    "preserve_fp32_weights": _masters,
    "bf16": _half("bf16"),
    "fp16": _half("fp16"),
    "use_megatron_fsdp": ("dropped", "selects Megatron's FSDP code path; the strategy keys say what is sharded"),
    "use_custom_fsdp": ("dropped", "the old name of use_megatron_fsdp"),
    "megatron_fsdp_version": ("dropped", "which Megatron-FSDP implementation runs; the strategy keys say the rest"),
    "use_distributed_optimizer": ("dropped", "the optimizer always steps on the shards"),
    "dp_shard_dim": ("dropped", "a mesh dimension name: fsdp2lite's axes are named replicate and shard"),
    "dp_outer_dim": ("dropped", "a mesh dimension name: fsdp2lite's axes are named replicate and shard"),
    "tp_dim": ("dropped", "a mesh dimension name: apply tensor parallelism in code first"),
    "main_params_dtype": ("dropped", "the masters are the model's own parameters, in the dtype it is built in"),
    "megatron_fsdp_main_params_dtype": ("dropped", "the masters are the model's own parameters"),
    "main_grads_dtype": ("dropped", "sharded gradients take the masters' dtype (reduce_dtype sets the reduction's)"),
    "megatron_fsdp_main_grads_dtype": ("dropped", "sharded gradients take the masters' dtype"),
    "grad_accum_dtype": ("dropped", "gradients accumulate in the masters' dtype (reduce_dtype sets the reduction's)"),
    "bucket_size": ("dropped", "fsdp2lite reduces one flat buffer per group, sized by the group"),
    "suggested_communication_unit_size": ("dropped", "communication is per group, sized by the group"),
    "disable_bucketing": ("dropped", "communication is per group, sized by the group"),
    "pad_buckets_for_high_nccl_busbw": ("dropped", "communication is per group, sized by the group"),
    "nccl_ub": ("dropped", _BUFFERS),
    "fsdp_double_buffer": ("dropped", _BUFFERS),
    "fsdp_db_use_persist_buf_on_alloc_fail": ("dropped", _BUFFERS),
    "disable_symmetric_registration": ("dropped", _BUFFERS),
    "fsdp_manual_registration": ("dropped", _BUFFERS),
    "fsdp_all_gather_in_start_param_sync": ("dropped", "the first all-gather overlaps like any other"),
    "average_in_collective": ("dropped", "gradients are averaged over the ranks (set_gradient_divide_factor)"),
    "gradient_reduce_div_fusion": ("dropped", "gradients are averaged over the ranks (set_gradient_divide_factor)"),
    "calculate_per_token_loss": (
        "dropped",
        "a loss setting: sum over ranks with set_gradient_divide_factor(1.0), divide by the global token count",
    ),
    "check_for_nan_in_grad": ("dropped", f"{LOOP_SETTING} (check the norm clip_grad_norm_ returns)"),
    "check_for_large_grads": ("dropped", f"{LOOP_SETTING} (check the norm clip_grad_norm_ returns)"),
    "sync_model_each_microbatch": ("dropped", "use set_requires_gradient_sync(False) on all but the last microbatch"),
    "preproc_state_dict_for_dcp_ckpt": ("dropped", "state_dict() holds even DTensor shards: DCP saves them as is"),
    "init_model_with_meta_device": ("dropped", "build on meta, apply_config, then to_empty and load the weights"),
    "align_param_gather": ("dropped", "a pipeline-parallel setting"),
    "keep_fp8_transpose_cache": _off_or(_FP8),
    "keep_fp8_transpose_cache_when_using_custom_fsdp": _off_or(_FP8),
    "fp8_param_gather": _off_or(_FP8),
    "fp4_param_gather": _off_or(_FP8),
    "reuse_grad_buf_for_mxfp8_param_ag": _off_or(_FP8),
    "enable_fine_grained_param_gather": _off_or("per-module all-gathers inside a unit: groups gather whole"),
    "reduce_scatter_with_fp32_accumulation": _off_or(
        "low-precision reduce-scatter with fp32 accumulation (communication.reduce_scatter offers int8)"
    ),
    "delay_wgrad_compute": _off_or("delayed weight-gradient compute (Transformer Engine)"),
}
# Megatron-Bridge's other sections: the keys of theirs that matter, then the rest as training settings
_BRIDGE_SECTIONS = ("model", "train", "optimizer", "scheduler", "checkpoint", "logger", "dataset", "tokenizer", "rng",
                    "comm_overlap", "profiling", "mixed_precision", "dist", "env_vars", "ft", "straggler")  # fmt: skip
_BRIDGE: dict[str, Any] = {
    "mixed_precision": _recipe,
    "mixed_precision.bf16": _half("bf16"),
    "mixed_precision.fp16": _half("fp16"),
    "mixed_precision.grad_reduce_in_fp32": _grad_fp32,
    "model.bf16": _half("bf16"),
    "model.fp16": _half("fp16"),
    "model.init_model_with_meta_device": _KEYS["init_model_with_meta_device"],
    "dist.use_megatron_fsdp": _KEYS["use_megatron_fsdp"],
    **{f"{section}.*": ("dropped", "not a sharding setting") for section in _BRIDGE_SECTIONS},
}


def _bind(handler: Callable[[Migration, Any, str], str], key: str) -> Handler:
    return lambda m, value: handler(m, value, key)


def _table() -> dict[str, Rule]:
    """Every key of ``_KEYS`` in each section (flat, ``ddp.``, ``megatron_fsdp.``), then ``_BRIDGE``; each
    handler gets the key as the input wrote it, for its report and errors."""
    keys = {f"{section}{name}": rule for section in _SECTIONS for name, rule in _KEYS.items()} | _BRIDGE
    return {key: _bind(rule, key) if callable(rule) else rule for key, rule in keys.items()}


MEGATRON_FSDP: dict[str, Rule] = _table()
