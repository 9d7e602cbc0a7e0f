"""The founding job, built and stepped with real tensors: a Hugging Face Llama with peft's LoRA adapters and
(for qlora) torchao's NF4 base, sharded by the config the planner writes, as rank 0 of torch's fake process group
of ``world`` ranks (every shard its real size; collectives move no data), one training step measured by the
bytes the allocator hands out.

[Note: live allocator bytes]
On CPU every tensor's storage comes from c10's CPU allocator, which reports each allocation and free to the
profiler (``profile_memory=True``): the running sum of those events is the bytes live at every moment, op
temporaries included (torchao's int64 index tensors, a kernel's scratch tensors), which a dispatch-level tracker
never sees. The peak of that sum within a phase is what a device with an exact allocator would need for it.
On CUDA the same run reads ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` per phase instead.

[Note: offload measured on CPU]
With every group offloaded (``offload: {device: cpu}``), a GPU run keeps the shards, the adapters' fp32
masters, their optimizer state and each group's host gradient buffer in host memory, and the device holds only
what a step gathers, computes and reduces. On CPU both are one allocator, so the device's share of a peak is the
peak less what was live when the step began other than the model's buffers (all of it host-resident then); the
sharded gradients a GPU run copies to the host as each group's backward ends are counted on the device here,
a slight overstatement.

The model is built as ``examples/train.py`` builds it for a per-rank load (meta device, adapters, NF4 on meta,
``apply_config``, ``to_empty``); the bytes ``to_empty`` leaves are then filled with small values (the weights'
values change no allocation; denormals would only slow the CPU). The optimizer state exists before the measured
step, as in a steady step: a first step at a short sequence makes it.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2lite as fl
from fsdp2lite import finetune

PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepMemory:
    """What one measured step allocated on rank 0: bytes live before it, the peak of each phase, after it."""

    before: int  # live at the step's start (shards, adapters, optimizer state, buffers)
    peaks: dict[str, int]  # phase -> the most bytes live during it
    after: dict[str, int]  # phase -> bytes live at its end
    reserved: dict[str, int] = field(default_factory=dict)  # CUDA: phase -> max reserved
    step_s: float = 0.0  # the measured step's wall time (CUDA: synchronized)

    @property
    def peak(self) -> int:
        return max(self.peaks.values())

    @property
    def phase(self) -> str:
        return max(self.peaks, key=lambda name: self.peaks[name])


class LiveBytes:
    """Bytes live in the CPU allocator over a run, from the profiler's memory events ([Note: live allocator
    bytes]). ``mark(name)`` records the running position; ``peak_between(a, b)`` and ``live_at(a)`` read it."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._marks: dict[str, int] = {}
        self._deltas: list[tuple[int, int]] = []

    def __enter__(self) -> LiveBytes:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        events = self._profile.profiler.kineto_results.events()  # type: ignore[union-attr]
        self._deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        self._marks = {e.name()[5:]: e.start_ns() for e in events if e.name().startswith("mark:")}

    def mark(self, name: str) -> None:
        """A zero-length range named ``mark:<name>``: its start is this moment on the profiler's clock."""
        with torch.profiler.record_function(f"mark:{name}"):
            pass

    def _running(self) -> Iterator[tuple[int, int]]:
        live = 0
        for when, delta in self._deltas:
            live += delta
            yield when, live

    def live_at(self, name: str) -> int:
        at, live = self._marks[name], 0
        for when, running in self._running():
            if when > at:
                break
            live = running
        return live

    def peak_between(self, start: str, end: str) -> int:
        low, high = self._marks[start], self._marks[end]
        peak = self.live_at(start)
        for when, running in self._running():
            if low < when <= high:
                peak = max(peak, running)
        return peak


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[None]:
    """Rank 0 of torch's fake process group of ``world`` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Any:
    """A Llama-3-shaped ``LlamaConfig`` (untied embedding and head, sdpa attention)."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build(
    hf_config: Any,
    kind: str,
    config: fl.FSDPConfig,
    world: int,
    device: torch.device,
    rank: int = 16,
    target: str = "cuda",
) -> nn.Module:
    """The job's model on this rank, as examples/train.py builds it for a per-rank load (module docstring), with
    ``target``'s schedule defaults and reduction where the config says ``auto`` (a CPU run standing for a GPU)."""
    import transformers

    from fsdp2lite.estimate.simulate import target_device_settings

    mesh = fl.init_mesh(replicate=config.mesh.replicate, shard=config.mesh.shard, device_type=device.type)
    shard_size = mesh["shard"].size() if mesh.ndim > 1 else mesh.size()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16)
        model = finetune.apply_lora(model, finetune.LoraSettings(rank=rank))
    if kind == "qlora":
        finetune.quantize_base(model, shard_size=shard_size, device=device)
    fl.apply_config(model, config, mesh)
    target_device_settings(model, config, target)
    model.to_empty(device=device)
    fill_small(model)
    return model


@torch.no_grad()
def fill_small(model: nn.Module) -> None:
    """Small finite values in every floating tensor and NF4 code: ``to_empty`` leaves whatever bytes were there."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for inner in _inner_tensors(local):  # in place, on the tensor's device: nothing else is allocated
            if inner.is_floating_point():
                inner.uniform_(0.01, 0.03)
            elif inner.dtype in (torch.uint8, torch.int8):
                inner.random_(0, 16)


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    whole = getattr(tensor, "whole", None)  # fsdp2lite's NF4Rows: codes, scales and the shared constants
    if whole is not None:
        return [tensor.codes, tensor.scalers, whole.quantization_factor, whole.scaler_mean]  # type: ignore[attr-defined]
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [t for name in names for t in _inner_tensors(getattr(tensor, name))]


def step_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The training loss examples/train.py computes on a text window (``finetune.data``'s)."""
    from fsdp2lite.finetune.data.text import window_loss

    return window_loss(model, tokens)


def measure_job(
    build_model: Callable[[], nn.Module],
    seq: int,
    batch: int,
    vocab: int,
    device: torch.device,
    warmup_seq: int = 16,
    host_resident: bool = False,
) -> tuple[StepMemory, int]:
    """Build the model, step once at ``warmup_seq`` (the optimizer state is made), then measure a step at
    ``seq``: (the measured step, bytes live after the build). ``host_resident``: every group's shards are
    offloaded, and the step's device peaks leave out what a GPU run keeps on the host ([Note: offload measured
    on CPU])."""
    if device.type == "cuda":  # the warm-up at the measured length too: the timed step is a steady one
        model = build_model()
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated()
        step = _stepper(model, batch, vocab, device)
        step(seq, lambda _: None)
        return _measure_cuda(step, seq), built
    gc.collect()  # what an earlier run left to the collector is freed before the count starts
    with LiveBytes() as live:
        model = build_model()
        live.mark("built")
        step = _stepper(model, batch, vocab, device)
        step(warmup_seq, lambda _: None)
        gc.collect()
        started = time.perf_counter()
        step(seq, live.mark)
        seconds = time.perf_counter() - started
    bounds = ("start", *PHASES)
    peaks = {phase: live.peak_between(bounds[i], phase) for i, phase in enumerate(PHASES)}
    after = {phase: live.live_at(phase) for phase in PHASES}
    if host_resident:  # [Note: offload measured on CPU]
        on_host = live.live_at("start") - sum(b.numel() * b.element_size() for b in model.buffers())
        peaks = {phase: peak - on_host for phase, peak in peaks.items()}
        after = {phase: value - on_host for phase, value in after.items()}
    return StepMemory(live.live_at("start"), peaks, after, step_s=seconds), live.live_at("built")


def _stepper(
    model: nn.Module, batch: int, vocab: int, device: torch.device
) -> Callable[[int, Callable[[str], None]], None]:
    """A training step at a sequence length, marking its phases: loss, backward, AdamW on the adapters."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)

    def step(seq: int, mark: Callable[[str], None]) -> None:
        window = torch.randint(0, vocab, (batch, seq + 1), generator=generator).to(device)
        mark("start")
        loss = step_loss(model, window)
        mark("forward")
        loss.backward()
        mark("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("optimizer")

    return step


def _measure_cuda(step: Callable[..., None], seq: int) -> StepMemory:
    peaks: dict[str, int] = {}
    after: dict[str, int] = {}
    reserved: dict[str, int] = {}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        if name == "start":
            torch.cuda.reset_peak_memory_stats()
            return
        peaks[name] = torch.cuda.max_memory_allocated()
        reserved[name] = torch.cuda.max_memory_reserved()
        after[name] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    started = time.perf_counter()
    step(seq, mark)
    return StepMemory(before, peaks, after, reserved=reserved, step_s=time.perf_counter() - started)


def gib(nbytes: float) -> float:
    return round(nbytes / 2**30, 3)


def per_layer(measured: dict[int, float], layers: int) -> float:
    """The figure at ``layers`` from two depths measured, extrapolated along the line through them."""
    (d1, m1), (d2, m2) = sorted(measured.items())[:2]
    return m1 + (layers - d1) * (m2 - m1) / (d2 - d1)
