"""Published training runs the step-time model (``estimate.timing``) is checked against, as data.

    for point in PUBLISHED.values():
        check(point).ratio          # the model's tokens/s over the published figure

Each point is a job as its source describes it (model shape, ranks, tokens, what is trained, how it is
sharded, the GPU and link) and the throughput it reported. ``check`` plans the job on the meta device with
fsdp2lite's own policy (``configs/hf_causal_lm.yaml``'s groups: one per decoder layer) and times it with
``plan_step_time``. ``CALIBRATION`` is the run the RTX 4090's achievable fraction of peak (``GPUS``) was
read from; it is not a check. ``benchmarks/bench_published.py`` prints them all, docs/estimate.md shows
the arithmetic, ``tests/test_timing.py`` holds each check within 25%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import FSDPConfig, plan_config
from .finetune import Finetune, plan_model
from .timing import StepTime, flops_per_token, plan_step_time

_LLAMA2 = {"vocab_size": 32000, "max_position_embeddings": 4096, "num_key_value_heads": 8, "rms_norm_eps": 1e-5}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-2-7b": {**_LLAMA2, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32},
    "llama-2-70b": {**_LLAMA2, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64},
    "llama-3.1-8b": {"vocab_size": 128256, "max_position_embeddings": 8192, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "rope_theta": 500000.0},
}  # fmt: skip
QLORA_TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")  # fsdp_qlora's LoRA layers


@dataclass(frozen=True)
class Published:
    """One published run and where it comes from."""

    source: str
    model: str  # a key of SHAPES
    world_size: int
    batch: int  # sequences per GPU per step
    seq: int
    gpu: str
    link: str
    tokens_per_s: float  # the job's, as published (or derived from the published time, as ``source`` says)
    finetune: Finetune = field(default_factory=Finetune)
    checkpointing: bool = False
    offload: bool = False


PUBLISHED: dict[str, Published] = {
    "torchtitan-llama3.1-8b-8xh100": Published(
        "pytorch/torchtitan docs/performance.md, table 1: FSDP, bf16 params, fp32 reduce, local batch 2 at seq "
        "8192, selective activation checkpointing (no matmul recomputed: counted as none), 5,762 tokens/s/GPU",
        "llama-3.1-8b", 8, 2, 8192, "h100", "nvlink4", 8 * 5762.0,
    ),
    "answerai-llama2-70b-qlora-2x4090": Published(
        "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md, Dual 4090: QLoRA, CPU offload, batch 2, context 2048, "
        "gradient checkpointing, 4,399 s for 1,024 samples: 1,024 x 2,048 / 4,399 = 476.7 tokens/s",
        "llama-2-70b", 2, 2, 2048, "rtx4090", "pcie4", 1024 * 2048 / 4399,
        Finetune("qlora", 64, QLORA_TARGETS), checkpointing=True, offload=True,
    ),
}  # fmt: skip
CALIBRATION = Published(
    "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md, Dual 4090, Llama-2-7B: QLoRA, FSDP, no offload, batch 10, "
    "context 2048, 466 s for 1,024 samples",
    "llama-2-7b", 2, 10, 2048, "rtx4090", "pcie4", 1024 * 2048 / 466,
    Finetune("qlora", 64, QLORA_TARGETS), checkpointing=True,
)  # fmt: skip


@dataclass(frozen=True)
class Check:
    point: Published
    time: StepTime
    params: int
    trainable: int
    flops_per_token: float

    @property
    def ratio(self) -> float:
        """The model's tokens/s over the published figure."""
        return self.time.tokens_per_s / self.point.tokens_per_s


def check(point: Published) -> Check:
    """The step-time model's figure for ``point``'s job."""
    import transformers

    config = transformers.LlamaConfig(**SHAPES[point.model])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    nf4 = set(plan_model(model, point.finetune))
    policy = FSDPConfig.model_validate(
        {
            "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "wrap": [{"match": {"class": "LlamaDecoderLayer"}, "activation_checkpointing": point.checkpointing}],
            "offload": {"device": "cpu" if point.offload else "none"},
        }
    )
    plan = plan_config(model, policy)
    time = plan_step_time(
        model, plan, shard=point.world_size, world_size=point.world_size, tokens_per_gpu=point.batch * point.seq,
        seq=point.seq, link=point.link, gpu=point.gpu, finetune=point.finetune.kind,  # type: ignore[arg-type]
        nf4=nf4 if point.finetune.kind == "qlora" else (),
    )  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    flops = flops_per_token(params, trainable, point.finetune.kind, point.checkpointing,  # type: ignore[arg-type]
                            4.0 * layers * hidden * point.seq)  # fmt: skip
    return Check(point, time, params, trainable, flops)


def implied_tflops(point: Published) -> float:
    """The dense TFLOP/s per GPU the published run implies under the model's FLOP count."""
    result = check(point)
    return result.flops_per_token * point.tokens_per_s / point.world_size / 1e12
