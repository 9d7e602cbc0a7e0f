"""A group's two collectives, each with its copy-in and copy-out.

All-gather (one per group per use), two ranks, params a (3 rows) and b (2 rows), padded_rows 2 and 1:

    rank0 shards: a[0:2], b[0]         -> all_gather_input rank0 = [a0 a1 | b0]
    rank1 shards: a[2] + pad, b[1]     -> all_gather_input rank1 = [a2 0  | b1]
    all-gather -> all_gather_output = [a0 a1 b0 | a2 0 b1]      # (shard_size * group_numel,)
    copy-out: view (shard_size, group_numel); column block of a -> rows a0 a1 a2, pad dropped

Reduce-scatter (one per group per backward), the same layout in reverse, averaged:

    rank0 grads a=[1,2,3] b=[4,5] -> reduce_scatter_input [1 2 4 | 3 0 5]
    rank1 grads a=[3,4,5] b=[6,7] -> reduce_scatter_input [3 4 6 | 5 0 7]
    reduce-scatter(sum) / 2       -> rank0 [2 3 5] (a0 a1 b0), rank1 [4 0 6] (a2 pad b1)

[Note: buffer lifetime]
Each flat buffer is owned by its result record (``AllGatherResult``/``ReduceScatterResult``), and the
record is dropped only after its work has been waited on and its output consumed; dropping the record
is what frees the buffers. Nothing relies on the allocator seeing a later use (no ``record_stream``).
The all-gather runs in place: its input is this rank's slot of its output, so an unshard allocates the
group's bytes once for the collective and once for the unsharded parameters (copy-out), 2x the group's
bytes at most. A separate input buffer would add 1/shard_size of that, and its release would depend on
when the backend's worker thread lets go of the finished work.

[Note: gloo reduce-scatter]
gloo has no reduce-scatter algorithm: torch's gloo backend runs ``reduce_scatter_tensor`` as a clone of
the whole input, an all-reduce of the clone, and a copy of this rank's chunk out of it when waited on;
the clone lives as long as the Work. On a gloo group fsdp2lite issues that all-reduce itself, in place
on ``reduce_scatter_input``, and takes this rank's slot of it as the output (cloned once waited, so the
flat buffer can go). The same example as above:

    rank0 reduce_scatter_input [1 2 4 | 3 0 5], rank1 [3 4 6 | 5 0 7]
    all-reduce(sum), in place -> both [4 6 10 | 8 0 12]
    rank0 keeps slot 0 [4 6 10], rank1 slot 1 [8 0 12]; / 2 -> [2 3 5], [4 0 6]

The bytes on the wire are the same; the clone is gone: a group's reduction holds 1x its unsharded
bytes instead of 2x, plus its sharded output (benchmarks/gloo_memory.py measures both collectives).
On every other backend (NCCL, the fake process group) the reduce-scatter is a native one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import Comm
from .param import FSDPParam, padding_views, rank_major_pairs

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.6-2.12 only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_all_reduce = dist.all_reduce


def reduces_in_place(group: dist.ProcessGroup, device: torch.device) -> bool:
    """True when ``group`` reduces CPU tensors with gloo: [Note: gloo reduce-scatter]."""
    if device.type != "cpu":
        return False  # CUDA tensors go through NCCL's native reduce-scatter and the stream schedule
    return cpu_backend(str(dist.get_backend(group))) == "gloo"


def cpu_backend(backend: str) -> str:
    """The backend a process group's backend string uses for CPU tensors: "gloo" -> "gloo",
    "cpu:gloo,cuda:nccl" -> "gloo", "nccl" -> "nccl" (it has no CPU backend of its own)."""
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        if device in ("", "cpu"):
            return name
    return backend


def _reduce_scatter_flat(
    reduce_scatter_output: torch.Tensor,
    reduce_scatter_input: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    in_place: bool,
    async_op: bool,
) -> dist.Work | None:
    """One reduce-scatter(sum): ``reduce_scatter_input`` (shard_size * n,) into ``reduce_scatter_output`` (n,).

    ``in_place`` (gloo): the output is this rank's slot of the input and the input is all-reduced in
    place ([Note: gloo reduce-scatter])."""
    if in_place:
        return dist.all_reduce(reduce_scatter_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _native_reduce_scatter(
        reduce_scatter_output, reduce_scatter_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


class AllGatherResult(NamedTuple):
    """An all-gather in flight, holding its buffer until the consumer has waited on it."""

    all_gather_output: torch.Tensor  # (group_size * group_numel,)
    all_gather_input: torch.Tensor  # (group_numel,): this rank's slot of all_gather_output
    work: dist.Work | None  # CPU: wait on it
    event: torch.cuda.Event | None  # CUDA: the compute stream waits on it


class ReduceScatterResult(NamedTuple):
    """A reduce-scatter in flight, with the parameters its output slots belong to."""

    reduce_scatter_output: torch.Tensor  # (group_numel,): a buffer, or (in place) this rank's slot of the input
    reduce_scatter_input: torch.Tensor  # (shard_size * group_numel,)
    in_place: bool  # gloo: [Note: gloo reduce-scatter]
    params: tuple[FSDPParam, ...]
    grads: tuple[torch.Tensor, ...]  # the unsharded grads it reads, held until it is waited on
    work: dist.Work | None
    event: torch.cuda.Event | None


def _offsets(numels: list[int]) -> list[int]:
    offsets = [0]
    for numel in numels:
        offsets.append(offsets[-1] + numel)
    return offsets


def _row_numel(param: FSDPParam) -> int:
    return param.orig_shape.numel() // param.orig_shape[0]


def issue_all_gather(
    sources: list[torch.Tensor],
    group: dist.ProcessGroup,
    group_size: int,
    group_rank: int,
    dtype: torch.dtype,
    comm: Comm,
) -> AllGatherResult:
    """Copy ``sources`` (this rank's flat padded shards) into this rank's slot of one flat buffer and
    start one in-place all-gather over ``group``.

    The input is a view of the output (``output[rank * group_numel : (rank + 1) * group_numel]``), so the
    all-gather allocates the group's bytes once: [Note: buffer lifetime].
    """
    offsets = _offsets([source.numel() for source in sources])
    with comm.on("all_gather_copy_in"):
        all_gather_output = torch.empty(group_size * offsets[-1], dtype=dtype, device=comm.device)
        all_gather_input = all_gather_output.narrow(0, group_rank * offsets[-1], offsets[-1])  # (group_numel,)
        for source, start, end in zip(sources, offsets, offsets[1:]):
            all_gather_input[start:end].copy_(source, non_blocking=True)  # copy-in, cast in one pass
    copied_in = comm.record("all_gather_copy_in")
    with comm.after("all_gather", copied_in):  # the collective reads what the copy-in wrote
        work = _all_gather_flat(all_gather_output, all_gather_input, group=group, async_op=comm.async_work)
    return AllGatherResult(all_gather_output, all_gather_input, work, comm.record("all_gather"))


def wait_all_gather(result: AllGatherResult, comm: Comm) -> torch.Tensor:
    """Make the compute side wait for the all-gather and hand back its output."""
    comm.wait(result.work, result.event)  # the output is complete (CPU) or ordered (CUDA) after this
    return result.all_gather_output


def copy_out_all_gather(
    all_gather_output: torch.Tensor, params: tuple[FSDPParam, ...], group_size: int, padded_rows: list[int]
) -> None:
    """Copy each parameter's rows out of the rank-major all-gather output into unsharded storage."""
    offsets = _offsets([rows * _row_numel(p) for p, rows in zip(params, padded_rows)])
    rank_major = all_gather_output.view(group_size, offsets[-1])
    for param, rows, start, end in zip(params, padded_rows, offsets, offsets[1:]):
        unsharded = param.alloc_unsharded()
        for full_part, gathered_part in rank_major_pairs(unsharded, rank_major[:, start:end], rows):
            full_part.copy_(gathered_part)


def post_forward_shards(params: tuple[FSDPParam, ...], size: int, rank: int) -> tuple[torch.Tensor, list[int]]:
    """This rank's chunk of every unsharded parameter when sharded over ``size`` ranks, in one flat buffer.

    Returns (buffer (group_numel,), padded rows per parameter). Chunking follows torch.chunk, padded
    like the main shards, so ``copy_out_all_gather`` restores the parameters from a ``size``-rank gather.
    """
    padded_rows = [math.ceil(p.orig_shape[0] / size) for p in params]
    offsets = _offsets([rows * _row_numel(p) for p, rows in zip(params, padded_rows)])
    buffer = torch.zeros(offsets[-1], dtype=params[0].param_dtype, device=params[0].device)
    for param, rows, start in zip(params, padded_rows, offsets):
        unsharded = param.alloc_unsharded().view(param.orig_shape[0], -1)  # (dim0, row_numel)
        local = unsharded[rank * rows : (rank + 1) * rows]  # torch.chunk's piece; may be short or empty
        buffer[start : start + local.numel()].copy_(local.reshape(-1))
    return buffer, padded_rows


def issue_reduce_scatter(
    params: tuple[FSDPParam, ...],
    grads: list[torch.Tensor | None],
    group: dist.ProcessGroup,
    shard_rank: int,
    shard_size: int,
    dtype: torch.dtype,
    comm: Comm,
) -> ReduceScatterResult:
    """Lay the unsharded grads out rank-major in one flat buffer and start one reduce-scatter(sum).

    Takes the caller's list: on CPU each grad is dropped from it once copied in, so the grads and the
    flat buffer are not both held whole."""
    offsets = _offsets([p.padded_numel for p in params])
    in_place = reduces_in_place(group, comm.device)
    with comm.on("reduce_scatter"):  # after the backward kernels that wrote the grads
        reduce_scatter_input = torch.empty(shard_size * offsets[-1], dtype=dtype, device=comm.device)
        rank_major = reduce_scatter_input.view(shard_size, offsets[-1])
        for index, (param, start, end) in enumerate(zip(params, offsets, offsets[1:])):
            grad, block = grads[index], rank_major[:, start:end]
            if grad is None:
                raise RuntimeError(f"reduce-scatter copy-in: grad {index} of {len(params)} was already released")
            for full_part, scattered_part in rank_major_pairs(grad, block, param.padded_rows):
                scattered_part.copy_(full_part)  # copy-in, cast in one pass
            for pad in padding_views(block, grad.shape[0], param.padded_rows):
                pad.zero_()
            if comm.async_work:
                grads[index] = None  # CPU: copied, so free it now, not after the whole group
        if in_place:
            reduce_scatter_output = rank_major[shard_rank]  # (group_numel,) view: [Note: gloo reduce-scatter]
        else:
            reduce_scatter_output = torch.empty(offsets[-1], dtype=dtype, device=comm.device)
        work = _reduce_scatter_flat(
            reduce_scatter_output, reduce_scatter_input, group=group, in_place=in_place, async_op=comm.async_work
        )
    event = comm.record("reduce_scatter")
    # CUDA: the reduce-scatter stream reads the grads, so they are held until it is waited on
    held = () if comm.async_work else tuple(g for g in grads if g is not None)
    return ReduceScatterResult(reduce_scatter_output, reduce_scatter_input, in_place, params, held, work, event)


def finish_reduce_scatter(
    result: ReduceScatterResult,
    divide_factor: float,
    replicate_group: dist.ProcessGroup | None,
    all_reduce: bool,
    comm: Comm,
) -> None:
    """Wait for the reduce-scatter; for HSDP, all-reduce (sum) across replicas; average; accumulate into
    each sharded ``.grad``.

    HSDP with ``all_reduce=False`` keeps the replica-local sums on the parameters instead
    (``partial_reduced_grad``); the next all-reduce adds them in, so nothing is lost.
    Example, 2 replicas x 2 shards: rank (r0,s0) holds after the reduce-scatter the sum of s0-slots over
    its replica; the all-reduce adds replica r1's sum for the same slot; dividing by 4 gives DDP's mean.
    """
    comm.wait(result.work, None)  # CPU: the output is written; CUDA orders through events below
    output, event = result.reduce_scatter_output, result.event
    if result.in_place:
        output = output.clone()  # (group_numel,), off the flat input: [Note: gloo reduce-scatter]
    comm.release(result.reduce_scatter_input)  # CPU: waited on (and the slot copied), nothing reads it now
    slots = _slots(output, result.params)
    if replicate_group is not None and all_reduce:
        with comm.after("all_reduce", event):  # the all-reduce reads the reduce-scatter output
            folded = [param.add_partial_reduced_grad(slot) for param, slot in slots]
            work = _all_reduce(output, op=dist.ReduceOp.SUM, group=replicate_group, async_op=comm.async_work)
        comm.wait(work, None)
        comm.retire("all_reduce", folded)
        event = comm.record("all_reduce")
    comm.wait(None, event)  # CUDA: the compute stream reads the reduced output from here on
    if replicate_group is not None and not all_reduce:
        for param, slot in slots:
            param.keep_partial_reduced_grad(slot)
    else:
        if divide_factor != 1.0:
            output.div_(divide_factor)
        for param, slot in slots:
            param.accumulate_sharded_grad(slot)
    comm.retire("reduce_scatter", result)


def _slots(output: torch.Tensor, params: tuple[FSDPParam, ...]) -> list[tuple[FSDPParam, torch.Tensor]]:
    offsets = _offsets([p.padded_numel for p in params])
    return [(param, output[start:end]) for param, start, end in zip(params, offsets, offsets[1:])]
