"""The CUDA paths (NCCL, device buffers, pinned host shards). Marked ``gpu``: skipped without CUDA.

World size 1 with NCCL in this process: the same sharding code path as many ranks (one code path for
every world size), on a real GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import TINY_GPT, gpt_batch, gpt_loss
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.models import GPT

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def nccl_pg() -> Iterator[None]:
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=DEVICE)
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_device(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in batch)


def shard(model: nn.Module, **kwargs: object) -> nn.Module:
    for block in model.blocks:
        fl.fully_shard(block, **kwargs)  # type: ignore[arg-type]
    fl.fully_shard(model, **kwargs)  # type: ignore[arg-type]
    return model


def _train_pair(model: nn.Module, ref: nn.Module, steps: int = 3) -> None:
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    for step in range(steps):
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5, msg=name)


def test_parity_with_plain_model_on_cuda() -> None:
    torch.manual_seed(0)
    ref = GPT(TINY_GPT).to(DEVICE)
    model = shard(copy.deepcopy(ref))
    _train_pair(model, ref)
    assert all(isinstance(p, DTensor) and p.device == DEVICE for p in model.parameters())


def test_bf16_matches_torch_fully_shard_on_cuda() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ours = GPT(TINY_GPT).to(DEVICE)
    theirs = copy.deepcopy(ours)
    shard(ours, mp_policy=fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32"))
    for block in theirs.blocks:
        torch_fully_shard(block, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    torch_fully_shard(theirs, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(5):
        losses = []
        for m, opt in zip((ours, theirs), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 2e-3, (step, losses)


def test_cpu_offload_on_cuda() -> None:
    torch.manual_seed(0)
    ref = GPT(TINY_GPT).to(DEVICE)
    model = shard(copy.deepcopy(ref).cpu(), offload_policy=fl.CPUOffloadPolicy(pin_memory=True))
    for name, p in model.named_parameters():
        assert p.to_local().device.type == "cpu" and p.to_local().is_pinned(), name
        assert p.device_mesh.device_type == "cuda", name  # NCCL job: the GPU computes
    seen: list[torch.device] = []
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.append(m.weight.device))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    for step in range(3):
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            if m is model:
                assert seen and seen[-1] == DEVICE, seen  # all-gathered onto the GPU for compute
                for name, p in m.named_parameters():
                    local = p.grad.to_local()
                    assert local.device.type == "cpu" and local.is_pinned(), name
            opt.step()  # the offloaded model's optimizer steps on the host
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_local(), q.detach().cpu(), rtol=1e-4, atol=1e-5, msg=name)


def test_delayed_side_streams_keep_parity() -> None:
    """Spin the GPU on the collective streams before each collective: a compute stream that does not
    wait on the right event reads unfinished buffers and the numbers go wrong."""
    from _collectives import wrapped_collectives

    def delayed(kind, fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            torch.cuda._sleep(2_000_000)  # on the current (side) stream: delays what follows on it
            return fn(*args, **kwargs)

        return run

    torch.manual_seed(0)
    ref = GPT(TINY_GPT).to(DEVICE)
    model = shard(copy.deepcopy(ref))
    model.set_forward_prefetch_depth(2)
    with wrapped_collectives(delayed):
        _train_pair(model, ref)


def test_cuda_schedule_uses_side_streams_and_prefetches() -> None:
    torch.manual_seed(0)
    model = shard(GPT(TINY_GPT).to(DEVICE))
    gpt_loss(model, on_device(gpt_batch(0, 0))).backward()
    comm = model._fsdp_state.root_context.comm
    assert comm is not None and comm.streams is not None and set(comm.streams) >= {"all_gather", "reduce_scatter"}
    with fl.record_trace(model) as trace:
        gpt_loss(model, on_device(gpt_batch(1, 0))).backward()
    names = [(e.name, e.group) for e in trace.events]
    backward_start = names.index(("backward", "<root>"))
    # backward prefetch at pre-backward (the CUDA default): blocks.0's all-gather is issued before
    # blocks.1 computes its backward, and before blocks.1's reduce-scatter is waited on
    assert model._fsdp_state.root_context.late_backward_prefetch is False
    prefetch = names.index(("all_gather_issue", "blocks.0"), backward_start)
    assert prefetch < names.index(("backward", "blocks.1"), backward_start), names
    waited = names.index(("reduce_scatter_wait", "blocks.1"), backward_start)
    assert prefetch < waited, names


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-fp32-reduce"])
def test_peak_memory_not_above_torch_fully_shard(mixed_precision: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cfg = TINY_GPT.__class__(vocab_size=1024, seq_len=64, d_model=512, n_heads=8, n_layers=4, tie_embeddings=False)
    peaks = []
    for which in ("ours", "torch"):
        torch.manual_seed(0)
        model = GPT(cfg).to(DEVICE)
        if which == "ours":
            policy = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32") if mixed_precision else None
            shard(model, mp_policy=policy)
        else:
            kwargs = {"mp_policy": TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
            for block in model.blocks:
                torch_fully_shard(block, **(kwargs if mixed_precision else {}))
            torch_fully_shard(model, **(kwargs if mixed_precision else {}))
        batch = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), device=DEVICE)
        model.loss(batch[:, :-1], batch[:, 1:]).backward()  # warm-up: lazy init, allocator
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model.loss(batch[:, :-1], batch[:, 1:]).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
        torch.cuda.empty_cache()
    assert peaks[0] <= peaks[1], f"fsdp2lite step peak {peaks[0]} > torch fully_shard {peaks[1]}"


def test_post_optim_event_and_all_reduce_hook_stream() -> None:
    """set_post_optim_event: the root's all-gathers wait on the event recorded after each optimizer
    step (consumed, so it is set again every step); set_all_reduce_hook(stream=...): the hook runs on
    that stream once per backward per block. Training matches the plain model."""
    torch.manual_seed(0)
    ref = GPT(TINY_GPT).to(DEVICE)
    model = shard(copy.deepcopy(ref))
    stream = torch.cuda.Stream(DEVICE)
    seen: list[torch.cuda.Stream] = []
    for block in model.blocks:
        block.set_all_reduce_hook(lambda reduced: seen.append(torch.cuda.current_stream(DEVICE)), stream=stream)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    for step in range(3):
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = gpt_loss(m, on_device(gpt_batch(step, 0)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        event = torch.cuda.Event()
        event.record()
        model.set_post_optim_event(event)
        assert model._fsdp_state.root_context.post_optim_event is event
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert len(seen) == 3 * TINY_GPT.n_layers and all(s == stream for s in seen), seen
    gpt_loss(model, on_device(gpt_batch(3, 0))).backward()
    assert model._fsdp_state.root_context.post_optim_event is None, "the event was not consumed"
