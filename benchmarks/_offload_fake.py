"""bench_offload.py's fake-world half: one process, rank 0 of an N-rank job on torch's fake process group, the model
on a GPU (or on CPU, to exercise the same code without one), its shards offloaded to host memory.

[Note: bench_offload on a fake process group]
The fake group's collectives return at once and move no data: every shard, gradient shard and AdamW state has its
real size for a world of N, so the host step (``optimizer.step()`` over this rank's shards) is the one a rank of an
N-rank job runs, and the whole step is this rank's compute plus each runtime's own work, without communication.
The values are not: an all-gather's output and a reduce-scatter's are never written, so the parameters the forward
sees, the losses and the gradients are whatever the buffers held. The losses are therefore not reported, and
denormals are flushed to zero for the run (``torch.set_flush_denormal``): garbage that happens to be subnormal
would otherwise slow the host's arithmetic by its values, not by the work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _offload_runs import (
    SETUPS,
    Placement,
    build,
    extra_step,
    group_flags,
    make_batch,
    rank0_metered,
    time_interleaved,
)
from torch.distributed.device_mesh import init_device_mesh

from fsdp2lite.models import GPT, GPTConfig


def placement(device: str) -> Placement:
    """cuda: pinned host memory; cpu: pageable (nothing to pin for). Both: bf16 parameters, fp32 reduction, and the
    rival's AdamW with ``foreach=True`` (torch's multi-tensor path, as bench_gpu.py steps)."""
    return Placement(device, pin_memory=device == "cuda", mixed_precision=True, foreach=True)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # the step's kernels and copies done: they are the step's time


def measure_fake(
    device: str, world_size: int, config: GPTConfig, batch_size: int, warmup: int, steps: int
) -> dict[str, Any]:
    """Every run built on ``device``, timed interleaved (synchronized before each step and before its clock
    stops), then one metered step each; rank 0's own numbers ([Note: bench_offload on a fake process group])."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    flushed = torch.set_flush_denormal(True)  # False where the CPU cannot: then nothing changed
    try:
        mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("shard",))
        batch = make_batch(config, batch_size, 0, device)
        runs = [build(setup, config, mesh, placement(device)) for setup in SETUPS]

        def sync() -> None:
            _synchronize(device)

        times = time_interleaved(runs, batch, warmup, steps, before=sync, finish=sync)
        metered = [extra_step(run, batch) for run in runs]
        flags = {s.name: group_flags(run.optimizers) for s, run in zip(SETUPS, runs, strict=True)}
    finally:
        if flushed:
            torch.set_flush_denormal(False)  # this process's default again (a test runs it in pytest's)
        dist.destroy_process_group()
    return {
        "n_params": _n_params(config),
        "step_s": {s.name: times[i, :, 0].tolist() for i, s in enumerate(SETUPS)},
        "host_step_s": {s.name: times[i, :, 1].tolist() for i, s in enumerate(SETUPS)},
        "losses": None,  # fake collectives: the values are garbage
        **rank0_metered(metered),
        "grad_bytes_after_backward": {s.name: float(m.grad_bytes) for s, m in zip(SETUPS, metered, strict=True)},
        "param_groups": flags,
        "denormals_flushed": flushed,
        "host_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
    }


def _n_params(config: GPTConfig) -> int:
    with torch.device("meta"):  # the count without the bytes
        return sum(p.numel() for p in GPT(config).parameters())
