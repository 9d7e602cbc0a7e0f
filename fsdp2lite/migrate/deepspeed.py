"""DeepSpeed ZeRO configs (JSON): stages 1-3, offload (``deepspeed_offload``), hpZ, MiCS, leaf modules, dtypes.

``deepspeed_table(prefix)`` is the same table for a DeepSpeed config inside another tool's input (the HF
Trainer's ``deepspeed``, Accelerate's ``deepspeed_config_file``), its keys under ``prefix``."""

from __future__ import annotations

from typing import Any

from .common import DTYPES, LOOP_SETTING, Handler, Migration, MigrationError, Rule, add_block_rule, set_key
from .deepspeed_offload import OFFLOAD_RULES


def stage_key(key: str) -> Handler:
    """ZeRO's stage under ``key`` (DeepSpeed's ``zero_optimization.stage``, Accelerate's ``zero_stage``)."""

    def handle(m: Migration, value: Any) -> str:
        stage = int(value) if isinstance(value, str) and value.strip().isdigit() else value
        if stage == 0:
            raise MigrationError(
                f"{m.path}: ZeRO stage 0 shards nothing (data parallelism): use DDP; stages 1-3 map to fsdp2lite"
            )
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise MigrationError(f"{m.path}: {key} must be 0-3, got {value!r}")
        if stage == 3:
            set_key(m, "reshard_after_forward", True, key)
            return "reshard_after_forward: true (stage 3: parameters sharded and gathered per use)"
        set_key(m, "zero_stage", stage, key)
        return f"zero_stage: {stage} (parameters resident between steps; gradients and optimizer state sharded)"

    return handle


def _ds_hpz(m: Migration, value: Any) -> str:
    if int(value) <= 1:
        return "nothing (1 = no secondary partition)"
    set_key(m, "reshard_after_forward", int(value), "zero_optimization.zero_hpz_partition_size")
    return f"reshard_after_forward: {int(value)} (backward all-gathers over {int(value)} ranks)"


def _ds_mics(m: Migration, value: Any) -> str:
    if int(value) <= 0:
        return "nothing (MiCS off)"
    world = m.data.get("_world_size")
    if world is None:  # a DeepSpeed config does not know its world size: the launch decides the replicas
        set_key(m, "mesh", {"replicate": -1, "shard": int(value)}, "zero_optimization.mics_shard_size")
        return f"mesh: shard {int(value)}, replicate -1 (world size / {int(value)} at launch)"
    if world % int(value):
        raise MigrationError(f"{m.path}: mics_shard_size {value} does not divide --world-size {world}")
    set_key(m, "mesh", {"replicate": world // int(value), "shard": int(value)}, "zero_optimization.mics_shard_size")
    return f"mesh: replicate {world // int(value)} x shard {int(value)}"


def _ds_leaf(m: Migration, value: Any) -> str:
    classes = value if isinstance(value, list) else [value]
    add_block_rule(m, [str(c).rsplit(".", 1)[-1] for c in classes], "zero_optimization.leaf_module.classes")
    return f"wrap: a group per {', '.join(map(str, classes))}"


def _ds_dtype(dtype: str) -> Handler:
    def handle(m: Migration, value: Any) -> str:
        if value == "auto":  # the HF Trainer's and Accelerate's DeepSpeed templates
            return (
                "nothing ('auto': the HF Trainer or Accelerate fills it from its own bf16/fp16 setting, "
                "which maps to mixed_precision where the input has it)"
            )
        if not value:
            return "nothing (disabled)"
        set_key(m, "mixed_precision.param_dtype", dtype, f"{dtype}.enabled")
        m.data["mixed_precision"].setdefault("reduce_dtype", "fp32")
        return f"mixed_precision: param_dtype {dtype}, reduce_dtype fp32 (DeepSpeed keeps fp32 master gradients)"

    return handle


def _ds_quantized(collective: str, kind: str) -> Handler:
    """ZeRO++ qwZ / qgZ: int8 block-quantized all-gathers / gradient reductions (CommPolicy)."""

    def handle(m: Migration, value: Any) -> str:
        if value is not True:
            return f"nothing ({value!r}: off)"
        key = "zero_quantized_weights" if collective == "all_gather" else "zero_quantized_gradients"
        set_key(m, f"communication.{collective}", kind, f"zero_optimization.{key}")
        return f"communication.{collective}: {kind}"

    return handle


def _ds_comm_dtype(m: Migration, value: Any) -> str:
    dtype = DTYPES.get(str(value))
    if dtype is None:
        raise MigrationError(f"{m.path}: communication_data_type {value!r}: expected one of {sorted(DTYPES)}")
    set_key(m, "mixed_precision.reduce_dtype", dtype, "communication_data_type")
    return f"mixed_precision.reduce_dtype: {dtype}"


_BUCKETS = "bucket and buffer sizes: fsdp2lite reduces one flat buffer per group, sized by the group"
DEEPSPEED: dict[str, Rule] = {
    "zero_optimization.stage": stage_key("zero_optimization.stage"),
    **OFFLOAD_RULES,
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
    "zero_optimization.zero_quantized_weights": _ds_quantized("all_gather", "int8"),
    "zero_optimization.zero_quantized_gradients": _ds_quantized("reduce_scatter", "int8"),
    "gradient_accumulation_steps": ("dropped", "use set_requires_gradient_sync(False) on all but the last microbatch"),
    "fp16.loss_scale": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.initial_scale_power": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.loss_scale_window": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.hysteresis": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "fp16.min_loss_scale": ("dropped", "no loss scaler in fsdp2lite: use torch.amp.GradScaler"),
    "train_batch_size": ("dropped", LOOP_SETTING),
    "train_micro_batch_size_per_gpu": ("dropped", LOOP_SETTING),
    "gradient_clipping": ("dropped", "use torch.nn.utils.clip_grad_norm_ on the DTensor gradients"),
    "steps_per_print": ("dropped", LOOP_SETTING),
    "wall_clock_breakdown": ("dropped", "use fl.record_trace for the schedule"),
    "zero_allow_untested_optimizer": ("dropped", "any torch optimizer steps the DTensor shards"),
    "optimizer.*": ("dropped", "the optimizer is built in code from model.parameters()"),
    "scheduler.*": ("dropped", LOOP_SETTING),
    "activation_checkpointing.*": (
        "unsupported",
        "DeepSpeed's activation partitioning; use activation_checkpointing: true on a wrap rule",
    ),
    "tensorboard.*": ("dropped", "logging"),
    "wandb.*": ("dropped", "logging"),
    "csv_monitor.*": ("dropped", "logging"),
    "flops_profiler.*": ("dropped", "profiling"),
    "comms_logger.*": ("dropped", "use fl.record_trace and fsdp2lite trace summarize"),
}


def deepspeed_table(prefix: str) -> dict[str, Rule]:
    """``DEEPSPEED`` with every key under ``prefix`` (the handlers read no key names)."""
    return {f"{prefix}{key}": rule for key, rule in DEEPSPEED.items()}
