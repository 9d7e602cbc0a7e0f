"""How long one training step takes, on a named link and GPU: pure arithmetic, no collectives.

``fsdp2lite estimate --link NAME --gpu NAME`` reports it for the estimated setting and ranks the budget
search by it.

    sent = comm_bytes(plan, shard=8)                          # what each rank's collectives carry per step
    t = step_time(params=8.03e9, tokens_per_gpu=16384, world_size=8, link="nvlink4", gpu="h100",
                  comm=sent, attention_flops_per_token=attention_flops(32, 4096, 8192))
    t.step_s, t.tokens_per_s

The model (docs/estimate.md, "Step time", checks it against two published runs):

    compute_s = tokens_per_gpu * F / (tflops * mfu) + dequant_s
        F = forward + 2 P + 2 A + 2 P_t (+ forward with activation checkpointing), forward = 2 P + A
        P all parameters, P_t trainable ones, A attention's forward FLOP per token (4 layers seq hidden)
        full:       F = 6 P + 3 A            (weight gradients for every weight)
        lora/qlora: F = 4 P + 3 A + 2 P_t    (frozen weights get input gradients, no weight gradients)
                    + 2 H                    (a frozen head's logits made again in backward: finetune.head_loss)
    dequant_s = passes * N * (2.5 + 2/64) bytes / (HBM bandwidth * 0.8)
        qlora: N NF4 values (every adapted weight, whole: each rank dequantizes the gathered weight), each
        dequantized once per pass that multiplies by it: forward, input gradient, and the recomputed forward
        with activation checkpointing (passes 2 or 3); fsdp2lite's compiled kernel reads half a byte and writes
        a bf16 per value (finetune/nf4_linear.py); 0.8 of the bandwidth is an assumption, not a measurement
    comm_s = collectives * latency + sent_per_rank / bandwidth
        sent_per_rank = (n - 1) / n * (forward all-gather + backward re-gather + reduce-scatter buffers)
        (ring all-gather and reduce-scatter: each rank sends n - 1 of its n chunks)
    h2d_s = host_bytes / host link bandwidth   (offloaded shards copied in at each all-gather, their
                                                sharded gradients copied out)
    nvme_s = nvme_bytes / NVMe bandwidth        (optimizer: nvme: the state read and written once per step,
                                                at the host optimizer step: not overlapped with compute)
    exposed_comm_s = max(0, comm_s + h2d_s - overlap * compute_s)
        FSDP prefetches the next group's all-gather and reduce-scatters the last one's gradients while a
        group computes; ``overlap`` (default 0.9, an assumption, not a measurement) is the share of compute
        that can hide transfers: the first all-gather and the last reduce-scatter of a step wait on nothing.
    step_s = compute_s + exposed_comm_s + nvme_s;  tokens_per_s = world_size * tokens_per_gpu / step_s (the job's)
    ``schedule="cpu"`` (a gloo job, fsdp2lite's CPU defaults: _runtime/root.py ``schedule_defaults``): the host
    runs the collectives and the compute, so only the forward's prefetched all-gathers (all but the first) can
    hide, under the forward's compute; backward's all-gathers are issued after the previous reduce-scatter and
    each reduce-scatter is waited at once: exposed_comm_s = comm_s + h2d_s - min(forward all-gathers after the
    first, overlap * forward compute). Checked against the link emulator (benchmarks/bench_link.py --planner).

GPU peaks are the vendors' dense (no sparsity) BF16 tensor-core figures with FP32 accumulation:
    h100, h200  989 TFLOP/s   NVIDIA H100 / H200 SXM datasheets (1,979 "with sparsity")
    a100        312 TFLOP/s   NVIDIA A100 datasheet
    rtx4090     165.2 TFLOP/s NVIDIA Ada (AD102) whitepaper, "FP16/BF16 tensor, FP32 accumulate"
Memory bandwidth (dequantization streams through it): rtx4090 1.008 TB/s, a100 2.039 TB/s (80 GB SXM),
h100 3.35 TB/s, h200 4.8 TB/s (the vendors' datasheets, SXM parts).
Achievable fraction (MFU) of that peak:
    h100, h200  0.40   Llama 3 paper (Dubey et al. 2024, table 4): 38-43% BF16 MFU on 8K-16K H100s
    a100        0.50   Narayanan et al. 2021 (Megatron-LM): 52% of peak on 3,072 A100s
    rtx4090     0.60   Answer.AI's Llama-2-7B QLoRA on 2 x 4090 (FSDP, batch 10 x 2048, 466 s for 1,024
                       samples): 101 TFLOP/s a GPU, 61% (docs/estimate.md shows the arithmetic)
Link bandwidths are what NCCL's bus bandwidth reaches, not the signalling rate:
    pcie4    25 GB/s   x16 is 31.5 GB/s per direction; ~80% after protocol overhead
    pcie5    50 GB/s   x16 is 63 GB/s per direction
    nvlink4  370 GB/s  nccl-tests all-gather bus bandwidth on 8 x H100 SXM (NVLink 4 is 450 GB/s each way)
    ib200    25 GB/s   200 Gb/s InfiniBand HDR, one NIC per GPU
    eth100   12 GB/s   100 Gb/s Ethernet (RoCE)
NVMe: ``NVME_GB_PER_S`` = 5 GB/s per machine, one PCIe 4.0 x4 SSD's sequential read and write
(vendors quote 6-7 GB/s; sustained writes run lower), shared by the ranks of a machine.
The per-collective latencies are rough (tens of microseconds); they matter only for many small groups.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from .._runtime.quantize import encoded_sizes
from ..config import Plan
from ..finetune.head_loss import plain_head
from ..policies import cast_dtype, reduce_cast_dtype
from .common import element_size, sharded_nbytes
from .finetune import NF4_BITS
from .host import STATE_TENSORS

NF4_BYTES = NF4_BITS / 8  # bytes per weight of an NF4 tensor
NVME_GB_PER_S = 5.0  # one machine's NVMe drive, read and write (module docstring)


@dataclass(frozen=True)
class Link:
    """An interconnect as NCCL sees it."""

    gb_per_s: float  # bus bandwidth, GB/s (1e9 bytes)
    latency_us: float  # fixed cost of one collective


@dataclass(frozen=True)
class Gpu:
    """A GPU's dense BF16 peak and the fraction of it training reaches; its memory bandwidth."""

    tflops: float  # dense BF16 tensor-core peak, TFLOP/s (1e12)
    mfu: float  # achievable fraction of ``tflops`` (module docstring cites each)
    hbm_tb_per_s: float = 3.35  # device memory bandwidth, TB/s (1e12 bytes): what dequantization streams through


LINKS: dict[str, Link] = {
    "pcie4": Link(25.0, 15.0),
    "pcie5": Link(50.0, 15.0),
    "nvlink4": Link(370.0, 10.0),
    "ib200": Link(25.0, 20.0),
    "eth100": Link(12.0, 50.0),
}
GPUS: dict[str, Gpu] = {
    "rtx4090": Gpu(165.2, 0.60, 1.008),
    "a100": Gpu(312.0, 0.50, 2.039),
    "h100": Gpu(989.0, 0.40, 3.35),
    "h200": Gpu(989.0, 0.40, 4.8),
}
DEQUANT_BYTES_PER_VALUE = 2.5 + 2 / 64  # NF4: half a byte read, a bf16 written; a block scale per 64, made twice
STREAM_EFFICIENCY = 0.8  # the share of the memory bandwidth an elementwise kernel reaches (an assumption)

Finetune = Literal["full", "lora", "qlora"]


@dataclass(frozen=True)
class CommBytes:
    """Per step, the buffers one rank's collectives carry (each collective's unsharded size, padded as the
    all-gather lays it out) and its host copies. Every buffer is ``shard`` equal chunks, so each rank sends
    exactly ``(shard - 1) / shard`` of it in a ring."""

    shard: int  # ranks in the shard axis (the ring)
    all_gather_forward: int  # bytes: every group's parameters, in the all-gather's encoding
    all_gather_backward: int  # bytes: the groups resharded after forward, gathered again in backward
    reduce_scatter: int  # bytes: trainable parameters' gradients, in the reduce encoding
    collectives: int  # collectives per step (each pays the link's latency)
    host_bytes: int  # bytes over the host link: offloaded shards in at each gather, their grads out
    nvme_bytes: int = 0  # optimizer: nvme: the state read plus the state written, per step
    forward_collectives: int = 0  # the forward's all-gathers (one per group), of ``collectives``

    @property
    def total(self) -> int:
        return self.all_gather_forward + self.all_gather_backward + self.reduce_scatter

    @property
    def sent_per_rank(self) -> int:
        """Bytes each rank sends per step: ``shard - 1`` chunks of every buffer."""
        return self.total // self.shard * (self.shard - 1)


@dataclass(frozen=True)
class StepTime:
    """One training step's time and its terms (seconds; tokens_per_s is the whole job's)."""

    compute_s: float
    comm_s: float  # collectives, if nothing overlapped them
    exposed_comm_s: float  # collectives and host copies left after overlap with compute
    h2d_s: float  # host copies of offloaded shards (and their gradients back), if nothing overlapped them
    step_s: float  # compute_s + exposed_comm_s + nvme_s (compute_s includes dequant_s)
    tokens_per_s: float  # world_size * tokens_per_gpu / step_s
    nvme_s: float = 0.0  # optimizer: nvme: the state read and written at the host step, not overlapped
    dequant_s: float = 0.0  # qlora: the NF4 weights dequantized for each pass's matmuls (in compute_s)


def find_link(name: str | Link) -> Link:
    """The table's link ``name`` (a ``Link`` as it is); ValueError naming the valid ones."""
    return _find(name, Link, LINKS, "link")


def find_gpu(name: str | Gpu) -> Gpu:
    """The table's GPU ``name`` (a ``Gpu`` as it is); ValueError naming the valid ones."""
    return _find(name, Gpu, GPUS, "gpu")


def _find(name: Any, kind: type, table: Mapping[str, Any], what: str) -> Any:
    if isinstance(name, kind):
        return name
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; valid {what}s: {', '.join(table)}")
    return table[name]


def attention_flops(layers: int, hidden: int, seq: int) -> float:
    """Attention's forward FLOP per token not in 2 P: scores ``QK^T`` and ``softmax V``, each 2 seq hidden
    per layer, counted without the causal half as torchtitan's and PaLM's MFU do."""
    return 4.0 * layers * hidden * seq


def flops_per_token(
    params: float, trainable: float, finetune: Finetune, checkpointing: bool, attention: float = 0.0
) -> float:
    """Training FLOP per token (module docstring): forward, input gradients, trainable weight gradients,
    and the recomputed forward with activation checkpointing."""
    if finetune not in ("full", "lora", "qlora"):
        raise ValueError(f"unknown finetune {finetune!r}; valid: full, lora, qlora")
    trainable = params if finetune == "full" else trainable
    forward = 2 * params + attention
    return forward + 2 * params + 2 * attention + 2 * trainable + (forward if checkpointing else 0.0)


def step_time(
    *,
    params: float,
    tokens_per_gpu: int,
    world_size: int,
    link: str | Link,
    gpu: str | Gpu,
    comm: CommBytes | None = None,
    finetune: Finetune = "full",
    trainable_params: float = 0.0,
    checkpointing: bool = False,
    attention_flops_per_token: float = 0.0,
    host_link: str | Link = "pcie4",
    overlap: float = 0.9,
    nvme_gb_per_s: float = NVME_GB_PER_S,
    schedule: Literal["cuda", "cpu"] = "cuda",
    nf4_values: float = 0.0,
    recomputed_params: float = 0.0,
) -> StepTime:
    """One step's time (module docstring). ``trainable_params``: the adapters for lora/qlora (full
    trains all ``params``); ``comm``: from ``comm_bytes`` (None: no collectives, e.g. world size 1);
    ``nvme_gb_per_s``: this rank's share of its machine's NVMe bandwidth; ``schedule``: which device's
    defaults overlap the collectives (``cpu``: only the forward's prefetched all-gathers); ``nf4_values``:
    qlora's NF4 weights, each dequantized for the forward's matmul, the input gradient's and the recomputed
    forward's; ``recomputed_params``: a frozen head whose logits the loss makes again in backward."""
    if world_size < 1 or tokens_per_gpu < 1:
        raise ValueError(f"world_size ({world_size}) and tokens_per_gpu ({tokens_per_gpu}) must be >= 1")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap is a fraction of compute from 0 to 1, got {overlap}")
    if schedule not in ("cuda", "cpu"):
        raise ValueError(f"schedule must be 'cuda' or 'cpu', got {schedule!r}")
    wire, host, device = find_link(link), find_link(host_link), find_gpu(gpu)
    flops = flops_per_token(params, trainable_params, finetune, checkpointing, attention_flops_per_token)
    flops += 2 * recomputed_params
    passes = 3 if checkpointing else 2
    dequant_s = passes * nf4_values * DEQUANT_BYTES_PER_VALUE / (device.hbm_tb_per_s * 1e12 * STREAM_EFFICIENCY)
    compute_s = tokens_per_gpu * flops / (device.tflops * 1e12 * device.mfu) + dequant_s
    comm_s = h2d_s = 0.0
    if comm is not None:
        if comm.shard > 1:
            comm_s = comm.collectives * wire.latency_us * 1e-6 + comm.sent_per_rank / (wire.gb_per_s * 1e9)
        h2d_s = comm.host_bytes / (host.gb_per_s * 1e9)
    hidden = overlap * compute_s
    if schedule == "cpu":
        forward_share = (2 * params + attention_flops_per_token) / flops
        hidden = min(_prefetched_s(comm, wire) if comm is not None else 0.0, overlap * forward_share * compute_s)
    exposed = max(0.0, comm_s + h2d_s - hidden)
    nvme_s = comm.nvme_bytes / (nvme_gb_per_s * 1e9) if comm is not None else 0.0
    step_s = compute_s + exposed + nvme_s
    tokens_per_s = world_size * tokens_per_gpu / step_s
    return StepTime(compute_s, comm_s, exposed, h2d_s, step_s, tokens_per_s, nvme_s, dequant_s)


def _prefetched_s(comm: CommBytes, wire: Link) -> float:
    """The forward's all-gathers after the first (the ones a CPU schedule prefetches under compute), in
    seconds on ``wire``: each its latency and its ring bytes, the first's share taken off."""
    if comm.shard < 2 or comm.forward_collectives < 2:
        return 0.0
    sent = comm.all_gather_forward // comm.shard * (comm.shard - 1)
    forward_s = comm.forward_collectives * wire.latency_us * 1e-6 + sent / (wire.gb_per_s * 1e9)
    return forward_s * (comm.forward_collectives - 1) / comm.forward_collectives


def comm_bytes(
    plan: Plan, shard: int, bytes_per_weight: Mapping[str, float] | None = None, optimizer: str = "adamw"
) -> CommBytes:
    """What one rank's collectives carry per step under ``plan`` at shard degree ``shard``: each group's
    padded all-gather buffer in param_dtype (or its ``communication`` encoding), again in backward where the
    group reshards after forward, and its trainable parameters' reduce-scatter buffer in reduce_dtype.
    ``bytes_per_weight``: parameter path -> bytes per element, overriding the dtype (a QLoRA base in NF4:
    4.127 / 8). Ignored parameters are never communicated; a replicate axis' all-reduce is not counted.
    ``optimizer`` sizes an ``optimizer: nvme`` group's state, read and written once per step."""
    overrides = bytes_per_weight or {}
    forward = backward = reduced = collectives = host = nvme = gathers = 0
    last = len(plan.groups) - 1
    for index, (group, spec) in enumerate(zip(plan.groups, plan.specs)):  # the spec fully_shard builds
        if not spec.params:
            continue
        policy = group.policy
        wire = policy.communication
        gather = scatter = stored = reduce_rows = trained = 0
        for planned in spec.params:
            param = planned.param
            padded_shard = sharded_nbytes(param, shard, planned.dim)
            rows = padded_shard // param.element_size()
            override = overrides.get(planned.fqn)
            stored += padded_shard if override is None else math.ceil(rows * override)
            own = planned.mixed_precision  # the group's or its own: [Note: per-parameter mixed precision]
            gather += _encoded(rows, shard, override, cast_dtype(param, own.param_dtype), wire.all_gather,
                               wire.block_size)  # fmt: skip
            if param.requires_grad:
                trained += padded_shard
                reduce_dtype = reduce_cast_dtype(param, own.param_dtype, own.reduce_dtype)
                reduce_rows += rows
                if wire.reduce_scatter != "int8":
                    scatter += _encoded(rows, shard, None, reduce_dtype, None, wire.block_size)
        if wire.reduce_scatter == "int8" and reduce_rows:  # the group's row to each rank, encoded as one run
            scatter = _encoded(reduce_rows, shard, None, torch.float32, "int8", wire.block_size)
        regather = (
            _reshards(policy.reshard_after_forward, root=index == last)
            and policy.unshard_in_backward
            and not policy.sharding.resident  # ZeRO-1/2 keeps its parameters through backward
        )
        forward += gather
        backward += gather if regather else 0
        reduced += scatter
        collectives += 1 + int(regather) + int(scatter > 0)
        gathers += 1
        if policy.offload.device == "cpu":  # grads out; the stored shard in at each gather (optimizer_only: once)
            host += stored * (1 if policy.offload.optimizer_only else 1 + int(regather)) + scatter // shard
            if policy.offload.optimizer == "nvme":  # the state in, then out
                nvme += 2 * STATE_TENSORS[optimizer] * trained
    return CommBytes(shard, forward, backward, reduced, collectives, host, nvme, gathers)


def _encoded(
    rows: int, shard: int, bytes_per_weight: float | None, dtype: torch.dtype, encoding: str | None, block: int
) -> int:
    """Bytes of one parameter's slot in a collective buffer: ``shard`` chunks of ``rows`` elements (its padded
    shard), at ``bytes_per_weight``, or quantized as the runtime lays it out (``_runtime.quantize.encoded_sizes``:
    the rows padded to whole ``block``s of 1-byte codes, plus a 4-byte fp32 scale per block), or in ``dtype``."""
    if bytes_per_weight is not None:
        return shard * math.ceil(rows * bytes_per_weight)
    if encoding is not None:
        codes, scales = encoded_sizes(rows, block)
        return shard * (codes + 4 * scales)
    return shard * rows * element_size(dtype)


def _reshards(value: bool | int | str, root: bool) -> bool:
    """Whether a group frees its unsharded parameters after forward (so backward all-gathers again):
    ``auto`` is False for the root, True for the others; an int reshards to a smaller group (counted as a
    full re-gather, an upper bound)."""
    if value == "auto":
        return not root
    return value is not False


def model_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, hidden size) of a Hugging Face model (``num_hidden_layers``, ``hidden_size``) or fsdp2lite's
    GPT (``n_layers``, ``d_model``), for the attention term; (0, 0) for other models (no attention term)."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    for layers, hidden in (("num_hidden_layers", "hidden_size"), ("n_layers", "d_model")):
        values = getattr(config, layers, None), getattr(config, hidden, None)
        if all(isinstance(v, int) for v in values):
            return values  # type: ignore[return-value]
    return 0, 0


def plan_step_time(
    model: nn.Module,
    plan: Plan,
    *,
    shard: int,
    world_size: int,
    tokens_per_gpu: int,
    seq: int,
    link: str | Link,
    gpu: str | Gpu,
    finetune: Finetune = "full",
    nf4: Collection[str] = (),
    optimizer: str = "adamw",
    nvme_gb_per_s: float = NVME_GB_PER_S,
    schedule: Literal["cuda", "cpu"] = "cuda",
) -> StepTime:
    """``step_time`` of a planned model: its parameters and trainable ones counted from the plan, the
    attention term from its shape (``model_shape``), checkpointing from the groups' policies, and the
    bytes its collectives carry (``comm_bytes``; ``nf4``: parameter paths sent as NF4); ``optimizer`` and
    ``nvme_gb_per_s`` (this rank's share of the drive) time NVMe's optimizer state."""
    params = [p for group in plan.params for p in group.values()] + list(plan.ignored.values())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    checkpointing = any(group.policy.activation_checkpointing for group in plan.groups)
    layers, hidden = model_shape(model)
    sent = comm_bytes(plan, shard, {name: NF4_BYTES for name in nf4}, optimizer)
    named = {name: p for group in plan.params for name, p in group.items()}
    nf4_values = float(sum(named[name].numel() for name in nf4 if name in named))
    head = plain_head(model) if finetune != "full" else None
    recomputed = float(sum(p.numel() for p in head[1].parameters())) if head is not None else 0.0
    return step_time(
        params=float(sum(p.numel() for p in params)),
        tokens_per_gpu=tokens_per_gpu,
        world_size=world_size,
        link=link,
        gpu=gpu,
        comm=sent,
        finetune=finetune,
        trainable_params=float(trainable),
        checkpointing=checkpointing,
        attention_flops_per_token=attention_flops(layers, hidden, seq),
        nvme_gb_per_s=nvme_gb_per_s,
        schedule=schedule,
        nf4_values=nf4_values,
        recomputed_params=recomputed,
    )
